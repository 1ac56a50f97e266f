"""Reading a local Hugging Face model folder's configuration.

Below the engine and the workers (tests/project/test_import_layers.py): EngineCore checks the folder
with it before anything starts (engine.runtime.model_setup), and every worker rank reads the
model's shape with it before building its shard (workers.worker).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_hf_config(model_dir: str) -> Any:
    """The folder's transformers ``PretrainedConfig``; a ValueError where it has none."""
    from transformers import AutoConfig

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {model_dir!r} is not a local Hugging Face model folder "
                         f"(no config.json); sloserve never downloads from a model hub")
    config = AutoConfig.from_pretrained(str(path))
    return text_model_config(config)


# Multimodal checkpoints whose text model is served alone (its vision tower is not loaded):
# their config's ``text_config``, named by the wrapper's architecture so that the model registry
# picks the class that reads the checkpoint's weight names.
TEXT_MODEL_OF = ("Gemma3ForConditionalGeneration",)


def text_model_config(config: Any) -> Any:
    """``config``, or for a multimodal checkpoint served as text (``TEXT_MODEL_OF``) its text
    model's config."""
    architectures = list(getattr(config, "architectures", None) or [])
    served = [arch for arch in architectures if arch in TEXT_MODEL_OF]
    text = getattr(config, "text_config", None)
    if not served or text is None:
        return config
    text.architectures = served[:1]
    if getattr(config, "tie_word_embeddings", None) is not None:
        text.tie_word_embeddings = config.tie_word_embeddings
    return text
