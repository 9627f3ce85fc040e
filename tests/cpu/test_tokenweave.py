"""TokenWeave on CPU: the wave-aware split, the adaptive policy, the schedule's order, and the TP
decoder layer (commlib.models.llama) at world sizes 2 and 3.

References: the split rule against a brute-force search over every split point; the layer's
``tokenweave`` mode bit for bit against its ``fused`` mode (every op of the layer is row-independent
on CPU with the same key extent for attention: Note [split and attention]), both against an fp64
layer computed from the joined shards (``reference_forward``) and against ``sequential`` (gloo's
all_reduce + add + rms_norm) within bf16 rounding. Intermediate buffers are NaN-poisoned (every
``torch.empty`` of the layer returns NaN), so a row read before it is written shows.
"""
import math

import pytest
import torch

import layer_checks

from commlib import tokenweave as tw
from commlib.tokenweave import GemmShape

SHAPES = (GemmShape(640, 256), GemmShape(256, 512), GemmShape(1024, 256), GemmShape(256, 512))


# ---------------------------------------------------------------------------------------------
# The split rule

def brute_force_split(T, steps):
    """Every s with no extra waves; the most balanced, then the larger prefix; 0 when none."""
    ok = [s for s in range(1, T) if all(tw.waves(s, w) + tw.waves(T - s, w) == tw.waves(T, w) for w in steps)]
    return min(ok, key=lambda s: (abs(T - 2 * s), -s)) if ok else 0


@pytest.mark.parametrize("steps", [(128,), (64,), (128, 192), (96, 128, 64, 128), (16,), (200, 300)])
def test_wave_aware_split_matches_brute_force(steps):
    shapes = SHAPES[:len(steps)] if len(steps) <= len(SHAPES) else None
    for T in list(range(0, 700)) + [1023, 1024, 1100, 2047, 2048, 3000, 4096, 5000, 8192]:
        want = brute_force_split(T, steps)
        got = tw.wave_aware_split(T, shapes if shapes is not None else [GemmShape(1, 1)] * len(steps), list(steps))
        assert got == want, f"T={T} steps={steps}: split {got}, brute force {want}"
        if got:
            for w in steps:  # the rule itself: no GEMM runs more waves split than unsplit
                assert tw.waves(got, w) + tw.waves(T - got, w) == tw.waves(T, w)


def test_wave_aware_split_is_not_half():
    # 1100 tokens, 128-token waves: 550 / 550 would run 5 + 5 = 10 waves for the batch's 9.
    assert tw.wave_aware_split(1100, wave_steps=128) == 588
    assert tw.waves(550, 128) * 2 > tw.waves(1100, 128)
    assert tw.wave_aware_split(1024, wave_steps=128) == 512
    assert tw.wave_aware_split(127, wave_steps=128) == 0  # one wave: any split costs a wave
    shapes = tw.layer_gemm_shapes(8192, 64, 8, 128, 28672, 2)
    assert [s.key for s in shapes] == ["5120x8192", "8192x4096", "28672x8192", "8192x14336"]
    steps = {"5120x8192": 128, "8192x4096": 64, "28672x8192": 192, "8192x14336": 128}
    s = tw.wave_aware_split(4000, shapes, steps)
    assert s and all(tw.waves(s, w) + tw.waves(4000 - s, w) == tw.waves(4000, w) for w in steps.values())


def test_should_split_policy():
    assert not tw.should_split(511, split_min_tokens=512, wave_steps=128)
    assert tw.should_split(512, split_min_tokens=512, wave_steps=128)
    assert not tw.should_split(600, split_min_tokens=512, wave_steps=1024)  # no wave-free split
    assert tw.should_split(8192, split_min_tokens=512, wave_steps=128)
    assert not tw.should_split(0, split_min_tokens=0, wave_steps=128)
    # The built-in crossover (nothing tuned on CPU): Note [split crossover].
    assert tw.tuned_params(2).split_min_tokens == tw.DEFAULT_SPLIT_MIN_TOKENS
    assert not tw.should_split(tw.DEFAULT_SPLIT_MIN_TOKENS - 1, wave_steps=128)
    assert tw.should_split(tw.DEFAULT_SPLIT_MIN_TOKENS, wave_steps=128)
    assert tw.should_split(8192, wave_steps=128, world_size=2)
    # World size 1: nothing to hide, so the built-in crossover never splits; an explicit one is obeyed.
    assert tw.tuned_params(1).split_min_tokens == tw.NO_SPLIT
    assert not tw.should_split(1 << 20, wave_steps=128, world_size=1)
    assert tw.should_split(8192, split_min_tokens=512, wave_steps=128, world_size=1)
    # The overlap's SM budget: the fused op's own at world 1 (no peers), else DEFAULT_NUM_SMS.
    assert tw.default_num_sms(1) is None and tw.default_num_sms(2) == tw.DEFAULT_NUM_SMS == 16


