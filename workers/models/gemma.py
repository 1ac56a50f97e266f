"""Gemma 2 and Gemma 3 (text): the shared decoder with Gemma's norms, activation and scales.

What differs from Llama, each as HF's ``modeling_gemma2`` / ``modeling_gemma3`` compute it:

- RMSNorm scales by ``1 + weight`` (the checkpoint stores the offset from one), in float32, and
  casts after the product (``GemmaRMSNorm``); q and k are normed per head as Qwen3's are.
- Each layer norms the attention output before adding it to the residual stream, and norms the
  MLP's input and its output (``pre_feedforward_layernorm``, ``post_feedforward_layernorm``).
- The MLP is GeGLU with the tanh GELU (``hidden_activation: gelu_pytorch_tanh``).
- Token embeddings are scaled by sqrt(hidden_size), rounded to the model dtype.
- Attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, not head_dim's.
- Gemma 3: q and k normed per head; five sliding layers per global one (``layer_types``), the
  sliding ones rotating with a local base (``rope_parameters["sliding_attention"]``) and the
  global ones with theirs (scaled linearly in the larger models).
- Gemma 2: every other layer sliding, one rotary base, and tanh soft-caps on the attention
  scores (``attn_logit_softcapping``, in the attention kernels) and on the final logits.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from workers.layers import RMSNorm
from workers.models.decoder import DecoderForCausalLM, DecoderLayer


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in float32, then cast to x's
    dtype. The weight is held as ``1 + w`` in float32 (added at load, exactly as HF's
    ``1.0 + weight.float()``), so the fused kernels, which multiply by the weight they are
    given, compute the same in a float32 model."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__(hidden_size, eps, dtype=torch.float32, device=device)
        self.weight.weight_loader = _load_offset_from_one  # type: ignore[attr-defined]
        self.model_dtype = dtype

    def fused_kernel(self, kernels: Any) -> Any:
        # Gemma's order where the backend has it (Triton's); the plain kernels scale after the
        # cast (Llama's order), which is the same only in a float32 model.
        if kernels.rms_norm_float32_scale is not None:
            return kernels.rms_norm_float32_scale
        return kernels.rms_norm if self.model_dtype == torch.float32 else None

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return (x32 * torch.rsqrt(variance + self.eps) * self.weight).to(x.dtype)


def _load_offset_from_one(param: torch.Tensor, loaded_weight: torch.Tensor,
                          shard_id: Any = None) -> None:
    if shard_id is not None:
        raise ValueError(f"unexpected shard_id {shard_id!r} for a Gemma RMSNorm weight")
    if loaded_weight.shape != param.shape:
        raise ValueError(f"weight shape mismatch: expected {tuple(param.shape)}, checkpoint has "
                         f"{tuple(loaded_weight.shape)}")
    param.copy_(1.0 + loaded_weight.to(torch.float32))


class GemmaDecoderLayer(DecoderLayer):
    """Norms on both sides of attention and of the MLP (Gemma 2 and 3):
    ``r += post_attn_norm(attn(input_norm(r)))``, then
    ``r += post_ff_norm(mlp(pre_ff_norm(r)))``, in the residual-carrying form of the shared
    layer (the add before each pre-norm is fused into it)."""

    def __init__(self, config: Any, par: Any, prefix: str, mlp: torch.nn.Module, *,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__(config, par, prefix, mlp, qkv_bias=qkv_bias, o_bias=o_bias,
                         qk_norm=qk_norm)
        eps = config.rms_norm_eps
        self.pre_feedforward_layernorm = par.norm(config.hidden_size, eps, dtype=par.dtype,
                                                  device=par.device)
        self.post_feedforward_layernorm = par.norm(config.hidden_size, eps, dtype=par.dtype,
                                                   device=par.device)

    def after_attention(self, attention_out: torch.Tensor, residual: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = self.self_attn.project_out(attention_out)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class Gemma2ForCausalLM(DecoderForCausalLM):
    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    @staticmethod
    def attention_scale(config: Any, head_dim: int) -> float:
        return config.query_pre_attn_scalar ** -0.5

    @staticmethod
    def embedding_scale(config: Any) -> float | None:
        return config.hidden_size ** 0.5


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True


class Gemma3TextOfMultimodal(Gemma3ForCausalLM):
    """The text model of a multimodal Gemma 3 checkpoint (``Gemma3ForConditionalGeneration``:
    gemma-3-4b/12b/27b-it), served alone. Its config is the checkpoint's ``text_config``
    (``engine.model_folder.text_model_config``); its weights sit under ``language_model.``
    (``model.language_model.`` as transformers 5 writes them), and the vision tower and its
    projector are not loaded: images are not served."""

    checkpoint_renames: ClassVar[dict[str, str]] = {
        "language_model.model.": "model.", "model.language_model.": "model.",
        "language_model.lm_head.": "lm_head."}
    checkpoint_ignores: ClassVar[tuple[str, ...]] = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                          "model.multi_modal_projector.")
