"""The dense Llama family: Llama, Mistral, Qwen2, Qwen3 and Phi-3.

They differ only in where biases sit, in Qwen3's per-head q/k RMSNorm and in which layers slide:
class switches on the shared decoder (``workers.models.decoder``). Phi-3's checkpoints store
q/k/v and gate/up fused (``qkv_proj``, ``gate_up_proj``: the merged layers split them at load)
and Phi-4-mini rotates part of each head (``partial_rotary_factor``).
"""

from __future__ import annotations

from workers.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass


class MistralForCausalLM(DecoderForCausalLM):
    reads_layer_types = False  # HF's Mistral slides every layer when the config has a window


class Qwen2ForCausalLM(DecoderForCausalLM):
    qkv_bias_always = True


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True


class Phi3ForCausalLM(DecoderForCausalLM):
    reads_layer_types = False  # HF's Phi-3 slides every layer when the config has a window
