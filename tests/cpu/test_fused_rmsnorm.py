"""CPU fused all-reduce + residual add + RMSNorm (commlib.fused) over shared memory.

References: (1) commlib's unfused ``all_reduce`` followed by ``commlib.fused.reference_rmsnorm``
(Note [fused rmsnorm arithmetic]) must match bit for bit; (2) an fp64 computation must match
within the dtype's rounding. Outputs are poisoned (NaN) first; sharded rows a rank does not own
must come back untouched.
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
ROOT = Path(__file__).resolve().parents[2]


def make_inputs(rank, world_size, tokens, hidden, dtype, salt=0):
    """x for every rank (ranks' x differ), and the residual and weight shared by all ranks."""
    def gen(seed):
        return torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, hidden, generator=gen(7 * r + 1000 * tokens + hidden + salt), dtype=torch.float64)
          .to(dtype) for r in range(world_size)]
    residual = (torch.randn(tokens, hidden, generator=gen(99 + tokens + salt), dtype=torch.float64) * 2).to(dtype)
    weight = (1 + 0.25 * torch.randn(hidden, generator=gen(5 + hidden + salt), dtype=torch.float64)).to(dtype)
    return xs, residual, weight


def fp64_reference(xs, residual, weight, eps):
    r = residual.double() + sum(x.double() for x in xs)
    rms = torch.sqrt((r * r).mean(dim=1, keepdim=True) + eps)
    return r / rms * weight.double(), r


