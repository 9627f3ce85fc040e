"""A Llama-style tensor-parallel decoder layer in three execution modes (docs/tokenweave.md).

    layer = TPDecoderLayer(LlamaConfig.llama_70b(), comm, mode="tokenweave")   # random weights, fixed seed
    out, residual = layer(hidden)                  # hidden: [tokens, config.hidden] on every rank

One layer on one rank of a tensor-parallel group of ``comm.world_size`` ranks:

    h   = rms_norm(hidden) * w_in                  (first layer only: residual is None)
    qkv = h @ W_qkv                                column-parallel: this rank's Q heads and KV heads
    a   = attention(qkv)                           PyTorch SDPA, causal within each sequence, GQA
    o   = a @ W_o                                  row-parallel: a partial sum on every rank
    residual += all_reduce(o); h2 = rms_norm(residual) * w_post
    gu  = h2 @ W_gate_up; m = silu(gate) * up      column-parallel
    d   = m @ W_down                               row-parallel: a partial sum
    residual += all_reduce(d); out = rms_norm(residual) * w_out

``w_out`` stands for the next layer's input norm (in a model, the last fused op of layer i applies
layer i + 1's input norm, which is why a layer called with a residual takes its input as already
normalised). Modes:

* ``sequential``: what engines do today: ``all_reduce`` + residual add + ``rms_norm`` as three
  ops. The all-reduce is the layer's ``all_reduce`` function when given, else
  ``torch.distributed.all_reduce`` on ``group`` when the layer has one (NCCL for CUDA tensors, gloo
  for CPU tensors), else the communicator's ``all_reduce_``.
* ``fused``: commlib's fused all-reduce + residual + RMSNorm over the whole batch, no split.
* ``tokenweave``: the batch split in two token groups (``commlib.tokenweave``): the fused op of
  one group on a communication stream on ``num_sms`` SMs while the other group computes. Batches
  that the adaptive policy does not split run as ``fused``.
* ``nocomm``: the all-reduce removed (residual add + ``rms_norm`` only): not a correct TP layer, the
  benchmark's floor.

The residual stream is replicated: every rank holds all rows and ends with all rows updated.
See Note [split and attention] for what a split means for attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import tokenweave

MODES = ("sequential", "fused", "tokenweave", "nocomm")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    eps: float = 1e-5

    @classmethod
    def llama_70b(cls) -> "LlamaConfig":
        """Llama-3.3-70B's layer: hidden 8192, 64 Q / 8 KV heads of 128, FFN 28672."""
        return cls(hidden=8192, num_heads=64, num_kv_heads=8, head_dim=128, ffn=28672)

    @classmethod
    def small(cls) -> "LlamaConfig":
        """A small layer for CPU tests (shards evenly at world sizes 1, 2, 3, 6)."""
        return cls(hidden=96, num_heads=12, num_kv_heads=6, head_dim=8, ffn=192)

    def check(self, world_size: int) -> None:
        what = "TPDecoderLayer"
        for name in ("hidden", "num_heads", "num_kv_heads", "head_dim", "ffn"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{what}: config.{name} {v!r} must be a positive int")
        if self.hidden % 8:
            raise ValueError(f"{what}: config.hidden {self.hidden} not supported; supported: multiples of 8 "
                             "(the fused op's row layout)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{what}: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        for name in ("num_heads", "num_kv_heads", "ffn"):
            if getattr(self, name) % world_size:
                raise ValueError(f"{what}: config.{name} {getattr(self, name)} does not shard over world size "
                                 f"{world_size}; it must be a multiple of the world size")


def seq_ids_from_lens(seq_lens: Sequence[int], device=None) -> torch.Tensor:
    """The per-token sequence index (int64 [sum(seq_lens)]) of a batch of sequences laid out one
    after the other, each in position order."""
    lens = [int(n) for n in seq_lens]
    if any(n < 0 for n in lens):
        raise ValueError(f"seq_ids_from_lens: sequence lengths must be >= 0; got {lens}")
    ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.int64))
    return ids.to(device) if device is not None else ids


