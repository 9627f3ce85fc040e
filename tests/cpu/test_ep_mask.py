"""An MoE layer carrying on after an EP rank is killed: shrink, mask, next step (Note [EP rank mask]).
The reference is the simulation of tests/ep_reference.py over the same routing with the dead rank's
routes dropped, in the original expert numbering."""
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
from ep_reference import expert_fn, make_routing, make_tokens, reference_combine, simulate

NUM_TOKENS, HIDDEN, TOPK = 9, 24, 3


def _masked_routing(idx, w, victim, local, renormalize):
    drop = (idx >= 0) & (torch.div(idx, local, rounding_mode="floor") == victim)
    idx = idx.masked_fill(drop, -1)
    w = w.float().masked_fill(drop, 0.0)
    if renormalize:
        total = w.sum(dim=-1, keepdim=True)
        w = torch.where(total > 0, w / torch.where(total > 0, total, 1.0), w)
    return idx, w, int(drop.sum())


def _ep_after_kill(ctx, victim, renormalize):
    import commlib
    n, me = ctx.world_size, ctx.rank
    num_experts = 4 * n
    local = num_experts // n
    dtype = torch.bfloat16
    comm = ctx.new_comm(f"ep-mask-{n}-{victim}-{renormalize}", timeout=timedelta(seconds=60))
    buf = commlib.EPBuffer(comm, NUM_TOKENS, HIDDEN, num_experts, TOPK, dtype)
    x = make_tokens(me, NUM_TOKENS, HIDDEN, dtype, seed=3)
    idx, w = make_routing(me, NUM_TOKENS, num_experts, TOPK, "random", seed=3)
    res = buf.dispatch(x, idx, w)
    buf.combine(expert_fn(res.expert_x, me * local), res.handle)  # one whole step before the kill
    comm.barrier()
    if me == victim:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(commlib.PeerError, match=rf"rank {victim} \(pid \d+\) has exited"):
        for _ in range(100_000):
            res = buf.dispatch(x, idx, w)
            buf.combine(expert_fn(res.expert_x, me * local), res.handle)
    small = comm.shrink([victim])
    comm.close()
    masked = buf.without_ranks(small, [victim], renormalize=renormalize)
    cap = masked.buffer.capacity
    # Every rank's routing in the original numbering, the dead rank with no tokens.
    inputs = []
    for s in range(n):
        if s == victim:
            inputs.append((torch.empty(0, HIDDEN, dtype=dtype), torch.empty(0, TOPK, dtype=torch.long),
                           torch.empty(0, TOPK)))
            continue
        s_idx, s_w = make_routing(s, NUM_TOKENS, num_experts, TOPK, "random", seed=3)
        m_idx, m_w, _ = _masked_routing(s_idx, s_w, victim, local, renormalize)
        inputs.append((make_tokens(s, NUM_TOKENS, HIDDEN, dtype, seed=3), m_idx, m_w))
    rows, totals = simulate(inputs, num_experts, cap, n)
    _, _, my_dropped = _masked_routing(idx, w, victim, local, renormalize)
    for step in range(2):  # the layer keeps serving
        res = masked.dispatch(x, idx, w)
        assert int(masked.dropped) == my_dropped
        for l in range(local):
            e = me * local + l  # original expert id
            want = torch.stack([inputs[s][0][t] for (s, t, k) in rows[e][:cap]]) if rows[e] \
                else torch.empty(0, HIDDEN, dtype=dtype)
            assert torch.equal(res.expert_x[l, :len(want)], want), (step, e)
        out = masked.combine(expert_fn(res.expert_x, me * local), res.handle)
        ref, _ = reference_combine(me, inputs, rows, num_experts, n, HIDDEN, dtype, cap)
        assert torch.equal(out, ref), step
    masked.check()
    small.close()
    ctx.store.set(f"ep-mask-done-{n}-{victim}-{renormalize}-{me}", "1")


@pytest.mark.parametrize("world_size,victim,renormalize", [(3, 1, False), (4, 0, True)])
def test_ep_layer_serves_after_a_rank_is_killed(ranks, world_size, victim, renormalize):
    from conftest import RankFailure
    pool = ranks(world_size)
    with pytest.raises(RankFailure) as info:
        pool.run(_ep_after_kill, victim, renormalize, timeout=120)
    assert sorted(info.value.errors) == [victim] and info.value.errors[victim][0] == "EOFError"
    for r in range(world_size):
        if r != victim:
            assert pool.store.check([f"ep-mask-done-{world_size}-{victim}-{renormalize}-{r}"])


def test_masked_buffer_bad_arguments():
    import commlib
    with pytest.raises(ValueError, match="masked_ranks \\[5\\] not supported; valid: a non-empty subset of 0..3"):
        commlib.MaskedEPBuffer(type("C", (), {"world_size": 3})(), 4, [5], 4, 8, 8, 2)
    with pytest.raises(ValueError, match="the communicator has 3 ranks but 2 survive"):
        commlib.MaskedEPBuffer(type("C", (), {"world_size": 3})(), 4, [0, 1], 4, 8, 8, 2)
