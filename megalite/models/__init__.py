"""Model definitions built from megalite's parallel layers."""

from megalite.models.config import GPTConfig, gpt_flops_per_token
from megalite.models.gpt import GPTModel
from megalite.models.kv_cache import KVCache

__all__ = ["GPTConfig", "GPTModel", "KVCache", "gpt_flops_per_token"]