def _shard_seed(seed: int, name: str, part: int, world_size: int) -> int:
    h = seed * 1000003 + world_size * 7919 + part * 104729
    for c in name:
        h = (h * 31 + ord(c)) & 0x7FFFFFFF
    return h


def _randn(shape, seed: int, device: torch.device, scale: float) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale


def shard_weights(config: LlamaConfig, world_size: int, rank: int, seed: int = 0,
                  device=torch.device("cpu")) -> Dict[str, torch.Tensor]:
    """Rank ``rank``'s fp32 weights: each shard comes from its own seeded generator (the same on
    every rank, so the shards of all ranks form one layer; ``full_weights`` joins them). Linear
    weights ~ N(0, 1 / fan_in), norm weights 1 + N(0, 0.1^2)."""
    c, n, r = config, world_size, rank
    d = torch.device(device)
    q = c.num_heads // n * c.head_dim
    kv = c.num_kv_heads // n * c.head_dim
    f = c.ffn // n
    s_h, s_q, s_f = 1 / math.sqrt(c.hidden), 1 / math.sqrt(c.num_heads * c.head_dim), 1 / math.sqrt(c.ffn)
    w = {
        "qkv": torch.cat([_randn((q, c.hidden), _shard_seed(seed, "q", r, n), d, s_h),
                          _randn((kv, c.hidden), _shard_seed(seed, "k", r, n), d, s_h),
                          _randn((kv, c.hidden), _shard_seed(seed, "v", r, n), d, s_h)]),
        "o": _randn((c.hidden, q), _shard_seed(seed, "o", r, n), d, s_q),
        "gate_up": torch.cat([_randn((f, c.hidden), _shard_seed(seed, "gate", r, n), d, s_h),
                              _randn((f, c.hidden), _shard_seed(seed, "up", r, n), d, s_h)]),
        "down": _randn((c.hidden, f), _shard_seed(seed, "down", r, n), d, s_f),
    }
    for name in ("norm_in", "norm_post", "norm_out"):
        w[name] = 1 + _randn((c.hidden,), _shard_seed(seed, name, 0, 1), d, 0.1)
    return w


def full_weights(config: LlamaConfig, world_size: int, seed: int = 0, device=torch.device("cpu"),
                 dtype: torch.dtype = torch.float64) -> Dict[str, torch.Tensor]:
    """The whole layer (``dtype``, fp64 by default) whose shards ``shard_weights(..., device)`` gives
    at this world size: q, k, v [heads * head_dim, hidden], o, gate, up, down, and the norm weights.
    ``device`` is where the shards are generated (a layer built with the same ``init_device``)."""
    parts = [shard_weights(config, world_size, r, seed, device) for r in range(world_size)]
    q = config.num_heads // world_size * config.head_dim
    kv = config.num_kv_heads // world_size * config.head_dim
    f = config.ffn // world_size
    cat0 = lambda key, lo, hi: torch.cat([p[key][lo:hi] for p in parts]).to(dtype)  # noqa: E731
    return {"q": cat0("qkv", 0, q), "k": cat0("qkv", q, q + kv), "v": cat0("qkv", q + kv, q + 2 * kv),
            "o": torch.cat([p["o"] for p in parts], dim=1).to(dtype),
            "gate": cat0("gate_up", 0, f), "up": cat0("gate_up", f, 2 * f),
            "down": torch.cat([p["down"] for p in parts], dim=1).to(dtype),
            **{k: parts[0][k].to(dtype) for k in ("norm_in", "norm_post", "norm_out")}}


