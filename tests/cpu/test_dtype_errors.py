"""Unsupported dtypes: the error names the operation, the dtype and the supported set
(docs/architecture.md, Conventions), is raised on the calling rank before anything is communicated, and leaves the communicator
usable. Reference: the message text itself and a following all_reduce checked against an fp64 sum.
(The GPU launchers' own dtype dispatch gives the same message; tests/gpu reach it.)"""
import pytest
import torch

SUPPORTED = "supported: float32, float16, bfloat16"
BAD_DTYPES = [torch.int8, torch.int32, torch.int64, torch.float64]


def _dtype_errors(ctx):
    import commlib
    comm = ctx.comm
    for dtype in BAD_DTYPES:
        name = str(dtype).removeprefix("torch.")
        x = torch.ones(17, dtype=dtype)
        with pytest.raises(TypeError, match=rf"all_reduce: dtype {name} not supported; {SUPPORTED}"):
            comm.all_reduce(x)
        rows = torch.ones(3, 8, dtype=dtype)
        with pytest.raises(TypeError, match=rf"fused_allreduce_rmsnorm: dtype {name} not supported; {SUPPORTED}"):
            comm.fused_allreduce_rmsnorm(rows, rows.clone(), torch.ones(8, dtype=dtype))
        with pytest.raises(TypeError, match=rf"EPBuffer: dtype (torch\.)?{name} not supported; {SUPPORTED}"):
            commlib.EPBuffer(comm, 4, 8, 2 * ctx.world_size, 1, dtype)
    # Still usable: a float all_reduce on fresh random data equals the fp64 sum of every rank's input.
    inputs = [torch.Generator().manual_seed(100 + r) for r in range(ctx.world_size)]
    data = [torch.randn(1001, generator=g, dtype=torch.float64) for g in inputs]
    t = data[ctx.rank].to(torch.float32)
    comm.all_reduce_(t)
    expected = torch.stack(data).sum(0)
    torch.testing.assert_close(t.double(), expected, rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_unsupported_dtype_names_dtype_and_supported_set(ranks, world_size):
    assert all(ranks(world_size).run(_dtype_errors))

