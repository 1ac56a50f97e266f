"""Model building blocks: norms, rotary embedding, the SwiGLU activation, tensor-parallel linears
and vocab layers."""

from workers.layers.activation import silu_and_mul
from workers.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                   QKVParallelLinear, RowParallelLinear, default_weight_loader)
from workers.layers.norm import RMSNorm
from workers.layers.rotary import (RotaryEmbedding, apply_rotary, get_rotary_embedding,
                                   rope_parameters)
from workers.layers.vocab import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "ColumnParallelLinear", "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear",
    "RMSNorm", "RotaryEmbedding", "RowParallelLinear", "VocabParallelEmbedding", "apply_rotary",
    "default_weight_loader", "get_rotary_embedding", "rope_parameters", "silu_and_mul",
]