def shard_as_layer(config: LlamaConfig, world_size: int, rank: int, seed: int = 0, device=torch.device("cpu"),
                   dtype: torch.dtype = torch.float64) -> Tuple[LlamaConfig, Dict[str, torch.Tensor]]:
    """Rank ``rank``'s shards as a layer of their own (its heads and FFN slice; ``full_weights``'
    layout): what the layer computes on that rank with the all-reduces removed (``nocomm``)."""
    c, n = config, world_size
    part = shard_weights(config, n, rank, seed, device)
    q, kv, f = c.num_heads // n * c.head_dim, c.num_kv_heads // n * c.head_dim, c.ffn // n
    sub = LlamaConfig(c.hidden, c.num_heads // n, c.num_kv_heads // n, c.head_dim, f, c.eps)
    w = {"q": part["qkv"][:q], "k": part["qkv"][q:q + kv], "v": part["qkv"][q + kv:], "o": part["o"],
         "gate": part["gate_up"][:f], "up": part["gate_up"][f:], "down": part["down"],
         **{k: part[k] for k in ("norm_in", "norm_post", "norm_out")}}
    return sub, {k: v.to(dtype) for k, v in w.items()}


def reference_forward(config: LlamaConfig, w: Dict[str, torch.Tensor], hidden: torch.Tensor,
                      residual: Optional[torch.Tensor] = None,
                      seq_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The layer from ``full_weights`` (no sharding; in the weights' dtype and on their device: fp64
    on CPU by default, so no rounding to speak of): (out, residual). Attention runs one KV head's
    group of query heads at a time, so the scores never hold more than heads / kv_heads x T x T."""
    c = config
    dt, dev = w["q"].dtype, w["q"].device
    x = hidden.to(dev, dt)
    T = x.shape[0]

    def norm(v, weight):
        return v / torch.sqrt((v * v).mean(dim=-1, keepdim=True) + c.eps) * weight

    if residual is None:
        res, h = x.clone(), norm(x, w["norm_in"])
    else:
        res, h = residual.to(dev, dt).clone(), x
    seq = seq_ids.to(dev) if seq_ids is not None else torch.zeros(T, dtype=torch.int64, device=dev)
    idx = torch.arange(T, device=dev)
    mask = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])
    q = (h @ w["q"].t()).view(T, c.num_heads, c.head_dim).transpose(0, 1)
    k = (h @ w["k"].t()).view(T, c.num_kv_heads, c.head_dim).transpose(0, 1)
    v = (h @ w["v"].t()).view(T, c.num_kv_heads, c.head_dim).transpose(0, 1)
    rep = c.num_heads // c.num_kv_heads
    a = torch.empty(c.num_heads, T, c.head_dim, device=dev, dtype=dt)
    for j in range(c.num_kv_heads):
        scores = (q[j * rep:(j + 1) * rep] @ k[j].t()) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        a[j * rep:(j + 1) * rep] = torch.softmax(scores, dim=-1) @ v[j]
    a = a.transpose(0, 1).reshape(T, c.num_heads * c.head_dim)
    res = res + a @ w["o"].t()
    h2 = norm(res, w["norm_post"])
    m = F.silu(h2 @ w["gate"].t()) * (h2 @ w["up"].t())
    res = res + m @ w["down"].t()
    return norm(res, w["norm_out"]), res


# Note [split and attention]
# TokenWeave splits the batch's tokens, not its sequences: group A is the prefix [0, s) of the
# flattened batch and group B the suffix [s, T), and s (wave_aware_split) may fall inside a
# sequence. Everything but attention is row-independent (GEMMs, norms, SiLU * up, the fused op:
# a row's result does not depend on which other rows are in the batch). Attention couples the
# tokens of a sequence, but causally: a token attends only to earlier tokens of its own sequence.
# Sequences are laid out one after the other in position order, so group A's tokens attend only to
# tokens of group A, and group B's tokens attend to B and to the part of their sequence in A, whose
# keys and values group A computed first (on the same compute stream, so they are ready): the
# batch's QKV buffer plays the role of TokenWeave's KV cache. Hence no sequence is moved and the
# split point stays where the GEMM waves want it.
# Every group's attention reads the keys of the whole batch [0, T) under the mask "same sequence
# and not later" (`attention_bias`, built on the device from seq_ids once per batch for every layer
# and group: no host work, so the layer can be captured with any sequence layout and replayed with
# another), in every mode: the unsplit batch is one group [0, T). Each group writes its own rows of
# the batch's keys and values (repeated per query head) into one K/V buffer, so the expansion runs
# once per token whatever the split. Group A runs before group B's keys exist, so the rows [s, T)
# of that buffer are zeroed first (masked keys get weight exactly 0, but 0 * NaN of stale memory
# would not be 0).
# With the same key extent, the masked attention's result for a query row does not depend on which
# other query rows are computed with it (checked bitwise on CPU by tests/cpu/test_tokenweave.py),
# so on CPU `tokenweave` is bitwise equal to `fused`. The cost: every mode computes T x T scores
# (the explicit mask keeps SDPA off the causal-skipping flash kernel), the same in all modes, so
# the modes' ratios compare like with like.


MASK_ALIGN = 16  # elements: the row stride SDPA's memory-efficient kernel takes a mask with, uncopied


def attention_bias(seq_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask of a batch (Note [split and attention]): [T, T] in ``dtype``, 0
    where key j may be attended by query i (same sequence, j <= i), -inf elsewhere: what SDPA makes
    of the boolean mask on every call, made once per batch. Its rows are ``MASK_ALIGN``-aligned."""
    T = seq_ids.shape[0]
    idx = torch.arange(T, device=seq_ids.device)
    allowed = (seq_ids[:, None] == seq_ids[None, :]) & (idx[None, :] <= idx[:, None])
    stride = -(-T // MASK_ALIGN) * MASK_ALIGN
    bias = torch.full((T, stride), float("-inf"), dtype=dtype, device=seq_ids.device)[:, :T]
    return bias.masked_fill_(allowed, 0.0)


class TPDecoderLayer:
    """One Llama-style TP decoder layer on this rank (module docstring; docs/tokenweave.md).

    ``comm``: a ``commlib.Communicator`` over the TP group (every rank builds the layer with the
    same arguments). ``mode``: one of MODES (default for ``forward``). ``group``: a
    ``torch.distributed`` process group for ``sequential`` (NCCL / gloo); None: the communicator's
    ``all_reduce_``. ``num_sms``: the fused op's CTAs while it overlaps compute (tokenweave; default
    the tuned value, else ``tokenweave.default_num_sms``: 16, or the op's own at world size 1); the
    unsplit fused op and the schedule's last one use the op's own default (Note [overlap SM
    budget] in tokenweave.py). ``seed``: the weights' seed (``shard_weights``, generated on
    ``init_device``: CPU by default, or the layer's GPU for speed; ``full_weights`` with the same
    device gives the whole layer); ``dtype``: bfloat16 (default), float16, or float32 (CPU only: the
    fused GPU op takes 16-bit types). ``split_min_tokens``, ``wave_steps``: the policy's crossover and wave steps
    (default: tuned, else built-in; ``commlib.tokenweave``). ``all_reduce``: an in-place sum
    ``fn(tensor)`` for ``sequential`` instead of ``group`` (an engine's own all-reduce).
    """

    def __init__(self, config: LlamaConfig, comm, *, mode: str = "tokenweave", dtype: torch.dtype = torch.bfloat16,
                 device=None, seed: int = 0, group: Optional[dist.ProcessGroup] = None,
                 num_sms: Optional[int] = None, split_min_tokens: Optional[int] = None, wave_steps=None,
                 init_device=torch.device("cpu"), all_reduce: Optional[Callable[[torch.Tensor], None]] = None):
        what = "TPDecoderLayer"
        if mode not in MODES:
            raise ValueError(f"{what}: mode '{mode}' not supported; supported: {', '.join(MODES)}")
        if dtype not in DTYPES:
            raise TypeError(f"{what}: dtype {dtype} not supported; supported: bfloat16, float16, float32")
        if num_sms is not None and (isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1):
            raise ValueError(f"{what}: num_sms {num_sms!r} must be a positive int or None")
        self.world_size, self.rank = comm.world_size, comm.rank
        config.check(self.world_size)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda" and dtype == torch.float32:
            raise TypeError(f"{what}: dtype float32 not supported on CUDA; supported: bfloat16, float16")
        self.config, self.comm, self.mode, self.dtype, self.group = config, comm, mode, dtype, group
        self.all_reduce = all_reduce
        self.seed = seed
        n = self.world_size
        self.q_dim = config.num_heads // n * config.head_dim
        self.kv_dim = config.num_kv_heads // n * config.head_dim
        self.ffn = config.ffn // n
        self.heads, self.kv_heads = config.num_heads // n, config.num_kv_heads // n
        w = shard_weights(config, n, self.rank, seed, init_device)
        self.weights = {k: v.to(self.device, dtype) for k, v in w.items()}
        # [in, out] views of the [out, in] weights: torch.matmul(x, w_t, out=rows) writes a row slice in place.
        self._t = {k: self.weights[k].t() for k in ("qkv", "o", "gate_up", "down")}
        self.gemm_shapes = tokenweave.layer_gemm_shapes(config.hidden, config.num_heads, config.num_kv_heads,
                                                        config.head_dim, config.ffn, n)
        tuned = tokenweave.tuned_params(n) if self.device.type == "cuda" else tokenweave.TokenWeaveParams()
        self.num_sms = num_sms or tuned.num_sms
        self.split_min_tokens = split_min_tokens if split_min_tokens is not None else tuned.split_min_tokens
        self.wave_steps = wave_steps if wave_steps is not None else tuned.wave_steps
        self.schedule = tokenweave.OverlapSchedule(self.device)

    # ---- policy ----
    def split_for(self, num_tokens: int) -> int:
        """The prefix size tokenweave mode uses for ``num_tokens`` (0: unsplit, the fused op only)."""
        if not tokenweave.should_split(num_tokens, self.gemm_shapes, split_min_tokens=self.split_min_tokens,
                                       wave_steps=self.wave_steps, world_size=self.world_size):
            return 0
        return tokenweave.wave_aware_split(num_tokens, self.gemm_shapes, self.wave_steps)

    # ---- forward ----
    def __call__(self, hidden, residual=None, **kwargs):
        return self.forward(hidden, residual, **kwargs)

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor] = None, *,
                seq_ids: Optional[torch.Tensor] = None, mode: Optional[str] = None,
                split: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Collective: every rank passes the same ``hidden`` [tokens, hidden] (and residual, seq_ids,
        mode, split). Returns ``(out, residual)``: ``out`` new, ``residual`` updated in place (a new
        tensor when None was passed: then ``hidden`` is the raw input and the input norm runs here).

        ``seq_ids``: int64 [tokens] on the layer's device, the sequence of each token (sequences one
        after the other, each in position order; ``seq_ids_from_lens``); None: one sequence.
        ``mode``: overrides the layer's mode. ``split``: tokenweave's prefix size (None: the
        policy, ``split_for``; 0: unsplit; else 1..tokens-1). Under CUDA-graph capture pass
        ``split`` or rely on the policy, which is host arithmetic on the shape only.
        """
        return run_layers([self], hidden, residual, seq_ids=seq_ids, mode=mode, split=split)

    def _resolve_split(self, mode: str, split, T: int) -> int:
        if mode == "tokenweave":
            split = self.split_for(T) if split is None else split
            if isinstance(split, bool) or not isinstance(split, int) or not (split == 0 or 0 < split < T):
                raise ValueError(f"TPDecoderLayer: split {split!r} out of range; valid: 0 (unsplit) or "
                                 f"1..{T - 1} for {T} tokens")
            return split
        if split not in (None, 0):
            raise ValueError(f"TPDecoderLayer: split {split!r} applies to mode 'tokenweave' only; mode is '{mode}'")
        return 0

    def _plan(self, mode: str, x: torch.Tensor, residual: torch.Tensor, bias: torch.Tensor, split: int, *,
              last: bool):
        """This layer's steps over ``x`` (normalised input) and ``residual``, and its output buffer.
        ``bias``: the batch's attention mask (``attention_bias``); ``last``: this layer's last
        collective ends the schedule (Note [overlap SM budget])."""
        c, dev, dt = self.config, self.device, self.dtype
        T = x.shape[0]
        buf = {"qkv": torch.empty(T, self.q_dim + 2 * self.kv_dim, device=dev, dtype=dt),
               "kv": torch.empty(2, self.heads, T, c.head_dim, device=dev, dtype=dt),
               "attn": torch.empty(T, self.q_dim, device=dev, dtype=dt),
               "o": torch.empty(T, c.hidden, device=dev, dtype=dt),
               "h2": torch.empty(T, c.hidden, device=dev, dtype=dt),
               "gu": torch.empty(T, 2 * self.ffn, device=dev, dtype=dt),
               "down": torch.empty(T, c.hidden, device=dev, dtype=dt),
               "out": torch.empty(T, c.hidden, device=dev, dtype=dt),
               "bias": bias}
        groups = tokenweave.group_ranges(T, split) if split else ((0, T),)
        return self._steps(mode, groups, x, residual, buf, last), buf["out"]

    def _steps(self, mode: str, groups, x, residual, buf, last: bool) -> List[tokenweave.Step]:
        c = self.config
        rep = self.heads // self.kv_heads
        split = len(groups) == 2

        def attention_block(g):
            b, e = groups[g]
            qkv, kv = buf["qkv"], buf["kv"]
            torch.matmul(x[b:e], self._t["qkv"], out=qkv[b:e])
            # This group's keys and values, one copy per query head (GQA), into the batch's K/V.
            src = qkv[b:e, self.q_dim:].view(e - b, 2, self.kv_heads, 1, c.head_dim).permute(1, 2, 3, 0, 4)
            kv[:, :, b:e].view(2, self.kv_heads, rep, e - b, c.head_dim).copy_(
                src.expand(2, self.kv_heads, rep, e - b, c.head_dim))
            if split and g == 0:
                kv[:, :, e:].zero_()  # group B's keys, read (masked) by A: Note [split and attention]
            q = qkv[b:e, :self.q_dim].view(e - b, self.heads, c.head_dim).transpose(0, 1)
            a = F.scaled_dot_product_attention(q[None], kv[0][None], kv[1][None],
                                               attn_mask=buf["bias"][b:e][None, None])
            buf["attn"][b:e].view(e - b, self.heads, c.head_dim).copy_(a[0].transpose(0, 1))
            torch.matmul(buf["attn"][b:e], self._t["o"], out=buf["o"][b:e])

        def mlp_block(g):
            b, e = groups[g]
            gu = buf["gu"][b:e]
            torch.matmul(buf["h2"][b:e], self._t["gate_up"], out=gu)
            m = F.silu(gu[:, :self.ffn]) * gu[:, self.ffn:]
            torch.matmul(m, self._t["down"], out=buf["down"][b:e])

        def reduce_norm(src: str, dst: str, weight: str, *, ends_schedule: bool):
            def comm(g):
                b, e = groups[g]
                # Beside the other group's compute: the overlap budget; unsplit, or the schedule's
                # last (nothing beside it): the fused op's own (Note [overlap SM budget]).
                alone = not split or (ends_schedule and g == len(groups) - 1)
                num_sms = None if alone else self.num_sms
                self._reduce_norm(mode, buf[src][b:e], residual[b:e], self.weights[weight], buf[dst][b:e], num_sms)
            return comm

        return [tokenweave.Step(attention_block, reduce_norm("o", "h2", "norm_post", ends_schedule=False)),
                tokenweave.Step(mlp_block, reduce_norm("down", "out", "norm_out", ends_schedule=last))]

    def _reduce_norm(self, mode: str, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     out: torch.Tensor, num_sms: Optional[int]) -> None:
        """residual += all_reduce(x); out = rms_norm(residual) * weight, on the rows given."""
        eps = self.config.eps
        if mode in ("fused", "tokenweave"):
            self.comm.fused_allreduce_rmsnorm(x, residual, weight, eps, out=out, num_sms=num_sms)
            return
        if mode == "sequential":
            if self.all_reduce is not None:
                self.all_reduce(x)
            elif self.group is not None:
                dist.all_reduce(x, group=self.group)
            else:
                self.comm.all_reduce_(x)
        residual.add_(x)
        out.copy_(F.rms_norm(residual, (residual.shape[-1],), weight, eps))

    def _check(self, hidden, residual, seq_ids, mode) -> int:
        what = "TPDecoderLayer"
        if mode not in MODES:
            raise ValueError(f"{what}: mode '{mode}' not supported; supported: {', '.join(MODES)}")
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"{what}: hidden must be a torch.Tensor, got {type(hidden).__name__}")
        if hidden.dim() != 2 or hidden.shape[1] != self.config.hidden:
            raise ValueError(f"{what}: hidden must have shape [tokens, {self.config.hidden}]; "
                             f"got {tuple(hidden.shape)}")
        if hidden.dtype != self.dtype:
            raise TypeError(f"{what}: hidden has dtype {hidden.dtype} but the layer is {self.dtype}")
        if hidden.device != self.device:
            raise TypeError(f"{what}: hidden is on {hidden.device} but the layer is on {self.device}")
        if not hidden.is_contiguous():
            raise ValueError(f"{what}: hidden must be contiguous")
        T = hidden.shape[0]
        if residual is not None:
            if not isinstance(residual, torch.Tensor):
                raise TypeError(f"{what}: residual must be a torch.Tensor or None, got {type(residual).__name__}")
            if residual.shape != hidden.shape or residual.dtype != hidden.dtype or residual.device != hidden.device:
                raise ValueError(f"{what}: residual must match hidden ({tuple(hidden.shape)}, {hidden.dtype}, "
                                 f"{hidden.device}); got ({tuple(residual.shape)}, {residual.dtype}, "
                                 f"{residual.device})")
            if not residual.is_contiguous() or residual.data_ptr() == hidden.data_ptr() and T:
                raise ValueError(f"{what}: residual must be contiguous and must not alias hidden")
        if seq_ids is not None:
            if not isinstance(seq_ids, torch.Tensor) or seq_ids.dtype != torch.int64 or seq_ids.shape != (T,):
                raise ValueError(f"{what}: seq_ids must be an int64 tensor of shape [{T}]; got "
                                 f"{getattr(seq_ids, 'dtype', type(seq_ids).__name__)} "
                                 f"{tuple(getattr(seq_ids, 'shape', ()))}")
            if seq_ids.device != self.device:
                raise TypeError(f"{what}: seq_ids is on {seq_ids.device} but the layer is on {self.device}")
        return T


def run_layers(layers: Sequence[TPDecoderLayer], hidden: torch.Tensor, residual: Optional[torch.Tensor] = None, *,
               seq_ids: Optional[torch.Tensor] = None, mode: Optional[str] = None,
               split: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Runs ``layers`` one after the other (layer i's ``out`` is layer i + 1's input; the residual is
    shared) as ONE schedule: in ``tokenweave`` mode the last collective of layer i (group B's) then
    overlaps layer i + 1's first compute (group A's attention), so only the stack's last collective
    is exposed. Arguments as ``TPDecoderLayer.forward`` (``mode`` and ``split``: every layer's; the
    split is the first layer's policy when None). Collective. Returns ``(out, residual)``."""
    if not layers:
        raise ValueError("run_layers: no layers")
    first = layers[0]
    mode = mode or first.mode
    T = first._check(hidden, residual, seq_ids, mode)
    for layer in layers[1:]:
        if (layer.device, layer.dtype, layer.config.hidden, layer.comm) != (first.device, first.dtype,
                                                                          first.config.hidden, first.comm):
            raise ValueError("run_layers: the layers must share device, dtype, hidden size and communicator")
    split = first._resolve_split(mode, split, T)
    c = first.config
    if residual is None:
        residual = hidden.clone()
        x = F.rms_norm(hidden, (c.hidden,), first.weights["norm_in"], c.eps)
    else:
        x = hidden
    if seq_ids is None:
        seq_ids = torch.zeros(T, dtype=torch.int64, device=first.device)
    bias = attention_bias(seq_ids, first.dtype)  # one mask for every layer and group
    steps: List[tokenweave.Step] = []
    for i, layer in enumerate(layers):
        layer_steps, x = layer._plan(mode, x, residual, bias, split, last=i == len(layers) - 1)
        steps += layer_steps
    if T == 0:
        return x, residual
    if split:
        first.schedule.run(steps)
    else:
        for step in steps:
            step.compute(0)
            step.comm(0)
    return x, residual


class CapturedLayer:
    """A ``TPDecoderLayer`` captured in CUDA graphs for token counts up to ``max(buckets)``.

    One graph per bucket (a token count), captured at construction (collective: every rank builds
    it with the same arguments, outside any other capture). ``run(hidden, residual, seq_ids)`` with
    t <= max(buckets) tokens copies the inputs into the smallest bucket >= t, fills the rows past t
    with a padding sequence of its own (zero hidden and residual rows, a sequence id no real token
    has), replays, and returns the first t rows of out and of the residual (copies). The padding
    changes no real row: every op but attention is row-independent, and attention is masked by
    sequence. The split of each bucket is the layer's policy at the bucket's size (fixed at capture).
    """

    def __init__(self, layer: TPDecoderLayer, buckets: Sequence[int], mode: Optional[str] = None):
        if layer.device.type != "cuda":
            raise ValueError(f"CapturedLayer: device {layer.device} not supported; supported: cuda")
        sizes = sorted(set(int(b) for b in buckets))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"CapturedLayer: buckets {list(buckets)} must be token counts >= 1")
        self.layer, self.mode, self.buckets = layer, mode or layer.mode, sizes
        self._graphs = {}
        dev, dt, H = layer.device, layer.dtype, layer.config.hidden
        for T in sizes:
            st = {"hidden": torch.zeros(T, H, device=dev, dtype=dt),
                  "residual": torch.zeros(T, H, device=dev, dtype=dt),
                  "seq": torch.zeros(T, dtype=torch.int64, device=dev)}
            res0 = st["residual"].clone()
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up: the communicator's and cuBLAS's first-use set-up
                layer.forward(st["hidden"], st["residual"], seq_ids=st["seq"], mode=self.mode)
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            st["residual"].copy_(res0)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, _ = layer.forward(st["hidden"], st["residual"], seq_ids=st["seq"], mode=self.mode)
            st["out"] = out
            self._graphs[T] = (graph, st)

    def bucket_for(self, num_tokens: int) -> int:
        for T in self.buckets:
            if num_tokens <= T:
                return T
        raise ValueError(f"CapturedLayer: {num_tokens} tokens exceed the captured maximum {self.buckets[-1]}")

    def run(self, hidden: torch.Tensor, residual: torch.Tensor,
            seq_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Collective. ``hidden`` is already normalised (a layer called with a residual)."""
        t = hidden.shape[0]
        graph, st = self._graphs[self.bucket_for(t)]
        st["hidden"][:t].copy_(hidden)
        st["hidden"][t:].zero_()
        st["residual"][:t].copy_(residual)
        st["residual"][t:].zero_()
        if seq_ids is None:
            st["seq"][:t].zero_()
            st["seq"][t:].fill_(1)
        else:
            st["seq"][:t].copy_(seq_ids)
            st["seq"][t:].copy_(seq_ids.max() + 1 if t else torch.zeros((), dtype=torch.int64, device=seq_ids.device))
        graph.replay()
        return st["out"][:t].clone(), st["residual"][:t].clone()


__all__ = ["LlamaConfig", "TPDecoderLayer", "CapturedLayer", "run_layers", "MODES", "seq_ids_from_lens",
           "shard_weights", "full_weights", "shard_as_layer", "reference_forward"]
