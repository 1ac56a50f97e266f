"""MXFP4 checkpoints for the tests: a quantizer of our own (to nearest e2m1 under a shared
power-of-two scale per 32 values, as gpt-oss's releases are packed), and a float gpt-oss
checkpoint rewritten with its experts in that layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from workers.quantization.mxfp4 import FP4_E2M1_VALUES, GROUP_SIZE, SCALE_BIAS


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [..., rows, G, 16] uint8, scales [..., rows, G] uint8) of ``weight`` [..., rows,
    cols]: each group of 32 columns scaled by the power of two that brings its largest value
    within e2m1's 6, each value rounded to the nearest code."""
    *prefix, cols = weight.shape
    groups = weight.float().reshape(*prefix, cols // GROUP_SIZE, GROUP_SIZE)
    largest = groups.abs().amax(dim=-1).clamp(min=2.0 ** -120)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    values = torch.tensor(FP4_E2M1_VALUES[:8])
    magnitude = (scaled.abs().unsqueeze(-1) - values).abs().argmin(dim=-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)


def write_mxfp4_checkpoint(float_dir: str | Path, out_dir: str | Path) -> dict[str, torch.Tensor]:
    """``float_dir``'s gpt-oss checkpoint with its experts' projections as MXFP4 blocks and
    scales and a ``quant_method: mxfp4`` config, in ``out_dir``. Returns the packed tensors."""
    float_dir, out_dir = Path(float_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(float_dir / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # Stored [E, inputs, outputs]; packed along the inputs, a row per output.
            blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    save_file({**tensors, **packed}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (out_dir / "config.json").write_text(json.dumps(config))
    for extra in float_dir.iterdir():
        if extra.name not in ("model.safetensors", "config.json") and extra.is_file():
            shutil.copy(extra, out_dir / extra.name)
    return packed