def poison(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _fused_case(ctx, dtype_name, shapes, eps=1e-6):
    from commlib.fused import reference_rmsnorm, token_slice
    dtype = DTYPES[dtype_name]
    n, rank = ctx.world_size, ctx.rank
    for tokens, hidden in shapes:
        xs, residual0, weight = make_inputs(rank, n, tokens, hidden, dtype)
        # Unfused commlib: all_reduce, then the documented arithmetic.
        summed = xs[rank].clone()
        ctx.comm.all_reduce_(summed)
        ref_out, ref_res = reference_rmsnorm(summed, residual0, weight, eps)
        begin, end = token_slice(tokens, n, rank)
        assert (begin, end) == ctx.comm.token_slice(tokens)
        per_mode = {}
        for mode in ("replicated", "sharded"):
            residual = residual0.clone()
            out = poison((tokens, hidden), dtype)
            x_before = xs[rank].clone()
            got_out, got_res = ctx.comm.fused_allreduce_rmsnorm(xs[rank], residual, weight, eps,
                                                                residual_mode=mode, out=out)
            assert got_out is out and got_res is residual
            where = f"{mode} {dtype_name} tokens={tokens} hidden={hidden} world={n} rank={rank}"
            assert torch.equal(xs[rank], x_before), f"{where}: x was modified"
            assert torch.equal(bits(out), bits(ref_out)), f"{where}: out differs from all_reduce + reference norm"
            if mode == "replicated":
                assert torch.equal(bits(residual), bits(ref_res)), f"{where}: residual differs"
            else:
                assert torch.equal(bits(residual[begin:end]), bits(ref_res[begin:end])), f"{where}: owned residual"
                untouched = torch.ones(tokens, dtype=torch.bool)
                untouched[begin:end] = False
                assert torch.equal(bits(residual[untouched]), bits(residual0[untouched])), \
                    f"{where}: rows not owned were written"
                # The same with a residual holding only the owned slice.
                res_slice = residual0[begin:end].clone()
                out2 = poison((tokens, hidden), dtype)
                ctx.comm.fused_allreduce_rmsnorm(xs[rank], res_slice, weight, eps, residual_mode="sharded", out=out2)
                assert torch.equal(bits(out2), bits(ref_out)), f"{where}: slice-layout out differs"
                assert torch.equal(bits(res_slice), bits(ref_res[begin:end])), f"{where}: slice-layout residual"
            per_mode[mode] = (out, residual)
            if tokens:
                out64, res64 = fp64_reference(xs, residual0, weight, eps)
                tol = TOL[dtype]
                torch.testing.assert_close(out.double(), out64, rtol=tol, atol=tol, msg=f"{where}: vs fp64 out")
                torch.testing.assert_close(residual[begin:end].double(), res64[begin:end], rtol=tol, atol=tol * 4,
                                           msg=f"{where}: vs fp64 residual")
        rep, sh = per_mode["replicated"], per_mode["sharded"]
        assert torch.equal(bits(rep[0]), bits(sh[0]))
        assert torch.equal(bits(rep[1][begin:end]), bits(sh[1][begin:end]))
    return True


SHAPES = [(0, 1024), (1, 1024), (3, 8), (5, 24), (7, 1032), (37, 1024), (64, 4096), (13, 16384)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_fused_matches_unfused_and_fp64(ranks, world_size, dtype_name):
    ranks(world_size).run(_fused_case, dtype_name, SHAPES)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_many_chunks_small_slot(ranks, world_size):
    # 64 KiB slots: hidden 1024 bf16 gives a few rows per rank per round, so many rounds run.
    pool = ranks(world_size, env={"COMMLIB_SHM_SLOT_BYTES": "65536"})
    pool.run(_fused_case, "bfloat16", [(100, 1024), (1, 1024), (61, 2048)])
    pool.run(_fused_case, "float16", [(45, 1024)], 1e-5)


def _token_slices(ctx):
    from commlib.fused import token_slice
    for tokens in (0, 1, 2, 5, 7, 8, 9, 16384, 16385):
        for n in (1, 2, 3, 4, 8):
            slices = [token_slice(tokens, n, r) for r in range(n)]
            c = -(-tokens // n)
            assert slices == [(min(tokens, r * c), min(tokens, (r + 1) * c)) for r in range(n)]
            assert slices[0][0] == 0 and slices[-1][1] == tokens
            assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    assert token_slice(5, 4, 0) == (0, 2) and token_slice(5, 4, 3) == (5, 5)
    return True


def test_token_slice_definition(ranks):
    ranks(1).run(_token_slices)


def _bad_inputs(ctx):
    import commlib  # noqa: F401
    n = ctx.world_size
    bf = torch.bfloat16
    x = torch.randn(6, 1024, dtype=bf)
    res = torch.randn(6, 1024, dtype=bf)
    w = torch.ones(1024, dtype=bf)
    comm = ctx.comm
    cases = [
        (ValueError, "hidden size 12", lambda: comm.fused_allreduce_rmsnorm(
            torch.randn(6, 12, dtype=bf), torch.randn(6, 12, dtype=bf), torch.ones(12, dtype=bf))),
        (ValueError, "hidden size 32768", lambda: comm.fused_allreduce_rmsnorm(
            torch.randn(1, 32768, dtype=bf), torch.randn(1, 32768, dtype=bf), torch.ones(32768, dtype=bf))),
        (ValueError, "residual must have shape", lambda: comm.fused_allreduce_rmsnorm(x, res[:5], w)),
        (ValueError, "weight must have shape", lambda: comm.fused_allreduce_rmsnorm(x, res, w[:512])),
        (ValueError, "out must have x's shape", lambda: comm.fused_allreduce_rmsnorm(
            x, res, w, out=torch.empty(6, 512, dtype=bf))),
        (ValueError, "x must be 2-D", lambda: comm.fused_allreduce_rmsnorm(
            x.reshape(2, 3, 1024), res, w)),
        (TypeError, "dtype mismatch: residual is float16 but x is bfloat16", lambda: comm.fused_allreduce_rmsnorm(
            x, res.half(), w)),
        (TypeError, "dtype mismatch: weight is float32", lambda: comm.fused_allreduce_rmsnorm(x, res, w.float())),
        (TypeError, "dtype int32 not supported", lambda: comm.fused_allreduce_rmsnorm(
            x.int(), res.int(), w.int())),
        (ValueError, "residual_mode 'tp'", lambda: comm.fused_allreduce_rmsnorm(x, res, w, residual_mode="tp")),
        (ValueError, "algo 'nccl'", lambda: comm.fused_allreduce_rmsnorm(x, res, w, algo="nccl")),
        (ValueError, "num_sms 0", lambda: comm.fused_allreduce_rmsnorm(x, res, w, num_sms=0)),
        (ValueError, "must not alias", lambda: comm.fused_allreduce_rmsnorm(x, res, w, out=res)),
        (ValueError, "contiguous", lambda: comm.fused_allreduce_rmsnorm(
            x, torch.randn(1024, 6, dtype=bf).t(), w)),
        (TypeError, "must be a torch.Tensor", lambda: comm.fused_allreduce_rmsnorm(x, [1, 2], w)),
    ]
    if n > 1:
        # A slice-shaped residual is only valid in sharded mode.
        (b, e) = ctx.comm.token_slice(6)
        cases.append((ValueError, "residual_mode 'replicated'", lambda: comm.fused_allreduce_rmsnorm(
            x, res[b:e].clone(), w)))
    for exc, text, call in cases:
        with pytest.raises(exc, match=None) as info:
            call()
        assert text in str(info.value), f"expected {text!r} in {info.value}"
        assert "fused_allreduce_rmsnorm" in str(info.value)
    # The communicator is still usable and correct after every refusal.
    return _fused_case(ctx, "bfloat16", [(6, 1024)])


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_inputs_raise_and_comm_stays_usable(ranks, world_size):
    ranks(world_size).run(_bad_inputs)


def _slot_too_small(ctx):
    x = torch.randn(2, 16384)
    with pytest.raises(ValueError, match="COMMLIB_SHM_SLOT_BYTES"):
        ctx.comm.fused_allreduce_rmsnorm(x, torch.randn(2, 16384), torch.ones(16384))
    return _fused_case(ctx, "bfloat16", [(9, 1024)])


def test_row_larger_than_slot_raises(ranks):
    ranks(2, env={"COMMLIB_SHM_SLOT_BYTES": "65536"}).run(_slot_too_small)


def _slow_peer(ctx):
    import datetime
    import time

    import commlib
    # The op goes through torch.ops.commlib, whose errors the dispatcher carries as
    # DistBackendError; commlib.fused re-raises them as commlib's classes, like every other call.
    comm = ctx.new_comm("fused-slow", timeout=datetime.timedelta(seconds=4))  # 4 s: see test_host_collectives
    comm.barrier()
    if ctx.rank == 1:
        time.sleep(8)
        return "slept"
    xs, residual, weight = make_inputs(0, 2, 5, 64, torch.float32)
    with pytest.raises(commlib.CommTimeoutError, match="Timed out .* rank 0 waiting for rank 1"):
        comm.fused_allreduce_rmsnorm(xs[0], residual, weight)
    with pytest.raises(commlib.PeerError, match="unusable"):
        comm.fused_allreduce_rmsnorm(xs[0], residual, weight)
    comm.close()
    return "timed out"


def test_slow_peer_times_out_with_commlib_errors(ranks):
    assert ranks(2).run(_slow_peer) == ["timed out", "slept"]


def _compiled(ctx):
    from commlib.fused import reference_rmsnorm
    comm = ctx.comm
    n, rank = ctx.world_size, ctx.rank
    xs, residual0, weight = make_inputs(rank, n, 11, 1024, torch.bfloat16, salt=3)

    def step(x, residual, weight):
        out = torch.empty_like(x)
        torch.ops.commlib.fused_allreduce_rmsnorm_out(x * 1, residual, weight, 1e-5, comm.group_name,
                                                      "replicated", 0, "auto", out=out)
        return out + 0

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    residual = residual0.clone()
    out = compiled(xs[rank], residual, weight)
    summed = xs[rank].clone()
    comm.all_reduce_(summed)
    ref_out, ref_res = reference_rmsnorm(summed, residual0, weight, 1e-5)
    assert torch.equal(out, ref_out) and torch.equal(residual, ref_res)
    # Meta kernel: shapes propagate without running the collective.
    with torch.device("meta"):
        xm = torch.empty(11, 1024, dtype=torch.bfloat16)
        outm = torch.empty_like(xm)
    torch.ops.commlib.fused_allreduce_rmsnorm_out(xm, xm.clone(), torch.empty(1024, dtype=torch.bfloat16,
                                                                              device="meta"),
                                                  1e-5, comm.group_name, out=outm)
    assert torch.ops.commlib.fused_allreduce_rmsnorm(xm, xm.clone(), outm[0], 1e-5, comm.group_name).shape == xm.shape
    return True


def test_op_under_torch_compile(ranks):
    ranks(2).run(_compiled)


# ---- NVLink multicast guard (never creates anything: the refusal comes before any driver call) ----

def _multimem_refused(ctx, variable):
    x = torch.randn(4, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as info:
        ctx.comm.fused_allreduce_rmsnorm(x, x.clone(), torch.ones(1024, dtype=torch.bfloat16), algo="multimem")
    assert variable in str(info.value) and "multicast refused" in str(info.value), str(info.value)
    allowed, var, _ = __import__("commlib").fused.multicast_allowed()
    assert not allowed and var == variable
    return _fused_case(ctx, "bfloat16", [(4, 1024)])


@pytest.mark.parametrize("variable,value", [("COMMLIB_DISABLE_MULTICAST", "1")])
def test_multimem_refused_by_kill_switch_env(ranks, variable, value):
    ranks(2, env={variable: value}).run(_multimem_refused, variable)


def test_multicast_decision_logic():
    import commlib
    decide = commlib._C.multicast_decision_for
    assert decide({})[:2] == (False, "COMMLIB_ENABLE_MULTICAST")
    assert decide({"COMMLIB_ENABLE_MULTICAST": "0"})[:2] == (False, "COMMLIB_ENABLE_MULTICAST")
    opt_in = {"COMMLIB_ENABLE_MULTICAST": "1"}  # a dict handed to the pure decision, not the environment
    for var, value in [("COMMLIB_DISABLE_MULTICAST", "1"), ("NCCL_NVLS_ENABLE", "0"),
                       ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")]:
        allowed, decided_by, reason = decide({**opt_in, var: value})
        assert not allowed and decided_by == var and f"{var}={value}" in reason
        # A kill switch wins even without the opt-in, and is named.
        assert decide({var: value})[:2] == (False, var)
    assert decide(opt_in)[0] is True


def test_multicast_refused_in_this_environment(monkeypatch):
    import commlib
    monkeypatch.setenv("COMMLIB_DISABLE_MULTICAST", "1")  # adds a kill switch; unsets nothing
    allowed, var, reason = commlib._C.multicast_allowed()
    assert not allowed and var in ("COMMLIB_DISABLE_MULTICAST",) and var in reason
    with pytest.raises(ValueError, match="COMMLIB_DISABLE_MULTICAST"):
        commlib._C.require_multicast("test")


def _workspace_refused(ctx):
    import commlib
    allowed, variable, _ = commlib.fused.multicast_allowed()
    assert not allowed
    # The communicator's entry to the multicast workspace refuses first: with no GPU here, any CUDA
    # call before the guard would raise commlib.CommError instead of this ValueError.
    with pytest.raises(ValueError, match=f"multicast transport: NVLink multicast refused: {variable}="):
        commlib._C.multicast_workspace_bytes(ctx.comm.group_name, 0)
    assert commlib._C.multicast_objects_created() == 0
    return _fused_case(ctx, "bfloat16", [(4, 1024)])


@pytest.mark.parametrize("env", [{}, {"COMMLIB_DISABLE_MULTICAST": "1"}], ids=["no-opt-in", "kill-switch"])
def test_multicast_workspace_refused_before_cuda(ranks, env):
    import commlib
    if not env and commlib.fused.multicast_allowed()[0]:
        pytest.skip("this environment opts in to NVLink multicast (the kill-switch case still runs)")
    ranks(2, env=env).run(_workspace_refused)


# ---- build check: the multimem kernel's SASS carries the multimem instructions ----

def _cuda_tool(name):
    """nvcc / cuobjdump from CUDA_HOME, /usr/local/cuda, PATH, or the copy bundled with triton."""
    candidates = [Path(h) / "bin" / name for h in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if h]
    found = shutil.which(name)
    if found:
        candidates.append(Path(found))
    try:
        import triton
        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    except Exception:  # noqa: BLE001
        pass
    return next((c for c in candidates if c.exists()), None)


def test_multimem_kernel_sass_has_multimem(tmp_path):
    # Compiles the kernel file alone (no launch, no driver call) and inspects its SASS.
    nvcc, cuobjdump = _cuda_tool("nvcc"), _cuda_tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        pytest.skip("nvcc / cuobjdump not found")
    cubin = tmp_path / "multimem.cubin"
    subprocess.run([str(nvcc), "-std=c++20", "-arch=sm_90a", "-O3", "--expt-relaxed-constexpr",
                    "-cubin", f"-I{ROOT / 'include'}", f"-I{ROOT / 'csrc'}",
                    str(ROOT / "csrc/kernels/rs_rmsnorm_ag_multimem.cu"), "-o", str(cubin)],
                   check=True, capture_output=True, text=True)
    sass = subprocess.run([str(cuobjdump), "--dump-sass", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    # multimem.ld_reduce is LDGMC.E.<op>.<type> in Hopper SASS (GMC: global multicast); with
    # .acc::f32 the op is F32ADD (the switch accumulates in fp32).
    assert "LDGMC.E.F32ADD.BF16" in sass and "LDGMC.E.F32ADD.F16" in sass, "no fp32 multimem.ld_reduce in the SASS"
