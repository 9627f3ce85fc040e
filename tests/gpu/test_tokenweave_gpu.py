"""TokenWeave's TP layer on GPU (commlib.models.llama): eager modes, the two-stream schedule, and
CUDA-graph capture and replay with changing token counts up to a captured maximum.

World 1 needs one GPU; world 2 needs two, or one with COMMLIB_TEST_SHARE_GPUS=1 (both ranks on one
GPU: a check of the logic, the ranks' kernels take turns). References: the layer computed without
sharding from the joined shards (``reference_forward``, fp64 on CPU, or fp32 on the GPU for the
Llama-70B shapes), within bf16 rounding; ``tokenweave`` against ``fused`` within the same bound
(on GPU a GEMM over a subset of the rows may run another cuBLAS kernel, so the split is not
bitwise there: the largest difference is reported); a graph replay against an eager run of the
same padded batch, bit for bit. Intermediate buffers are NaN-poisoned.
"""
import pytest
import torch

import layer_checks

pytestmark = pytest.mark.gpu

TOL = 0.1  # |got - ref| <= TOL * (1 + |ref|): ~10 bf16 roundings in the layer (tests/cpu/test_tokenweave.py)


def _close(got, ref, tol=TOL):
    return layer_checks.close(got, ref, tol)


def _config():
    from commlib.models.llama import LlamaConfig
    return LlamaConfig(hidden=512, num_heads=8, num_kv_heads=4, head_dim=64, ffn=1024)


def _inputs(T, hidden, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g, dtype=torch.float64).to(torch.bfloat16)
    r = (torch.randn(T, hidden, generator=g, dtype=torch.float64) * 2).to(torch.bfloat16)
    return x.to(device), r.to(device)


