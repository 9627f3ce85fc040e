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


def default_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    """commlib's attention call (the ``attn_fn`` contract): FlashAttention-varlen semantics.

    q ``[Tq, H, D]``, k / v ``[Tk, Hkv, D]`` (H a multiple of Hkv), int32 cu_seqlens on q's
    device, ``causal`` bottom-right aligned; returns ``(out [Tq, H, D] in q's dtype, lse [H, Tq]
    float32)``. Every sequence has at least one query and one key. CUDA fp16/bf16:
    ``aten._flash_attention_forward`` (varlen, native GQA); other CUDA dtypes: the
    efficient-attention op per sequence; CPU: ``aten._scaled_dot_product_flash_attention_for_cpu``
    per sequence (KV heads repeated for GQA).
    """
    if _flash_varlen_ok(q):
        o, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False, scale=scale)[:2]
        return o, lse.float()
    return _attention_per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)
