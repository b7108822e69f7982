"""Transformer building blocks (dense parts); the MoE layer lives in moe.layers."""

from moe.nn.attention import Attention
from moe.nn.mlp import SwiGLU
from moe.nn.norm import RMSNorm
from moe.nn.rope import RotaryEmbedding
from moe.nn.transformer import Block, Transformer

__all__ = ["Attention", "Block", "RMSNorm", "RotaryEmbedding", "SwiGLU", "Transformer"]
