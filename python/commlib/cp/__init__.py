"""Context parallelism: ring attention (pass-KV, pass-Q), the load-balanced sharding, the merge of
partial attention states, and the pass-KV / pass-Q selection rule. See docs/cp.md.

The modules, in the order a call meets them:
  layout.py     the tensors' layout; shard / unshard (Note [balanced layout])
  ring.py       ring_attention: argument agreement (Note [agreed arguments]), transport and mode
  select.py     select_mode, the pass-KV / pass-Q rule, and its machine constants
  plan.py       the attention calls of every block pair (Note [block pairs])
  passes.py     the ring's steps: pass-KV, pass-Q and the return of partial results
  attention.py  default_attention, one block pair's attention call
  merge.py      merge_attention_states and the running (O, LSE) state
  transport.py  RingTransport; DistTransport, CommTransport
  symmetric.py  SymmetricTransport, the copy-engine ring (Note [cp copy-engine ring]), and its
                watchdog (Note [cp ring watchdog])
"""
from .attention import AttnFn, default_attention  # noqa: F401 (public, outside __all__)
from .layout import LAYOUTS, Shard, shard, unshard
from .merge import merge_attention_states
from .ring import MODES, PASS_Q_RETURNS, ring_attention
from .select import DEFAULT_ATTN_FLOPS, DEFAULT_BW  # noqa: F401 (public, outside __all__)
from .select import machine_constants, select_mode
from .symmetric import SymmetricTransport
from .transport import CommTransport, DistTransport, RingTransport

__all__ = ["MODES", "LAYOUTS", "PASS_Q_RETURNS", "Shard", "shard", "unshard", "merge_attention_states",
           "default_attention", "select_mode", "machine_constants", "ring_attention", "RingTransport",
           "DistTransport", "CommTransport", "SymmetricTransport"]
