"""The dense Llama family: Llama, Mistral, Qwen2 and Qwen3.

They differ only in where biases sit and in Qwen3's per-head q/k RMSNorm: class switches on the
shared decoder (``workers.models.decoder``).
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
