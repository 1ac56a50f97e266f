"""Model registry: HF ``architectures`` name -> our implementation, and the model constructor.

Model API used by the model runner:
- ``build_model(hf_config, dtype, device, tp_rank=0, tp_size=1, tp_group=None,
  quantization=None)`` then ``workers.startup.weight_loader.load_weights(model, model_dir)``;
- ``model.forward(input_ids, positions, attn_meta, kv_caches, joins=()) -> hidden_states
  [T, hidden]`` (``joins``: ``LayerJoin`` chunks resuming a suspended pass at their layer);
- ``model.compute_logits(hidden_states[N, hidden]) -> float32 [N, vocab]``;
- ``model.attention_op(...)`` is the one place attention runs in a pass: the boundary
  (``model.attention_boundary(layer, num_tokens)``, which calls ``model.before_attention``, an
  optional ``Callable[[int], None]``, with the layer index: the vote), then ``model.attend``
  (cache write and attention), which a captured piece runs on its own after the boundary;
- ``model.num_layers``, ``model.num_kv_heads`` (this rank's), ``model.head_dim``,
  ``model.vocab_size``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from workers.models.decoder import DecoderForCausalLM, LayerJoin
from workers.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextOfMultimodal
from workers.models.gpt_oss import GptOssForCausalLM
from workers.models.llama import (LlamaForCausalLM, MistralForCausalLM, Phi3ForCausalLM,
                                  Qwen2ForCausalLM, Qwen3ForCausalLM)
from workers.models.mixtral import MixtralForCausalLM
from workers.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from workers.quantization import get_quant_config

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # Its text model alone (engine.model_folder.text_model_config).
    "Gemma3ForConditionalGeneration": Gemma3TextOfMultimodal,
}


def get_model_class(hf_config: Any) -> type[DecoderForCausalLM]:
    """The implementation for the first supported name in ``hf_config.architectures``."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"unsupported model architecture(s) {architectures or '(none listed)'}; "
                     f"supported: {', '.join(MODEL_REGISTRY)}")


def build_model(hf_config: Any, dtype: torch.dtype, device: torch.device | str,
                tp_rank: int = 0, tp_size: int = 1,
                tp_group: dist.ProcessGroup | None = None,
                quantization: str | None = None) -> DecoderForCausalLM:
    """An uninitialized model (weights come from ``load_weights``) for this rank's shard.
    ``quantization``: the ``--quantization`` asked for (None: what the checkpoint says)."""
    model_class = get_model_class(hf_config)
    quant_config = get_quant_config(hf_config, quantization)
    return model_class(hf_config, dtype=dtype, device=device, tp_rank=tp_rank, tp_size=tp_size,
                       tp_group=tp_group, quant_config=quant_config).eval()


__all__ = ["DecoderForCausalLM", "LayerJoin", "MODEL_REGISTRY", "build_model",
           "get_model_class"]
