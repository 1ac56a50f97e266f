"""Load an HF safetensors checkpoint folder into a model built by ``workers.models``.

HF stores q/k/v and gate/up as separate tensors; our model fuses them, so those names map to a
fused parameter plus a shard id and every parameter's own ``weight_loader`` slices the full
tensor down to this rank's shard.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from workers.layers import default_weight_loader

# HF name fragment -> (our fragment, shard id).
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
_SHARDS_OF = {".qkv_proj.": {"q", "k", "v"}, ".gate_up_proj.": {0, 1}}


def _map_name(hf_name: str) -> tuple[str, str | int | None]:
    for hf_part, (our_part, shard_id) in _STACKED.items():
        if hf_part in hf_name:
            return hf_name.replace(hf_part, our_part), shard_id
    return hf_name, None


def _expected_shards(name: str) -> set[str | int | None]:
    for part, shards in _SHARDS_OF.items():
        if part in name:
            return set(shards)
    return {None}


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Fill every parameter of ``model`` from ``model_dir/*.safetensors``.

    Raises FileNotFoundError without checkpoint files and ValueError for weights the model does
    not have, missing weights, or shape mismatches.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters())
    tied = bool(getattr(model, "tie_word_embeddings", False))
    loaded: dict[str, set[str | int | None]] = {name: set() for name in params}
    unexpected: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():
                if hf_name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from the config
                if tied and hf_name == "lm_head.weight":
                    continue  # the head shares the embedding's weight
                name, shard_id = _map_name(hf_name)
                param = params.get(name)
                if param is None:
                    unexpected.append(hf_name)
                    continue
                loader = getattr(param, "weight_loader", default_weight_loader)
                with torch.no_grad():
                    try:
                        loader(param, f.get_tensor(hf_name), shard_id)
                    except ValueError as e:
                        raise ValueError(f"{hf_name} in {path.name}: {e}") from None
                loaded[name].add(shard_id)
    if unexpected:
        raise ValueError(f"checkpoint in {model_dir} has weights this model does not: "
                         f"{_summary(unexpected)}")
    missing = [f"{name} (shards {sorted(map(str, _expected_shards(name) - got))})"
               if _expected_shards(name) != {None} else name
               for name, got in loaded.items() if not _expected_shards(name) <= got]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} is missing weights: {_summary(missing)}")


# vLLM's --load-format dummy: weights drawn from U(-1e-3, 1e-3), on the model's own device.
DUMMY_WEIGHT_RANGE = 1e-3


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights in place of a checkpoint (``load_format="dummy"``): for benchmarks of a
    model's shape without its files. Drawn on the parameters' device, seeded; each TP rank
    draws its own shard (so outputs are not comparable across TP sizes)."""
    for index, param in enumerate(model.parameters()):
        generator = torch.Generator(param.device).manual_seed(seed * 1_000_003 + index)
        with torch.no_grad():
            param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)


def _summary(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")
