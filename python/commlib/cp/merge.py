"""The merge of partial attention states: ``merge_attention_states`` (one fused CUDA kernel, or
the same arithmetic in torch ops on the CPU) and ``_State``, ring attention's running (O, LSE)
accumulator."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .layout import _DTYPE_NAMES, _DTYPES


def _merge2(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """(o_a, lse_a) (+) (o_b, lse_b) in fp32; o [T, H, D], lse [H, T] (Note [merge of attention
    states] in csrc/kernels/merge_attn_states.cu: the CUDA kernel's arithmetic). A state with lse
    -inf (no key seen) contributes nothing, whatever its o holds; two such states give o 0, lse -inf."""
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a = torch.exp(lse_a - m_safe)
    w_b = torch.exp(lse_b - m_safe)
    s = w_a + w_b
    lse = torch.where(s > 0, m_safe + torch.log(s), torch.full_like(s, float("-inf")))
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    f_a = (w_a * inv).transpose(0, 1).unsqueeze(-1)
    f_b = (w_b * inv).transpose(0, 1).unsqueeze(-1)
    zero = o_a.new_zeros(())
    nan = torch.isnan(lse_a) | torch.isnan(lse_b)  # a NaN LSE poisons the row (as on CUDA)
    lse = torch.where(nan, torch.full_like(lse, float("nan")), lse)
    f_a = torch.where(nan.transpose(0, 1).unsqueeze(-1), torch.full_like(f_a, float("nan")), f_a)
    return torch.where(f_a != 0, o_a * f_a, zero) + torch.where(f_b != 0, o_b * f_b, zero), lse


_merge_op: dict = {}
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _merge_kernel(t: torch.Tensor) -> bool:
    """Whether the fused CUDA merge (torch.ops.commlib.merge_attention_states[_]) takes ``t``."""
    if not t.is_cuda or t.dtype not in _KERNEL_DTYPES:
        return False
    if "ok" not in _merge_op:
        from .. import _C  # noqa: F401 - loading the extension registers torch.ops.commlib
        _merge_op["ok"] = hasattr(torch.ops.commlib, "merge_attention_states_")
    return _merge_op["ok"]


def _kernel_ready(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], out_dtype) -> bool:
    """Whether the fused op takes these states as they are (outs[0] is a kernel dtype on CUDA)."""
    dt = outs[0].dtype
    return ((out_dtype is None or out_dtype in _KERNEL_DTYPES)
            and all(o.dtype == dt and o.dim() == 3 and o.stride(-1) == 1 for o in outs)
            and all(x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1 for x in lses))


def merge_attention_states(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], *,
                           out_dtype: Optional[torch.dtype] = None):
    """Merges partial attention results over disjoint key sets: ``outs[s]`` ``[tokens, heads,
    head_dim]`` and ``lses[s]`` ``[heads, tokens]`` (natural-log LSE of the scaled scores; -inf
    for a token that saw no key). Returns ``(out, lse)``: out in ``out_dtype`` (default: the dtype
    of ``outs[0]``), lse in float32. The arithmetic is float32, max-subtracted (stable for any LSE
    magnitude); a state with LSE -inf contributes nothing (its out is not read), and a token whose
    every state is empty gets out 0, LSE -inf. CUDA tensors (float32 / float16 / bfloat16) take one
    fused kernel (``torch.ops.commlib.merge_attention_states``; Note [merge of attention states]),
    CPU tensors the same arithmetic in torch ops. Used by ring attention and usable for cascade /
    paged attention."""
    if outs and len(outs) == len(lses) and _merge_kernel(outs[0]) and _kernel_ready(outs, lses, out_dtype):
        # As they are (one kernel dtype, fp32 LSEs, contiguous last dims): the op checks shapes and
        # devices with the errors below, and the call costs one launch, no Python staging.
        return torch.ops.commlib.merge_attention_states(list(outs), list(lses), out_dtype or outs[0].dtype)
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"merge_attention_states: need as many outs as lses, at least one; got {len(outs)} "
                         f"outs and {len(lses)} lses")
    o0 = outs[0]
    if o0.dim() != 3:
        raise ValueError(f"merge_attention_states: outs[0] must be [tokens, heads, head_dim], got {tuple(o0.shape)}")
    t, h, _ = o0.shape
    for s, (o, lse) in enumerate(zip(outs, lses)):
        if o.shape != o0.shape:
            raise ValueError(f"merge_attention_states: outs[{s}] has shape {tuple(o.shape)}, outs[0] {tuple(o0.shape)}")
        if tuple(lse.shape) != (h, t):
            raise ValueError(f"merge_attention_states: lses[{s}] has shape {tuple(lse.shape)}; expected "
                             f"[heads, tokens] = {(h, t)}")
        for name, x in ((f"outs[{s}]", o), (f"lses[{s}]", lse)):
            if x.dtype not in _DTYPES:
                raise TypeError(f"merge_attention_states: {name} has dtype {x.dtype}; supported: {_DTYPE_NAMES}")
            if x.device != o0.device:
                raise TypeError(f"merge_attention_states: {name} is on {x.device} but outs[0] on {o0.device}; "
                                "every state must be on one device")
    if out_dtype is not None and out_dtype not in _DTYPES:
        raise TypeError(f"merge_attention_states: out_dtype {out_dtype} not supported; supported: {_DTYPE_NAMES}")
    if _merge_kernel(o0) and (out_dtype or o0.dtype) != torch.float64 and all(o.dtype != torch.float64 for o in outs):
        dt = o0.dtype if all(o.dtype == o0.dtype for o in outs) else torch.float32
        return torch.ops.commlib.merge_attention_states([o.to(dt) if o.stride(-1) == 1 else o.to(dt).contiguous()
                                                         for o in outs],
                                                        [x.float().contiguous() for x in lses], out_dtype or o0.dtype)
    o_acc = torch.zeros(o0.shape, dtype=torch.float32, device=o0.device)
    lse_acc = torch.full((h, t), float("-inf"), dtype=torch.float32, device=o0.device)
    for o, lse in zip(outs, lses):
        o_acc, lse_acc = _merge2(o_acc, lse_acc, o.float(), lse.float())
    return o_acc.to(out_dtype or o0.dtype), lse_acc


class _State:
    """A running (O, LSE) accumulator over this rank's query rows.

    Empty until the first partial arrives; a first partial over every row is adopted as it is (no
    copy, no fill: a world-1 ring returns the attention call's own output), and the first merge
    into an adopted partial writes a new fp32 accumulator in one pass (Note [merge of attention
    states]). ``result(dtype)`` converts once at the end.

    Note [merge lag]
    An attention call's own partial (``owned``) is merged one merge late: it waits until the next
    merge, ``partial()`` or ``result()``. So the last partial of a ring meets ``result(dtype)``,
    which merges it straight into the result's dtype when the state is still an adopted partial of
    that dtype (a two-step ring on CUDA): out of place for all rows, or in place into the adopted
    partial for a subset of them. Either way the arithmetic is the fp32 arithmetic of the
    accumulator path and the result is rounded once, so the bits are the same; what goes is the
    fp32 accumulator's traffic (written, read back and converted: 8 + 6 instead of 6 bytes an
    element for all rows, 6 + 5 + 6 instead of 3 for half of them). Writing into the adopted
    partial relies on the ``attn_fn`` contract: it returns new tensors (commlib.cp.default_attention)."""

    def __init__(self, rows: int, heads: int, head_dim: int, device):
        self.rows, self.heads, self.head_dim, self.device = rows, heads, head_dim, device
        self.out: Optional[torch.Tensor] = None
        self.lse: Optional[torch.Tensor] = None
        self._adopted = False  # out / lse are a partial's own tensors (never written in place but by result())
        self._pending: Optional[tuple] = None  # an owned partial not merged yet: (rows, o, lse)

    def _accumulator(self) -> None:
        """Makes out / lse an fp32 accumulator this state owns."""
        if self.out is None:
            self.out = torch.zeros(self.rows, self.heads, self.head_dim, dtype=torch.float32, device=self.device)
            self.lse = torch.full((self.heads, self.rows), float("-inf"), dtype=torch.float32, device=self.device)
        elif self._adopted:
            self.out = self.out.to(torch.float32, copy=True)
            self.lse = self.lse.clone()
        self._adopted = False

    def merge(self, rows: Optional[torch.Tensor], o: torch.Tensor, lse: torch.Tensor, *, owned: bool = False) -> None:
        """owned: o / lse are new tensors nobody else writes (an attention call's results), so a first
        full-row partial is kept as it is and a later one may wait (Note [merge lag]); otherwise (a
        transport slot, reused later) it is merged now."""
        lse = lse.float()
        if self.out is None and self._pending is None and rows is None and o.shape[0] == self.rows and owned:
            self.out, self.lse, self._adopted = o, lse, True
            return
        self._flush()
        if owned:
            self._pending = (rows, o, lse)
            return
        self._merge_now(rows, o, lse)

    def _flush(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._merge_now(*pending)

    def _merge_now(self, rows: Optional[torch.Tensor], o: torch.Tensor, lse: torch.Tensor) -> None:
        if self._adopted and rows is None and o.dtype == self.out.dtype and _merge_kernel(o):
            # The adopted partial and this one, merged out of place into the new accumulator.
            self.out, self.lse = merge_attention_states([self.out, o], [self.lse, lse], out_dtype=torch.float32)
            self._adopted = False
            return
        self._accumulator()
        if _merge_kernel(o):
            # One fused in-place pass (Note [merge of attention states]); rows index the accumulator.
            _merge_into(self.out, self.lse, o, lse, rows)
            return
        if rows is None:
            self.out, self.lse = _merge2(self.out, self.lse, o.float(), lse)
            return
        o_new, lse_new = _merge2(self.out[rows], self.lse[:, rows], o.float(), lse)
        self.out[rows] = o_new
        self.lse[:, rows] = lse_new

    def merge_all(self, outs: List[torch.Tensor], lses: List[torch.Tensor]) -> None:
        """Merges partials over all rows at once (on CUDA one fused pass over all of them)."""
        self._flush()
        if outs and _merge_kernel(outs[0]):
            self._accumulator()
            torch.ops.commlib.merge_attention_states_(self.out, self.lse, outs, [x.float() for x in lses], None)
            return
        for o, lse in zip(outs, lses):
            self.merge(None, o, lse)

    def partial(self):
        """(out, lse) as they are (fp32 accumulator or an adopted partial); zeros / -inf when empty."""
        self._flush()
        if self.out is None:
            self._accumulator()
        return self.out, self.lse

    def result(self, dtype: torch.dtype):
        """(out in ``dtype``, lse fp32): the ring's answer (Note [merge lag])."""
        if self._pending is not None and self._adopted and self.out.dtype == dtype:
            rows, o, lse = self._pending
            if o.dtype == dtype and _merge_kernel(o) and (rows is None or (self.out.stride(-1) == 1 and
                                                                          self.lse.stride(-1) == 1)):
                self._pending, self._adopted = None, False
                if rows is None:
                    self.out, self.lse = merge_attention_states([self.out, o], [self.lse, lse], out_dtype=dtype)
                else:
                    _merge_into(self.out, self.lse, o, lse, rows)  # into the adopted partial, rows only
                return self.out, self.lse
        out, lse = self.partial()
        return out.to(dtype), lse


def _merge_into(out: torch.Tensor, out_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                rows: Optional[torch.Tensor]) -> None:
    """(out, out_lse) (+)= (o, lse) in place, one fused CUDA pass; rows: out's row of each of o's."""
    torch.ops.commlib.merge_attention_states_(out, out_lse, [o if o.stride(-1) == 1 else o.contiguous()],
                                              [lse if lse.stride(-1) == 1 else lse.contiguous()], rows)
