"""TokenWeave: hide a tensor-parallel layer's all-reduce behind the layer's own compute.

A batch of tokens is split in two groups, a prefix A and a suffix B. While group A's fused
all-reduce + residual add + RMSNorm (``comm.fused_allreduce_rmsnorm``) runs on a communication
stream on a few SMs, group B's attention or MLP runs on the compute stream with the rest; then the
roles swap. Three pieces:

* ``wave_aware_split(num_tokens, ...)``: the prefix size. Not half: a GEMM runs in waves of CTA
  tiles over the SMs, so its time grows in steps of ``wave_step`` tokens; the split is chosen so
  that the waves of both halves together do not exceed the waves of the unsplit batch, for every
  GEMM of the layer (Note [wave-aware split]).
* ``should_split(num_tokens, ...)``: the adaptive policy. Below ``split_min_tokens`` the two
  halves' fixed costs exceed what the overlap hides: run unsplit with the fused op only.
* ``OverlapSchedule``: runs a layer written as steps (compute, then communication) for two token
  groups on two CUDA streams, ordered by events only (no host synchronisation), so it can be
  captured in a CUDA graph. On CPU the same steps run in the same order on the calling thread.

The wave steps, the crossover and the fused op's SM budget come from ``commlib-tune --tokenweave``
(the tune file's ``tokenweave`` record for this GPU and world size) when measured, else from the
built-in defaults below. ``commlib.models.llama.TPDecoderLayer`` is the reference layer built on
these pieces; see docs/tokenweave.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import tuned

# Built-in defaults, used where commlib-tune has not measured this machine.
DEFAULT_WAVE_STEP = 128          # tokens: one M-tile of the 128-row tiles Hopper GEMMs commonly run
DEFAULT_SPLIT_MIN_TOKENS = 1024  # below this, run unsplit (the fused op only): Note [split crossover]
NO_SPLIT = 1 << 62  # the built-in crossover at world size 1: never split (Note [split crossover])
DEFAULT_NUM_SMS = 16             # CTAs of the fused op while it overlaps compute (2..16 is its range)
WAVE_STEP_GRANULE = 16           # token granularity of the wave-step measurement


@dataclass(frozen=True)
class GemmShape:
    """One GEMM of a layer on one rank: ``[tokens, k] @ [k, n]`` (a linear layer k -> n)."""
    n: int
    k: int

    @property
    def key(self) -> str:
        return f"{self.n}x{self.k}"


def layer_gemm_shapes(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, ffn: int,
                      world_size: int) -> Tuple[GemmShape, ...]:
    """The four GEMMs of a Llama-style TP layer on one rank: QKV (column-parallel), O (row-parallel),
    gate/up (column-parallel, fused) and down (row-parallel)."""
    q = num_heads * head_dim // world_size
    kv = num_kv_heads * head_dim // world_size
    f = ffn // world_size
    return (GemmShape(q + 2 * kv, hidden), GemmShape(hidden, q), GemmShape(2 * f, hidden), GemmShape(hidden, f))


def waves(num_tokens: int, wave_step: int) -> int:
    """GEMM waves of ``num_tokens`` rows when the time grows every ``wave_step`` tokens."""
    return -(-num_tokens // wave_step)


# Note [wave-aware split]
# A GEMM's time is a staircase in the token count: it launches ceil(M / tile_m) x ceil(N / tile_n)
# CTA tiles, which run in waves of (SMs x CTAs per SM) tiles, so its time jumps every `wave_step`
# tokens and is nearly flat in between. Splitting T tokens into s + (T - s) runs the GEMM twice;
# the two runs cost ceil(s / w) + ceil((T - s) / w) waves, which is ceil(T / w) when s is a
# multiple of w and one wave more otherwise. A half-and-half split of, say, 1000 tokens with w = 128
# runs 4 + 4 = 8 waves where the batch needs 8 (fine), but 1100 tokens split 550 / 550 runs 5 + 5 =
# 10 waves for the batch's 9: the split itself would cost a wave of every GEMM. So the prefix is
# chosen among the split points where no GEMM of the layer runs more waves split than unsplit:
# the halves closest to equal (the overlap hides min(A, B) of communication), then the larger
# prefix; where there is none, no split (0). w comes from a measurement of each GEMM's time over
# token counts on this GPU (commlib-tune --tokenweave; `find_wave_step`): tile shapes and the
# kernels cuBLAS picks differ by shape and GPU, so an assumed 128 x 128 tile would be wrong as often
# as right. Without a measurement, DEFAULT_WAVE_STEP.


def _steps_for(shapes: Sequence[GemmShape], wave_steps) -> Tuple[int, ...]:
    if wave_steps is None:
        wave_steps = tuned_params().wave_steps
    if isinstance(wave_steps, int):
        steps = [wave_steps] * len(shapes)
    elif isinstance(wave_steps, Mapping):
        steps = [int(wave_steps.get(s.key, wave_steps.get(s, DEFAULT_WAVE_STEP))) for s in shapes]
    else:
        steps = [int(w) for w in wave_steps]
        if len(steps) != len(shapes):
            raise ValueError(f"wave_aware_split: {len(steps)} wave steps for {len(shapes)} GEMM shapes; "
                             "give one per shape, an int, or a mapping 'NxK' -> tokens")
    for w in steps:
        if w < 1:
            raise ValueError(f"wave_aware_split: wave step {w} must be >= 1 token")
    return tuple(steps)


def _check_tokens(what: str, num_tokens) -> int:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"{what}: num_tokens {num_tokens!r} must be an int >= 0")
    return num_tokens


def wave_aware_split(num_tokens: int, gemm_shapes: Optional[Sequence[GemmShape]] = None,
                     wave_steps: Union[None, int, Sequence[int], Mapping[str, int]] = None) -> int:
    """The prefix size s (group A = tokens [0, s), group B = [s, num_tokens)); Note [wave-aware split].

    ``gemm_shapes``: the layer's GEMMs (``layer_gemm_shapes``; default one GEMM, so only the wave
    step matters). ``wave_steps``: tokens per wave, one int for all, one per shape, or a mapping
    ``"NxK"`` -> tokens (default: the tuned steps for this GPU, else ``DEFAULT_WAVE_STEP``).
    Returns 0 when the batch cannot be split without costing waves (fewer tokens than two wave
    steps of every GEMM) — ``should_split`` is then false. Deterministic: every rank gets the same s.
    """
    num_tokens = _check_tokens("wave_aware_split", num_tokens)
    shapes = tuple(gemm_shapes) if gemm_shapes is not None else (GemmShape(1, 1),)
    if not shapes:
        raise ValueError("wave_aware_split: gemm_shapes is empty; give the layer's GEMMs (layer_gemm_shapes)")
    return _split(num_tokens, shapes, _steps_for(shapes, wave_steps))


@functools.lru_cache(maxsize=4096)
def _split(num_tokens: int, shapes: Tuple[GemmShape, ...], steps: Tuple[int, ...]) -> int:
    steps = tuple(sorted(set(steps)))
    whole = [waves(num_tokens, w) for w in steps]

    def free(s):  # no GEMM runs more waves split than unsplit
        return all(waves(s, w) + waves(num_tokens - s, w) == full for w, full in zip(steps, whole))

    low = num_tokens // 2
    high = num_tokens - low
    for d in range(0, low + 1):  # the most balanced first; on a tie the larger prefix
        for s in (high + d, low - d):
            if 0 < s < num_tokens and free(s):
                return s
    return 0


# Note [split crossover]
# A split pays only where the communication it hides is worth more than what splitting costs: the
# layer's GEMMs run twice on half the rows, and each half runs beside the other half's fused op on
# the overlap's SM budget. At 512 tokens the halves of the hidden-wide GEMMs (O and down, N = hidden
# = 8192 for Llama-70B) fill less than a wave each (256 rows make 64 tiles of 128 x 256 on a 132-SM
# H200), and a 256-row GEMM beside the fused op on 16 CTAs ran 20% slower than alone, against 8% at
# 512 rows (bench/results/tp_layer.md, the overlap lines), while the all-reduces of a TP-2 layer are
# about 8% of its time. Hence the built-in crossover of 1024 tokens; commlib-tune --tokenweave
# measures it per GPU and world size (fused against split at 256..4096 tokens). At world size 1
# there is no communication to hide, so nothing can pay for a split: the built-in crossover there is
# NO_SPLIT (at 1K tokens the split cost 3.6% over the no-communication floor against 2.4% for the
# unsplit fused op, bench/results/tp_layer.md); an explicit split_min_tokens is obeyed at any size.


def should_split(num_tokens: int, gemm_shapes: Optional[Sequence[GemmShape]] = None, *,
                 split_min_tokens: Optional[int] = None,
                 wave_steps: Union[None, int, Sequence[int], Mapping[str, int]] = None,
                 world_size: Optional[int] = None) -> bool:
    """The adaptive policy (Note [split crossover]): split (and overlap) when ``num_tokens >=
    split_min_tokens`` (default: ``tuned_params(world_size)``'s crossover: the tuned one for this
    GPU and world size, else ``DEFAULT_SPLIT_MIN_TOKENS``, and never at world size 1) and the
    wave-aware split exists (``wave_aware_split(...) > 0``); else run unsplit with the fused op."""
    num_tokens = _check_tokens("should_split", num_tokens)
    if split_min_tokens is None:
        split_min_tokens = tuned_params(world_size).split_min_tokens
    if num_tokens < split_min_tokens:
        return False
    return wave_aware_split(num_tokens, gemm_shapes, wave_steps) > 0


# ---------------------------------------------------------------------------------------------
# Tuned parameters

@dataclass(frozen=True)
class TokenWeaveParams:
    """What the split and the schedule use: ``wave_steps`` ("NxK" -> tokens, or one int for every
    shape), ``split_min_tokens`` (the crossover) and ``num_sms`` (the fused op's CTAs while it
    overlaps compute; None: the fused op's own by-size default, Note [overlap SM budget]);
    ``source`` says where they came from ("tuned" or "default")."""
    wave_steps: Union[int, Mapping[str, int]] = DEFAULT_WAVE_STEP
    split_min_tokens: int = DEFAULT_SPLIT_MIN_TOKENS
    num_sms: Optional[int] = DEFAULT_NUM_SMS
    source: str = "default"


# Note [overlap SM budget]
# While a group's fused op overlaps the other group's compute it runs on num_sms CTAs, so that the
# compute keeps the other SMs while the op waits on the links. Two collectives get the fused op's
# own by-size default (the whole GPU for large slices) instead, because there is nothing to share
# the GPU with: the schedule's last one (group B's last, exposed: the compute stream waits for it),
# and every one at world size 1, where the op has no peers and is local memory work that a few
# CTAs only stretch out (its CTAs hold their SMs for as long as it runs, and the GEMM beside it
# waits for them: bench/results/tp_layer.md's overlap lines).


def default_num_sms(world_size: Optional[int]) -> Optional[int]:
    """The built-in SM budget of the overlapped fused op at ``world_size`` (Note [overlap SM budget]):
    None (the op's own default) at world size 1, else ``DEFAULT_NUM_SMS``."""
    return None if world_size == 1 else DEFAULT_NUM_SMS


_tuned: Dict[Tuple[str, int], TokenWeaveParams] = {}


def tuned_params(world_size: Optional[int] = None) -> TokenWeaveParams:
    """The tune file's ``tokenweave`` values for this GPU (and ``world_size``: the crossover and the
    SM budget depend on it; the wave steps do not), else the built-in defaults. Read once per
    process; CPU-only processes get the defaults."""
    key = (str(tuned.cache_path()), int(world_size or 0))
    if key not in _tuned:
        params = TokenWeaveParams(num_sms=default_num_sms(world_size),
                                  split_min_tokens=NO_SPLIT if world_size == 1 else DEFAULT_SPLIT_MIN_TOKENS)
        if torch.cuda.is_available():
            found = tuned.tokenweave_tuned(world_size)
            if found:
                num_sms = found.get("num_sms")
                params = TokenWeaveParams(
                    wave_steps=dict(found.get("wave_steps") or {}) or DEFAULT_WAVE_STEP,
                    split_min_tokens=int(found.get("split_min_tokens") or DEFAULT_SPLIT_MIN_TOKENS),
                    num_sms=int(num_sms) if num_sms else default_num_sms(world_size), source="tuned")
        _tuned[key] = params
    return _tuned[key]


# ---------------------------------------------------------------------------------------------
# The wave step of measured GEMM times (the timing itself: commlib.perf.ops_tp_layer.measure_wave_steps)

def find_wave_step(tokens: Sequence[int], times: Sequence[float], granule: int = WAVE_STEP_GRANULE) -> int:
    """The token period of the staircase in a GEMM's times: the w (a multiple of ``granule``, at
    most half the largest count) whose model ``t = a + b * ceil(T / w)`` fits the measured
    ``times`` at ``tokens`` best in least squares (a w that is too small predicts steps that are
    not there, one too large misses steps). A curve without steps (linear in T) gives ``granule``.
    Near-ties (within 5% of the best residual) go to the larger w."""
    if len(tokens) != len(times) or len(tokens) < 4:
        raise ValueError(f"find_wave_step: need >= 4 (tokens, time) points of equal count; got {len(tokens)} "
                         f"token counts and {len(times)} times")
    pts = sorted(zip(tokens, times))
    ts = [float(t) for _, t in pts]
    mean_t = sum(ts) / len(ts)
    total = sum((t - mean_t) ** 2 for t in ts) or 1e-30
    fits = []
    for w in range(granule, max(granule, pts[-1][0] // 2) + 1, granule):
        xs = [float(waves(n, w)) for n, _ in pts]
        mx = sum(xs) / len(xs)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx == 0:
            continue
        b = sum((x - mx) * (t - mean_t) for x, t in zip(xs, ts)) / sxx
        a = mean_t - b * mx
        fits.append((sum((t - a - b * x) ** 2 for x, t in zip(xs, ts)) / total, w))
    if not fits:
        return granule
    best = min(r for r, _ in fits)
    return max(w for r, w in fits if r <= best * 1.05 + 1e-12)


# ---------------------------------------------------------------------------------------------
# The schedule

@dataclass(frozen=True)
class Step:
    """One step of a layer for one token group ``g`` (0 = A, 1 = B): ``compute(g)`` on the compute
    stream, then ``comm(g)`` (a collective over the group's rows, e.g. the fused all-reduce +
    RMSNorm) on the communication stream. ``compute`` of the next step of group g reads what
    ``comm`` of this step wrote for g."""
    compute: Callable[[int], None]
    comm: Callable[[int], None]


# Note [two-stream schedule]
# Steps k = 0..K-1, groups A and B. The host issues, in this order:
#   compute_k(A) ; comm_k(A) ; compute_k(B) ; comm_k(B) ; compute_k+1(A) ; ...
# compute_* run on the caller's (compute) stream, comm_* on the schedule's communication stream:
#   compute stream:  c0(A) c0(B) [wait m0(A)] c1(A) [wait m0(B)] c1(B) ... [wait m_last(B)]
#   comm stream:     [wait c0(A)] m0(A) [wait c0(B)] m0(B) [wait c1(A)] m1(A) ...
# so m0(A) overlaps c0(B), m0(B) overlaps c1(A), m1(A) overlaps c1(B): every collective but the
# last overlaps the other group's compute. The communication stream first waits for the compute
# stream (the inputs are ready) and the compute stream finally waits for the communication stream
# (the outputs are ready): a fork and a join, which is what CUDA-graph capture of a side stream needs.
# Ordering is by events only, never a host synchronisation. Every collective is issued on one
# stream in one order, the same on every rank, as collectives must be. Memory: tensors the two
# streams share are allocated on the compute stream before the schedule runs and live until it
# returns; the final join makes their later reuse by the caching allocator safe (no record_stream).
# On CPU there are no streams: the steps run in the issue order above on the calling thread.


class OverlapSchedule:
    """Runs ``Step``s for two token groups on two streams (Note [two-stream schedule]).

    ``device``: where the layer runs; on CUDA the schedule owns one communication stream (created
    here, reused by every ``run``; pass ``comm_stream`` to share one). Construct it outside graph
    capture; ``run`` may be captured.
    """

    NUM_GROUPS = 2

    def __init__(self, device, comm_stream: Optional["torch.cuda.Stream"] = None):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.comm_stream = comm_stream or torch.cuda.Stream(self.device)
        elif self.device.type == "cpu":
            self.comm_stream = None
        else:
            raise ValueError(f"OverlapSchedule: device {self.device} not supported; supported: cpu, cuda")

    def run(self, steps: Sequence[Step]) -> None:
        """Issues every step for groups A and B (Note [two-stream schedule]); returns once all work
        is queued (CUDA) or done (CPU). After it returns, the caller's stream is ordered after
        every step's compute and communication."""
        if not steps:
            return
        if self.comm_stream is None:
            for step in steps:
                for g in range(self.NUM_GROUPS):
                    step.compute(g)
                    step.comm(g)
            return
        compute_stream = torch.cuda.current_stream(self.device)
        comm_stream = self.comm_stream
        comm_stream.wait_stream(compute_stream)
        comm_done: List[Optional[torch.cuda.Event]] = [None] * self.NUM_GROUPS
        for step in steps:
            for g in range(self.NUM_GROUPS):
                if comm_done[g] is not None:
                    compute_stream.wait_event(comm_done[g])
                step.compute(g)
                computed = torch.cuda.Event()
                computed.record(compute_stream)
                comm_stream.wait_event(computed)
                with torch.cuda.stream(comm_stream):
                    step.comm(g)
                done = torch.cuda.Event()
                done.record(comm_stream)
                comm_done[g] = done
        compute_stream.wait_stream(comm_stream)


def group_ranges(num_tokens: int, split: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """Rows of group A and group B: ``[0, split)`` and ``[split, num_tokens)``."""
    if not 0 < split < num_tokens:
        raise ValueError(f"group_ranges: split {split} out of range; valid: 1..{num_tokens - 1} for "
                         f"{num_tokens} tokens")
    return (0, split), (split, num_tokens)


__all__ = ["DEFAULT_WAVE_STEP", "DEFAULT_SPLIT_MIN_TOKENS", "NO_SPLIT", "DEFAULT_NUM_SMS", "GemmShape", "layer_gemm_shapes",
           "waves", "wave_aware_split", "should_split", "TokenWeaveParams", "default_num_sms", "tuned_params",
           "find_wave_step", "Step", "OverlapSchedule", "group_ranges"]
