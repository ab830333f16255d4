"""Real checkpoints: Hugging Face DeepSeek-V3.2 / GLM-5 directories (config.json, FP8 block
scales, sharded safetensors) and the DeepSeek reference names (`fo_jax.weights`)."""

from fo_jax.checkpoints.hf import (WEIGHTS, dequantize_fp8, inspect_checkpoint, load_checkpoint,
                                   save_checkpoint, to_hf_config)
from fo_jax.checkpoints.hf_config import (config_from_hf, hf_quantization, hf_scale_fmt,
                                          read_hf_config)
from fo_jax.checkpoints.names import FORMATS, Slot, tensor_names

__all__ = [
    "FORMATS",
    "Slot",
    "WEIGHTS",
    "config_from_hf",
    "dequantize_fp8",
    "hf_quantization",
    "hf_scale_fmt",
    "inspect_checkpoint",
    "load_checkpoint",
    "read_hf_config",
    "save_checkpoint",
    "tensor_names",
    "to_hf_config",
]
