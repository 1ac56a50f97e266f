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
    return AutoConfig.from_pretrained(str(path))
