"""Tiny random-weight models in HF format, built with transformers' own classes.

Random tiny models have near-uniform logits, which makes greedy argmax flip under harmless
float32 summation-order changes. The weights are therefore initialized with a large std
(``initializer_range``) so each position's top-1 logit leads the runner-up by a clear margin.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

# arch -> (config class name, model class name, tie_word_embeddings, extra config)
_ARCHS: dict[str, tuple[str, str, bool, dict[str, Any]]] = {
    # Tied like SmolLM2 (the default model); Llama's config default is untied.
    "llama": ("LlamaConfig", "LlamaForCausalLM", True, {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", False, {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", True, {}),
    # Explicit head_dim larger than hidden / heads, as real Qwen3 checkpoints have.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", True, {"head_dim": 32}),
}

TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.3,
)


def make_tiny_config(arch: str = "llama", **config_overrides: Any) -> Any:
    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {', '.join(_ARCHS)}")
    config_name, _, tie, extra = _ARCHS[arch]
    kwargs = {**TINY_DEFAULTS, "tie_word_embeddings": tie, **extra, **config_overrides}
    return getattr(transformers, config_name)(**kwargs)


def make_tiny_model(path: str | os.PathLike[str], arch: str = "llama", seed: int = 0,
                    **config_overrides: Any) -> str:
    """Save a seeded tiny random ``arch`` model (config.json + model.safetensors) to ``path``
    and return the path. Keyword arguments override config fields."""
    config = make_tiny_config(arch, **config_overrides)
    model_class = getattr(transformers, _ARCHS[arch][1])
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)  # init uses config.initializer_range
    with torch.no_grad():
        # Norm weights init to 1 and biases to 0; jitter them so a loader that skipped them
        # (or mixed up which is which) shows up as a logit mismatch.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return str(path)
