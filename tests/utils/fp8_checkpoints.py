"""FP8 checkpoints written by the tests: a tiny float32 model's linear weights quantized into each
layout users download, and the dequantized float32 checkpoint HF transformers runs as the
reference.

The quantization and dequantization here are the tests' own (written from the layouts'
definitions, not imported from the engine), so an engine that dequantized differently would not
agree with them by construction:

- ``block``: ``"quant_method": "fp8"``, ``weight_block_size`` [128, 128], float8_e4m3fn
  ``weight`` and float32 ``weight_scale_inv`` [ceil(N/128), ceil(K/128)] with
  w = fp8 * weight_scale_inv per block (Qwen3-FP8, DeepSeek-V3);
- ``channel``: compressed-tensors, ``weight_scale`` [N, 1], dynamic per-token activations;
- ``tensor``: compressed-tensors, ``weight_scale`` [1] per tensor and a static ``input_scale``.

The reference dequantizes each element as one float32 product ``fp8.float() * scale``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
# The checkpoint's linear layers that FP8 checkpoints quantize (never the head or embeddings).
LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
LAYOUTS = ("block", "channel", "tensor")


def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    nb_r, nb_c = -(-rows // BLOCK), -(-cols // BLOCK)
    scale = torch.empty(nb_r, nb_c)
    q = torch.empty(rows, cols, dtype=FP8)
    for i in range(nb_r):
        for j in range(nb_c):
            tile = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = _to_fp8(tile / scale[i, j])
    return q, scale


def dequantize_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    out = torch.empty(rows, cols)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rs, cs = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rs, cs] = q[rs, cs].float() * scale[i, j]
    return out


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per output row: the row's amax onto 448 (also ``--quantization fp8``'s)."""
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return _to_fp8(w / scale[:, None]), scale


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().max().clamp(min=1e-12) / FP8_MAX
    return _to_fp8(w / scale), scale.reshape(1)


def quantization_config(layout: str) -> dict:
    if layout == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}
    strategy = {"channel": "channel", "tensor": "tensor"}[layout]
    dynamic = layout == "channel"
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                        "symmetric": True, "dynamic": False, "group_size": None},
            "input_activations": {"num_bits": 8, "type": "float",
                                  "strategy": "token" if dynamic else "tensor",
                                  "symmetric": True, "dynamic": dynamic}}}}


def write_fp8_checkpoint(source: str | Path, quantized: str | Path, reference: str | Path,
                         layout: str) -> tuple[str, str]:
    """Quantize ``source``'s (a float32 HF folder) linear weights into ``layout``; write the FP8
    checkpoint to ``quantized`` and its float32 dequantization to ``reference`` (each a complete
    model folder with the source's tokenizer). Returns both paths."""
    source, quantized, reference = Path(source), Path(quantized), Path(reference)
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    fp8_tensors: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not LINEAR.search(name):
            fp8_tensors[name] = dequantized[name] = w
            continue
        stem = name.removesuffix(".weight")
        w = w.float()
        if layout == "block":
            q, scale = quantize_block(w)
            fp8_tensors[f"{stem}.weight_scale_inv"] = scale
            dequantized[name] = dequantize_block(q, scale)
        elif layout == "channel":
            q, scale = quantize_rows(w)
            fp8_tensors[f"{stem}.weight_scale"] = scale[:, None].contiguous()
            dequantized[name] = q.float() * scale[:, None]
        else:
            q, scale = quantize_tensor(w)
            fp8_tensors[f"{stem}.weight_scale"] = scale
            fp8_tensors[f"{stem}.input_scale"] = torch.tensor([0.05])
            dequantized[name] = q.float() * scale
        fp8_tensors[name] = q
    for folder, weights, quant in ((quantized, fp8_tensors, quantization_config(layout)),
                                   (reference, dequantized, None)):
        _copy_folder(source, folder)
        save_file(weights, str(folder / "model.safetensors"))
        config = json.loads((folder / "config.json").read_text())
        config.pop("quantization_config", None)
        if quant is not None:
            config["quantization_config"] = quant
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(quantized), str(reference)


def write_online_reference(source: str | Path, reference: str | Path) -> str:
    """``source`` with each linear weight quantized per output row and dequantized again, as
    ``--quantization fp8`` holds it: the float32 checkpoint HF runs to check that flag."""
    source, reference = Path(source), Path(reference)
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    for name, w in tensors.items():
        if LINEAR.search(name):
            q, scale = quantize_rows(w.float())
            tensors[name] = q.float() * scale[:, None]
    _copy_folder(source, reference)
    save_file(tensors, str(reference / "model.safetensors"))
    return str(reference)


def _copy_folder(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy(path, target / path.name)
