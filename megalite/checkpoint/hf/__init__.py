"""Conversion between Hugging Face checkpoints (safetensors + config.json) and megalite's, both ways.

Families: GPT-2 (:mod:`.gpt2`) and the Llama-style decoders Llama (RoPE scaling included),
Mistral (sliding window), Qwen2/2.5, Qwen3 and the MoE families Mixtral, Qwen2-MoE, Qwen3-MoE
(:mod:`.llama`), and DeepSeek-V3 (:mod:`.deepseek`: multi-latent attention, YaRN, sigmoid routing); RoPE
settings in :mod:`.rope`, MoE blocks in :mod:`megalite.moe.hf`.  :mod:`.files` reads
and writes model directories (lazy sharded safetensors), :mod:`.convert` runs whole conversions.
"""

from megalite.checkpoint.hf.convert import (FAMILIES, TOKENIZER_DIR, convert_hf_to_megalite, convert_megalite_to_hf,
                                            default_prefix, hf_config_to_gpt, hf_family, hf_to_megalite,
                                            megalite_tensor_to_hf, megalite_to_hf)
from megalite.checkpoint.hf.files import (SAFETENSORS, SAFETENSORS_INDEX, parse_size, read_hf_checkpoint,
                                          write_hf_tensors)

__all__ = ["FAMILIES", "SAFETENSORS", "SAFETENSORS_INDEX", "TOKENIZER_DIR", "convert_hf_to_megalite",
           "convert_megalite_to_hf", "default_prefix", "hf_config_to_gpt", "hf_family", "hf_to_megalite",
           "megalite_tensor_to_hf", "megalite_to_hf", "parse_size", "read_hf_checkpoint", "write_hf_tensors"]
