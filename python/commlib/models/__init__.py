"""Reference model layers built on commlib's operations (benchmark subjects and integration examples)."""
from .llama import LlamaConfig, TPDecoderLayer, CapturedLayer, run_layers, seq_ids_from_lens

__all__ = ["LlamaConfig", "TPDecoderLayer", "CapturedLayer", "run_layers", "seq_ids_from_lens"]