def _eager_modes(ctx):
    from commlib.models.llama import TPDecoderLayer, full_weights, reference_forward, seq_ids_from_lens
    dev = torch.device("cuda", ctx.device)
    cfg = _config()
    layer = TPDecoderLayer(cfg, ctx.comm, device=dev, seed=5, split_min_tokens=16, wave_steps=32, num_sms=8)
    w = full_weights(cfg, ctx.world_size, seed=5)
    report = {}
    for lens in ([1], [77], [40, 100, 3], [300]):
        T = sum(lens)
        seq = seq_ids_from_lens(lens, dev)
        hidden, residual0 = _inputs(T, cfg.hidden, T, dev)
        ref_out, ref_res = reference_forward(cfg, w, hidden.cpu(), residual0.cpu(), seq.cpu())
        where = f"world {ctx.world_size} rank {ctx.rank} lens {lens}"
        results = {}
        splits = sorted({layer.split_for(T), T // 3, T - 1} - {0}) if T > 1 else []
        for mode, split in [("fused", None), ("sequential", None)] + [("tokenweave", s) for s in splits]:
            res = residual0.clone()
            with layer_checks.PoisonEmpty():
                out, res = layer(hidden, res, seq_ids=seq, mode=mode, split=split)
            torch.cuda.synchronize(dev)
            assert not out.isnan().any() and not res.isnan().any(), f"{where}: {mode} split {split} left NaN"
            ok_o, worst_o = _close(out, ref_out)
            ok_r, worst_r = _close(res, ref_res)
            assert ok_o and ok_r, \
                f"{where}: {mode} split {split} vs reference: out {worst_o:.3g}, residual {worst_r:.3g}"
            results[(mode, split)] = out
        for (mode, split), out in results.items():
            if mode == "tokenweave":
                ok, worst = _close(out, results[("fused", None)])
                assert ok, f"{where}: tokenweave split {split} vs fused: {worst:.3g}"
                report[f"{lens} split {split}"] = (worst, torch.equal(out, results[("fused", None)]))
    ctx.comm.check_gpu_error()
    return report


@pytest.mark.parametrize("world_size", [1, 2])
def test_tp_layer_eager_modes(ranks, world_size):
    reports = ranks(world_size).run(_eager_modes)
    print("tokenweave vs fused (max diff, bitwise):", reports[0])


def _graph_replay(ctx):
    from commlib.models.llama import CapturedLayer, TPDecoderLayer, full_weights, reference_forward, seq_ids_from_lens
    dev = torch.device("cuda", ctx.device)
    cfg = _config()
    layer = TPDecoderLayer(cfg, ctx.comm, device=dev, seed=6, split_min_tokens=16, wave_steps=32, num_sms=8)
    buckets = [64, 256]
    assert all(layer.split_for(b) > 0 for b in buckets), "the captured buckets must exercise the split"
    captured = CapturedLayer(layer, buckets, mode="tokenweave")
    w = full_weights(cfg, ctx.world_size, seed=6)
    for t, lens in [(50, [20, 30]), (256, [256]), (1, [1]), (100, [60, 40]), (64, [64]), (200, [7, 193])]:
        where = f"world {ctx.world_size} rank {ctx.rank} t={t}"
        seq = seq_ids_from_lens(lens, dev)
        hidden, residual0 = _inputs(t, cfg.hidden, 1000 + t, dev)
        out, res = captured.run(hidden, residual0, seq)
        torch.cuda.synchronize(dev)
        assert out.shape == (t, cfg.hidden) and not out.isnan().any(), f"{where}: NaN or wrong shape"
        ref_out, ref_res = reference_forward(cfg, w, hidden.cpu(), residual0.cpu(), seq.cpu())
        ok, worst = _close(out, ref_out)
        ok_r, worst_r = _close(res, ref_res)
        assert ok and ok_r, f"{where}: replay vs reference: out {worst:.3g}, residual {worst_r:.3g}"
        # The same padded batch run eagerly: the same kernels, so the same bits.
        T = captured.bucket_for(t)
        ph = torch.zeros(T, cfg.hidden, dtype=torch.bfloat16, device=dev)
        pr = torch.zeros_like(ph)
        ph[:t], pr[:t] = hidden, residual0
        pseq = torch.full((T,), len(lens), dtype=torch.int64, device=dev)
        pseq[:t] = seq
        eager_out, eager_res = layer(ph, pr, seq_ids=pseq, mode="tokenweave")
        torch.cuda.synchronize(dev)
        assert torch.equal(out, eager_out[:t]) and torch.equal(res, eager_res[:t]), \
            f"{where}: replay differs from the eager run of the padded batch " \
            f"({(out.double() - eager_out[:t].double()).abs().max():.3g})"
    ctx.comm.check_gpu_error()
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_tp_layer_graph_replay_changing_tokens(ranks, world_size):
    assert all(ranks(world_size).run(_graph_replay))


def _llama70b_world1(ctx):
    """Llama-3.3-70B's layer shapes on one GPU: every mode against an fp32 reference on the GPU."""
    from commlib.models.llama import LlamaConfig, TPDecoderLayer, full_weights, reference_forward
    dev = torch.device("cuda", ctx.device)
    cfg = LlamaConfig.llama_70b()
    layer = TPDecoderLayer(cfg, ctx.comm, device=dev, seed=7, init_device=dev)
    w = full_weights(cfg, 1, seed=7, device=dev, dtype=torch.float32)
    worst = {}
    for T in (1, 1100, 2048):  # 1100: not a multiple of the wave step, so the split is not half
        hidden, residual0 = _inputs(T, cfg.hidden, T, dev)
        ref_out, _ = reference_forward(cfg, w, hidden, residual0)
        outs = {}
        for mode, split in (("sequential", None), ("fused", None), ("tokenweave", None), ("nocomm", None),
                            ("tokenweave", layer.split_for(T) or None)):
            out, _ = layer(hidden, residual0.clone(), mode=mode, split=split)
            ok, diff = _close(out, ref_out)
            assert ok, f"T={T} {mode} split {split}: vs fp32 reference {diff:.3g}"
            worst[f"{T} {mode} {split}"] = diff
            outs[mode] = out
    del w
    torch.cuda.empty_cache()
    return worst


@pytest.mark.parametrize("world_size", [1])
def test_tp_layer_llama70b_shapes(ranks, world_size):
    print(ranks(world_size).run(_llama70b_world1)[0])


def _stack_gpu(ctx):
    """run_layers: two layers as one two-stream schedule against the layers run one by one (fused)."""
    from commlib.models.llama import TPDecoderLayer, run_layers, seq_ids_from_lens
    dev = torch.device("cuda", ctx.device)
    cfg = _config()
    layers = [TPDecoderLayer(cfg, ctx.comm, device=dev, seed=30 + i, split_min_tokens=16, wave_steps=32, num_sms=8)
              for i in range(2)]
    seq = seq_ids_from_lens([120, 180], dev)
    hidden, _ = _inputs(300, cfg.hidden, 4, dev)
    x, res = hidden, None
    for layer in layers:
        x, res = layer(x, res, seq_ids=seq, mode="fused")
    with layer_checks.PoisonEmpty():
        out, res2 = run_layers(layers, hidden, None, seq_ids=seq, mode="tokenweave")
    torch.cuda.synchronize(dev)
    ok, worst = _close(out, x)
    ok_r, worst_r = _close(res2, res)
    assert ok and ok_r, f"rank {ctx.rank}: stack vs layers one by one: out {worst:.3g}, residual {worst_r:.3g}"
    ctx.comm.check_gpu_error()
    return worst


@pytest.mark.parametrize("world_size", [1, 2])
def test_tp_layer_stack(ranks, world_size):
    print("stack vs one by one, max diff:", ranks(world_size).run(_stack_gpu))
