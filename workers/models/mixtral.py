"""Mixtral: Mistral's attention, and in every layer eight experts of which each token takes two,
their softmax weights renormalised over the two and kept in float32 (as HF's Mixtral)."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from workers.models.decoder import DecoderForCausalLM, ParallelContext
from workers.models.moe_block import SparseMoeBlock


class MixtralForCausalLM(DecoderForCausalLM):
    # HF names the layer's experts block ``block_sparse_moe``; ours is ``mlp`` in every family.
    checkpoint_renames: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp."}

    def make_mlp(self, config: Any, par: ParallelContext, layer_idx: int,
                 prefix: str) -> nn.Module:
        return SparseMoeBlock(config, par, prefix, num_experts=config.num_local_experts,
                              intermediate_size=config.intermediate_size, renormalize=True,
                              round_weights=False)

    reads_layer_types = False  # HF's Mistral slides every layer when the config has a window
