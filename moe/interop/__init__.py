"""Interoperability with other model formats (transformers' OLMoE)."""

from moe.interop.hf_olmoe import ConversionError, check_expressible, from_hf, hf_config, model_config_from_hf, to_hf

__all__ = ["ConversionError", "check_expressible", "from_hf", "hf_config", "model_config_from_hf", "to_hf"]