@pytest.mark.parametrize("call,match", [
    (lambda: tw.wave_aware_split(-1), "num_tokens -1"),
    (lambda: tw.wave_aware_split(True), "num_tokens True"),
    (lambda: tw.wave_aware_split(64, wave_steps=0), "wave step 0"),
    (lambda: tw.wave_aware_split(64, SHAPES, [128, 64]), "2 wave steps for 4 GEMM shapes"),
    (lambda: tw.wave_aware_split(64, []), "gemm_shapes is empty"),
    (lambda: tw.should_split(2.5), "should_split: num_tokens 2.5"),
    (lambda: tw.group_ranges(10, 10), "split 10 out of range"),
    (lambda: tw.find_wave_step([16, 32], [1.0, 2.0]), "need >= 4"),
    (lambda: tw.OverlapSchedule("meta"), "device meta not supported"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("step", [32, 64, 128, 192, 256])
def test_find_wave_step_on_staircases(step):
    tokens = list(range(16, 2049, 16))
    g = torch.Generator().manual_seed(step)
    noise = (torch.rand(len(tokens), generator=g) - 0.5).tolist()
    times = [20.0 + 9.0 * math.ceil(t / step) + 0.5 * n for t, n in zip(tokens, noise)]
    assert tw.find_wave_step(tokens, times) == step


def test_find_wave_step_without_steps():
    tokens = list(range(16, 1025, 16))
    assert tw.find_wave_step(tokens, [3.0 + 0.01 * t for t in tokens]) == 16


def test_split_crossover():
    from commlib.perf.tune import split_crossover
    tokens = [256, 512, 1024, 2048]
    assert split_crossover(tokens, [10, 20, 40, 80], [12, 19, 30, 60]) == 512
    assert split_crossover(tokens, [10, 20, 40, 80], [9, 15, 30, 60]) == 256
    assert split_crossover(tokens, [10, 20, 40, 80], [12, 22, 44, 88]) == 2049  # never pays


def test_tune_record_round_trip(tmp_path, monkeypatch):
    from commlib.perf import tune
    path = str(tmp_path / "tune.txt")
    entry = {"key": tune.make_key("cpu", 2), "all_reduce": {"flat_max_bytes": 1024, "tree_max_bytes": 4096},
             "fused_num_sms": None}
    tune.save(entry, path)
    record = {"device": "GPU X", "world_size": 2, "wave_steps": {"5120x8192": 128}, "split_min_tokens": 768,
              "num_sms": 8}
    tune.save_tokenweave(record, path)
    tune.save_tokenweave({**record, "world_size": 4, "split_min_tokens": 1024}, path)
    tune.save_tokenweave({**record, "num_sms": 16}, path)  # replaces the (GPU X, 2) record
    data = tune.read_file(path)
    assert data["entries"] == [entry]
    assert sorted((r["world_size"], r["num_sms"]) for r in data["tokenweave"]) == [(2, 16), (4, 8)]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU X")
    assert tune.tokenweave_tuned(4, path)["split_min_tokens"] == 1024
    assert tune.tokenweave_tuned(8, path) == {"wave_steps": {"5120x8192": 128}}  # steps only
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU Y")
    assert tune.tokenweave_tuned(2, path) is None


def test_schedule_order_on_cpu():
    log = []
    steps = [tw.Step(lambda g, k=k: log.append(f"c{k}{'AB'[g]}"), lambda g, k=k: log.append(f"m{k}{'AB'[g]}"))
             for k in range(3)]
    tw.OverlapSchedule("cpu").run(steps)
    assert log == ["c0A", "m0A", "c0B", "m0B", "c1A", "m1A", "c1B", "m1B", "c2A", "m2A", "c2B", "m2B"]


# ---------------------------------------------------------------------------------------------
# The layer, world 2 and 3

BF16_TOL = 0.08  # |got - fp64| <= BF16_TOL * (1 + |fp64|); see _close


def _close(got, ref, tol=BF16_TOL):
    """(ok, worst): every element within tol * (1 + |ref|) of ref. The outputs are normalised rows
    (|x| ~ 1): the layer rounds to bf16 (2^-8 relative) after each of ~10 ops, and GEMMs over up to
    192 terms and two norms amplify those roundings by a small factor: 0.08 is about 20 roundings."""
    return layer_checks.close(got, ref, tol)


def _inputs(T, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, hidden, generator=g, dtype=torch.float64).to(torch.bfloat16),
            (torch.randn(T, hidden, generator=g, dtype=torch.float64) * 2).to(torch.bfloat16))


CASES = [  # (sequence lengths, splits to force besides the policy's)
    ([1], []),
    ([37], [1, 16, 36]),
    ([10, 17, 13], [10, 20, 27, 39]),
    ([64, 3, 60], [64, 67, 90]),
    ([5] * 9, [23]),
]


def _layer_modes(ctx, dtype_name):
    from commlib.models.llama import (LlamaConfig, TPDecoderLayer, full_weights, reference_forward,
                                      seq_ids_from_lens)
    dtype = getattr(torch, dtype_name)
    cfg = LlamaConfig.small()
    group = ctx.gloo()
    layer = TPDecoderLayer(cfg, ctx.comm, dtype=dtype, device="cpu", seed=11, group=group,
                           split_min_tokens=16, wave_steps=8)
    w = full_weights(cfg, ctx.world_size, seed=11)
    report = []
    for lens, splits in CASES:
        T = sum(lens)
        seq = seq_ids_from_lens(lens)
        hidden, residual0 = _inputs(T, cfg.hidden, seed=T)
        hidden, residual0 = hidden.to(dtype), residual0.to(dtype)
        for first in (True, False):
            res_in = None if first else residual0
            ref_out, ref_res = reference_forward(cfg, w, hidden, res_in, seq)
            where = f"world {ctx.world_size} rank {ctx.rank} lens {lens} first_layer={first} {dtype_name}"

            def run(mode, split=None):
                r = None if first else residual0.clone()
                h = hidden.clone()
                with layer_checks.PoisonEmpty():
                    out, new_res = layer(h, r, seq_ids=seq, mode=mode, split=split)
                assert torch.equal(h, hidden), f"{where}: {mode} modified hidden"
                assert not out.isnan().any() and not new_res.isnan().any(), f"{where}: {mode} left NaN"
                return out, new_res

            fused = run("fused")
            policy = layer.split_for(T)
            for split in sorted(set(splits + ([policy] if policy else []))):
                got = run("tokenweave", split)
                assert torch.equal(got[0], fused[0]) and torch.equal(got[1], fused[1]), \
                    f"{where}: tokenweave split {split} differs from fused (max " \
                    f"{(got[0].double() - fused[0].double()).abs().max():.3g})"
            assert torch.equal(run("tokenweave")[0], fused[0])  # the policy (split or not)
            seq_out = run("sequential")  # the layer has a gloo group: gloo's all_reduce
            layer.group = None
            seq_commlib = run("sequential")  # the communicator's all_reduce_
            layer.group = group
            for name, (o, r) in (("fused", fused), ("sequential/gloo", seq_out), ("sequential/commlib", seq_commlib)):
                ok_o, worst_o = _close(o, ref_out)
                ok_r, worst_r = _close(r, ref_res)
                assert ok_o and ok_r, f"{where}: {name} vs fp64: out max diff {worst_o:.3g}, residual {worst_r:.3g}"
                report.append((name, worst_o))
            ok, worst = _close(seq_out[0], fused[0].double())
            assert ok, f"{where}: sequential vs fused: max diff {worst:.3g}"
            report.append(("fused_vs_sequential", worst))
    return [fused[0]], report


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_layer_modes_agree(ranks, world_size, dtype_name):
    results = ranks(world_size).run(_layer_modes, dtype_name)
    outs = [r[0][0] for r in results]
    for rank, o in enumerate(outs[1:], 1):
        assert torch.equal(o, outs[0]), f"rank {rank}'s output differs from rank 0's"


def _gemm_rows_independent(ctx):
    """The layer's GEMMs as it calls them (matmul into a row slice) give every row the same bits
    whichever rows run with it: what makes tokenweave bitwise equal to fused on CPU."""
    from commlib.models.llama import LlamaConfig, TPDecoderLayer
    layer = TPDecoderLayer(LlamaConfig.small(), ctx.comm, device="cpu", seed=3)
    g = torch.Generator().manual_seed(5)
    for name, wt in layer._t.items():
        for T in (1, 7, 33, 130):
            x = torch.randn(T, wt.shape[0], generator=g).to(torch.bfloat16)
            full = torch.matmul(x, wt)
            for s in range(1, T, max(1, T // 9)):
                part = torch.empty(T, wt.shape[1], dtype=torch.bfloat16)
                torch.matmul(x[:s], wt, out=part[:s])
                torch.matmul(x[s:], wt, out=part[s:])
                assert torch.equal(part, full), f"GEMM {name} T={T} split {s}: rows not independent"
    return True


def test_gemm_rows_independent(ranks):
    assert all(ranks(2).run(_gemm_rows_independent))


def _bad_inputs(ctx):
    from commlib.models.llama import LlamaConfig, TPDecoderLayer, seq_ids_from_lens
    cfg = LlamaConfig.small()
    layer = TPDecoderLayer(cfg, ctx.comm, device="cpu", split_min_tokens=16, wave_steps=8)
    hidden, residual = _inputs(20, cfg.hidden, 1)
    errors = []

    def expect(exc, match, fn):
        with pytest.raises(exc, match=match):
            fn()
        errors.append(match)

    expect(ValueError, "mode 'overlap' not supported; supported: sequential, fused, tokenweave, nocomm",
           lambda: layer(hidden, mode="overlap"))
    expect(ValueError, r"hidden must have shape \[tokens, 96\]; got \(20, 64\)", lambda: layer(hidden[:, :64]))
    expect(TypeError, "hidden has dtype torch.float32 but the layer is torch.bfloat16", lambda: layer(hidden.float()))
    expect(ValueError, "split 20 out of range; valid: 0 \\(unsplit\\) or 1..19", lambda: layer(hidden, split=20))
    expect(ValueError, "split 5 applies to mode 'tokenweave' only", lambda: layer(hidden, mode="fused", split=5))
    expect(ValueError, "residual must match hidden", lambda: layer(hidden, residual[:10]))
    expect(ValueError, r"seq_ids must be an int64 tensor of shape \[20\]",
           lambda: layer(hidden, seq_ids=torch.zeros(20, dtype=torch.int32)))
    kv = 4 if ctx.world_size == 3 else 3
    expect(ValueError, f"config.num_kv_heads {kv} does not shard over world size {ctx.world_size}",
           lambda: TPDecoderLayer(LlamaConfig(96, 12, kv, 8, 192), ctx.comm, device="cpu"))
    expect(ValueError, "num_sms 0 must be a positive int",
           lambda: TPDecoderLayer(cfg, ctx.comm, device="cpu", num_sms=0))
    expect(ValueError, "sequence lengths must be >= 0", lambda: seq_ids_from_lens([3, -1]))
    # Errors are raised before any communication: the communicator and the layer still work.
    out, res = layer(hidden, residual.clone(), mode="tokenweave")
    out2, _ = layer(hidden, residual.clone(), mode="fused")
    assert torch.equal(out, out2)
    return errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_layer_bad_inputs(ranks, world_size):
    ranks(world_size).run(_bad_inputs)


def _empty_batch(ctx):
    from commlib.models.llama import LlamaConfig, TPDecoderLayer
    cfg = LlamaConfig.small()
    layer = TPDecoderLayer(cfg, ctx.comm, device="cpu")
    hidden = torch.empty(0, cfg.hidden, dtype=torch.bfloat16)
    for mode in ("sequential", "fused", "tokenweave"):
        out, res = layer(hidden, hidden.clone(), mode=mode)
        assert out.shape == (0, cfg.hidden) and res.shape == (0, cfg.hidden)
    return True


def test_layer_empty_batch(ranks):
    assert all(ranks(2).run(_empty_batch))


# ---------------------------------------------------------------------------------------------
# commlib-perf tp_layer on CPU (the small layer): every mode's output checked against the fp64
# layer (nocomm: against the rank's own shards as a layer); a planted wrong element must fail it.

def _perf(*args):
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "python")}
    return subprocess.run([sys.executable, "-m", "commlib.perf", "tp_layer", "--tokens", "1,45", "-n", "2", "-w", "1",
                           "-d", "bfloat16", *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("mode", ["tokenweave", "split", "fused", "nocomm"])
def test_perf_tp_layer(mode):
    r = _perf("-np", "2", "--tp-mode", mode, "--backend", "ddacomm", "gloo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Out of bounds values : 0 OK" in r.stdout
    assert sum(1 for line in r.stdout.splitlines() if line.strip().startswith(("ddacomm", "gloo"))) == 4


def test_perf_tp_layer_detects_wrong_output():
    r = _perf("-np", "3", "--tp-mode", "split", "--backend", "ddacomm", "--corrupt-rank", "2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED" in r.stdout


def _stack(ctx):
    """run_layers: three layers as one schedule (layer i's last collective beside layer i + 1's
    first compute) give the bits of the layers run one by one, unsplit."""
    from commlib.models.llama import LlamaConfig, TPDecoderLayer, run_layers, seq_ids_from_lens
    cfg = LlamaConfig.small()
    layers = [TPDecoderLayer(cfg, ctx.comm, device="cpu", seed=20 + i, split_min_tokens=16, wave_steps=8)
              for i in range(3)]
    seq = seq_ids_from_lens([30, 41])
    hidden, residual0 = _inputs(71, cfg.hidden, 9)
    x, res = hidden, None
    for layer in layers:
        x, res = layer(x, res, seq_ids=seq, mode="fused")
    for split in (None, 33, 64):
        with layer_checks.PoisonEmpty():
            out, res2 = run_layers(layers, hidden, None, seq_ids=seq, mode="tokenweave", split=split)
        assert torch.equal(out, x) and torch.equal(res2, res), f"rank {ctx.rank}: stack split {split} differs"
    with pytest.raises(ValueError, match="run_layers: no layers"):
        run_layers([], hidden)
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_layer_stack_one_schedule(ranks, world_size):
    assert all(ranks(world_size).run(_stack))


class _RecordingComm:
    """A communicator that records the num_sms of every fused op it runs."""

    def __init__(self, comm):
        self._comm, self.num_sms = comm, []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def fused_allreduce_rmsnorm(self, *args, num_sms=None, **kwargs):
        self.num_sms.append(num_sms)
        return self._comm.fused_allreduce_rmsnorm(*args, num_sms=num_sms, **kwargs)


def _sm_budgets(ctx):
    """Note [overlap SM budget]: a split schedule's collectives run on the layer's num_sms beside the
    other group's compute, and the schedule's last one (nothing beside it) on the op's own default
    (None); unsplit, every one on the op's own; the results are the same bits."""
    from commlib.models.llama import LlamaConfig, TPDecoderLayer, run_layers
    cfg = LlamaConfig.small()
    comm = _RecordingComm(ctx.comm)
    layers = [TPDecoderLayer(cfg, comm, device="cpu", seed=40 + i, num_sms=8) for i in range(2)]
    hidden, _ = _inputs(50, cfg.hidden, 3)
    budgets = {}
    outs = {}
    for mode, split in (("tokenweave", 20), ("fused", None)):
        comm.num_sms.clear()
        outs[mode] = run_layers(layers, hidden, None, mode=mode, split=split)
        budgets[mode] = list(comm.num_sms)
    assert budgets["tokenweave"] == [8] * 7 + [None], budgets
    assert budgets["fused"] == [None] * 4, budgets
    assert all(torch.equal(a, b) for a, b in zip(outs["tokenweave"], outs["fused"]))
    return True


def test_overlap_sm_budget(ranks):
    assert all(ranks(2).run(_sm_budgets))
