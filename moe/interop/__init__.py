"""Interoperability with other model formats (transformers' OLMoE)."""

from moe.interop.hf_olmoe import (
    ConversionError,
    check_expressible,
    check_hf_tensors,
    check_tied_lm_head,
    from_hf,
    hf_config,
    hf_setting,
    hf_tensor_shape,
    model_config_from_hf,
    to_hf,
)

__all__ = [
    "ConversionError",
    "check_expressible",
    "check_hf_tensors",
    "check_tied_lm_head",
    "from_hf",
    "hf_config",
    "hf_setting",
    "hf_tensor_shape",
    "model_config_from_hf",
    "to_hf",
]
