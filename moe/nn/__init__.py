"""Dense transformer building blocks; the MoE layer lives in moe.layers, the model in moe.model."""

from moe.nn.attention import Attention
from moe.nn.mlp import SwiGLU
from moe.nn.norm import RMSNorm
from moe.nn.rope import RotaryEmbedding

__all__ = ["Attention", "RMSNorm", "RotaryEmbedding", "SwiGLU"]
