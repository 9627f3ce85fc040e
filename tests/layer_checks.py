"""Checks shared by the TP-layer tests (tests/cpu/test_tokenweave.py, tests/gpu/test_tokenweave_gpu.py)."""
import torch


def close(got, ref, tol):
    """(ok, worst): every element within tol * (1 + |ref|) of ref (compared in fp64 on the CPU)."""
    got, ref = got.double().cpu(), ref.double().cpu()
    diff = (got - ref).abs()
    return bool((diff <= tol * (1 + ref.abs())).all()), float(diff.max()) if diff.numel() else 0.0


class PoisonEmpty:
    """While active, torch.empty returns NaN-filled tensors (floating dtypes), so an element a
    layer never writes shows up as NaN."""

    def __enter__(self):
        self.real = torch.empty

        def empty(*args, **kwargs):
            t = self.real(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        torch.empty = empty
        return self

    def __exit__(self, *exc):
        torch.empty = self.real
