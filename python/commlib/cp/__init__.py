"""Context parallelism (docs/cp.md); the implementation is being split into modules of this package."""
from .ring import *  # noqa: F401,F403
from .ring import (DEFAULT_ATTN_FLOPS, DEFAULT_BW, AttnFn, __all__, _block_attention, _merge2,  # noqa: F401
                   _merge_kernel, _plan, _State, _tuned, _watchdog)
