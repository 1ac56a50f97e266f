"""Tiny random-weight models in HF format (engine/benchmarks/inputs/random_checkpoints.py builds them),
with the
test suite's default shape.

The large ``initializer_range`` gives each position's top-1 logit a clear lead over the
runner-up, so greedy argmax does not flip under float32 summation-order changes.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine.benchmarks.inputs.random_checkpoints import make_config, make_random_model  # noqa: E402

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
    return make_config(arch, **{**TINY_DEFAULTS, **config_overrides})


def make_tiny_model(path: str | os.PathLike[str], arch: str = "llama", seed: int = 0,
                    **config_overrides: Any) -> str:
    """Save a seeded tiny random ``arch`` model (config.json + model.safetensors) to ``path``
    and return the path. Keyword arguments override config fields."""
    return make_random_model(path, arch, seed, **{**TINY_DEFAULTS, **config_overrides})


def make_bf16_valued_model(path: str | os.PathLike[str], arch: str = "llama", seed: int = 0,
                           **config_overrides: Any) -> str:
    """``make_tiny_model`` whose every weight is a bfloat16 value stored in float32, as a bf16
    checkpoint is once widened at load: the weights that get CPU bfloat16 copies
    (workers.layers.cpu_bf16_weights)."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_model(path, arch, seed, **config_overrides)
    weights = Path(model_dir) / "model.safetensors"
    tensors = {k: v.bfloat16().float() for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return model_dir


def load_tiny_model(model_dir: str, dtype: Any = None) -> Any:
    """Our model for a saved checkpoint folder, its weights loaded, on the CPU (float32 unless
    ``dtype``)."""
    import torch

    from engine.model_folder import load_hf_config
    from workers.models import build_model
    from workers.startup.weight_loader import load_weights

    model = build_model(load_hf_config(model_dir), dtype or torch.float32, torch.device("cpu"))
    load_weights(model, model_dir)
    return model
