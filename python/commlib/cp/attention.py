"""The attention call of one block pair: ``default_attention`` (FlashAttention-varlen semantics
over PyTorch's attention ops) and ``AttnFn``, the contract a caller's ``attn_fn`` follows."""
from __future__ import annotations

from typing import Callable, Tuple

import torch

AttnFn = Callable[..., Tuple[torch.Tensor, torch.Tensor]]


def _sdpa_cpu_one(q, k, v, causal: bool, scale: float):
    """One sequence: q [Lq, H, D], k/v [Lk, Hkv, D] -> (o [Lq, H, D], lse [H, Lq]); causal is
    bottom-right aligned (query i sees keys up to i + Lk - Lq)."""
    h, hkv = q.shape[1], k.shape[1]
    if hkv != h:
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    lq, lk = q.shape[0], k.shape[0]
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if causal and lq != lk:
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        bias = torch.zeros(lq, lk, dtype=q.dtype).masked_fill(~mask, float("-inf"))
        o, lse = op(qt, kt, vt, 0.0, False, attn_mask=bias, scale=scale)
    else:
        o, lse = op(qt, kt, vt, 0.0, causal, scale=scale)
    return o[0].transpose(0, 1), lse[0].float()


def _attention_per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    cu_q_l, cu_k_l = cu_q.tolist(), cu_k.tolist()
    h = q.shape[1]
    out = q.new_zeros(q.shape)
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(cu_q_l) - 1):
        q0, q1, k0, k1 = cu_q_l[b], cu_q_l[b + 1], cu_k_l[b], cu_k_l[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        if q.is_cuda:
            o_b, lse_b = _sdpa_cuda_one(q[q0:q1], k[k0:k1], v[k0:k1], causal, scale)
        else:
            o_b, lse_b = _sdpa_cpu_one(q[q0:q1], k[k0:k1], v[k0:k1], causal, scale)
        out[q0:q1] = o_b
        lse[:, q0:q1] = lse_b
    return out, lse


def _sdpa_cuda_one(q, k, v, causal: bool, scale: float):
    """One sequence on CUDA through the efficient-attention op (any float dtype, bottom-right
    causal mask type 2); LSE trimmed to the query count."""
    h, hkv = q.shape[1], k.shape[1]
    if hkv != h:
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    mask_type = 2 if causal else 0  # 2: causal from bottom right
    o, lse = torch.ops.aten._efficient_attention_forward(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, None, None, None, None, 0.0, mask_type, True,
        scale=scale)[:2]
    return o[0], lse[0, :, :q.shape[0]].float()


def _flash_varlen_ok(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


# Note [cp attention backend]
# PyTorch has three CUDA attention kernels that return the LSE a ring step needs: FlashAttention
# (varlen, bottom-right causal), cuDNN (dense [B, H, L, D], native GQA, causal top-left aligned) and
# efficient attention. On one H200 (bf16, 64 Q / 8 KV heads of 128) cuDNN took 0.52-0.59x
# FlashAttention's time on every ring-step shape measured (1K-32K queries, causal square and
# non-causal rectangles: 390-670 TFLOP/s against 210-360), efficient attention about 2x
# FlashAttention's; cuDNN's varlen entry (cum_seq_q) took 40-90 ms at any shape, so it is never used.
# So "auto" takes cuDNN where a call is a dense batch it computes exactly: every sequence of the
# call has the same query count and the same key count (Tq == B * max_q: no host read needed), a
# causal call is square (top-left == bottom-right alignment), fp16 / bf16, head_dim a multiple of 8
# up to 128, compute capability >= 9.0 (where it was measured); FlashAttention otherwise. With the
# balanced layout every step of a pass-KV ring over whole sequences of equal length is such a call
# (Note [block pairs]); decode and partial prefill (rectangular causal) take FlashAttention.
# default_attention(..., backend=...) (through attn_fn) overrides the rule.

ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient")
_auto_rule: dict = {}


def _cudnn_fits(q, k, cu_seqlens_q, max_q: int, max_k: int, causal: bool) -> int:
    """The batch size B when the call is a dense batch cuDNN computes exactly, else 0."""
    b = cu_seqlens_q.numel() - 1
    if b < 1 or max_q < 1 or max_k < 1 or q.shape[0] != b * max_q or k.shape[0] != b * max_k:
        return 0
    if causal and max_q != max_k:
        return 0
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] % 8 or q.shape[-1] > 128:
        return 0
    return b


def _auto_backend(device: torch.device) -> str:
    """"cudnn" or "flash" for this device (the rule of Note [cp attention backend])."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _auto_rule:
        ok = hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention") and \
            torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(index) >= (9, 0)
        _auto_rule[index] = "cudnn" if ok else "flash"
    return _auto_rule[index]


def _cudnn_attention(q, k, v, b: int, max_q: int, max_k: int, causal: bool, scale: float):
    """B sequences of max_q queries and max_k keys through cuDNN (native GQA); the [B, H, L, D]
    views keep q's token-major memory, and cuDNN writes its output in the same order, so the
    result is a view of [Tq, H, D] rows for B == 1."""
    h, d = q.shape[1], q.shape[2]
    q4 = q.view(b, max_q, h, d).transpose(1, 2)
    k4 = k.view(b, max_k, k.shape[1], d).transpose(1, 2)
    v4 = v.view(b, max_k, v.shape[1], d).transpose(1, 2)
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, causal, False,
                                                                scale=scale)[:2]
    o = o.transpose(1, 2).reshape(b * max_q, h, d)
    lse = lse.reshape(b, h, max_q).transpose(0, 1).reshape(h, b * max_q)
    return o, lse.float()


def default_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, *,
                      backend: str = "auto"):
    """commlib's attention call (the ``attn_fn`` contract): FlashAttention-varlen semantics.

    q ``[Tq, H, D]``, k / v ``[Tk, Hkv, D]`` (H a multiple of Hkv), int32 cu_seqlens on q's
    device, ``causal`` bottom-right aligned; returns ``(out [Tq, H, D] in q's dtype, lse [H, Tq]
    float32)``. Every sequence has at least one query and one key. CUDA fp16/bf16: ``backend``
    "auto" (Note [cp attention backend]: cuDNN where the call is a dense batch it computes exactly
    on a GPU of compute capability 9.0+, else ``aten._flash_attention_forward``, varlen with
    native GQA), "cudnn" (where it fits, else FlashAttention), "flash" or "efficient"; other CUDA
    dtypes: the efficient-attention op per sequence; CPU: ``aten._scaled_dot_product_flash_attention_for_cpu``
    per sequence (KV heads repeated for GQA). Override with ``functools.partial(default_attention,
    backend=...)`` as ``attn_fn``.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"default_attention: backend {backend!r} not supported; supported: "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    if _flash_varlen_ok(q) and backend != "efficient":
        if backend != "flash":
            b = _cudnn_fits(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal)
            if b and (backend == "cudnn" or _auto_backend(q.device) == "cudnn"):
                return _cudnn_attention(q, k, v, b, max_seqlen_q, max_seqlen_k, causal, scale)
        o, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False, scale=scale)[:2]
        return o, lse.float()
    return _attention_per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
