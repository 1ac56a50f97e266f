"""Load an HF safetensors checkpoint folder into a model built by ``workers.models``.

HF stores q/k/v and gate/up as separate tensors, and a mixture's experts one by one
(``mlp.experts.3.gate_proj.weight``; transformers' in-memory layout stacks them as
``mlp.experts.gate_up_proj``); our model fuses them, so those names map to a fused parameter
plus a shard id, and every parameter's own ``weight_loader`` slices the full tensor down to this
rank's shard. A sharded checkpoint's index (``model.safetensors.index.json``) is checked against
the files: a shard missing, truncated or without the tensors the index lists is named.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from workers.layers import default_weight_loader
from workers.layers.moe import PROJECTIONS
from workers.quantization import FP8_DTYPE, FP8_MAX, is_scale_name

INDEX_FILE = "model.safetensors.index.json"
# An FP8 tensor cast into a full-precision parameter would lose its scale: refused, for every
# parameter (linear, embedding, head), in this one place.
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
               torch.float8_e5m2fnuz)
ShardId = Any  # None, "q"/"k"/"v", 0/1, or an expert shard (expert, "w1"/"w3"/"w2")

# HF name fragment -> (our fragment, shard id).
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
_SHARDS_OF = {".qkv_proj.": {"q", "k", "v"}, ".gate_up_proj.": {0, 1}}


# One expert's projection: ``<prefix>.experts.<e>.<proj>.<tensor>`` (weight, or a quantized
# layout's weight_scale_inv, weight_scale, input_scale).
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\."
                     rf"(?P<proj>{'|'.join(PROJECTIONS)})\.(?P<tensor>\w+)$")
# Every expert at once, as transformers keeps them in memory: gate_up_proj [E, 2I, H] and
# down_proj [E, H, I].
_STACKED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def _map_name(hf_name: str, renames: dict[str, str] | None = None) -> tuple[str, ShardId]:
    for hf_part, our_part in (renames or {}).items():
        hf_name = hf_name.replace(hf_part, our_part)
    expert = _EXPERT.match(hf_name)
    if expert:
        part = PROJECTIONS[expert["proj"]]
        stacked = "w2" if part == "w2" else "w13"
        return (f"{expert['prefix']}.{stacked}_{expert['tensor']}",
                (int(expert["expert"]), part))
    stacked_experts = _STACKED_EXPERTS.match(hf_name)
    if stacked_experts:
        part = "w13" if stacked_experts["proj"] == "gate_up_proj" else "w2"
        return f"{stacked_experts['prefix']}.{part}_weight", (None, part)
    for hf_part, (our_part, shard_id) in _STACKED.items():
        if hf_part in hf_name:
            return hf_name.replace(hf_part, our_part), shard_id
    return hf_name, None


def _expected_shards(name: str, param: torch.Tensor) -> set[ShardId]:
    declared = getattr(param, "expected_shards", None)
    if declared is not None:
        return set(declared)
    for part, shards in _SHARDS_OF.items():
        if part in name:
            return set(shards)
    return {None}


def _loaded_shards(param: torch.Tensor, shard_id: ShardId) -> set[ShardId]:
    """The shards one checkpoint tensor fills: a stacked experts tensor fills every expert's."""
    if isinstance(shard_id, tuple) and shard_id[0] is None:
        parts = ("w1", "w3") if shard_id[1] == "w13" else ("w2",)
        declared = getattr(param, "expected_shards", set())
        return {shard for shard in declared if shard[1] in parts}
    return {shard_id}


def _describe_missing(name: str, missing: set[ShardId]) -> str:
    if all(isinstance(shard, tuple) for shard in missing):
        experts = sorted({shard[0] for shard in missing})
        parts = sorted({shard[1] for shard in missing})
        return f"{name} (experts {experts}: {', '.join(parts)})"
    return f"{name} (shards {sorted(map(str, missing))})"


def checkpoint_files(model_dir: str) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read and the index's tensor -> shard map: the files the index
    lists (each checked to exist), or every ``*.safetensors`` file in a folder without an index
    (and no map)."""
    folder = Path(model_dir)
    index = folder / INDEX_FILE
    if not index.exists():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
        return files, None
    try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a "
                         f"'weight_map'): {e}") from None
    names = sorted(set(weight_map.values()))
    absent = [name for name in names if not (folder / name).exists()]
    if absent:
        raise FileNotFoundError(f"{INDEX_FILE} in {model_dir} lists shards that are not there: "
                                f"{_summary(absent)}")
    return [folder / name for name in names], weight_map


def _tensors(path: Path) -> Iterator[tuple[str, Any]]:
    """(name, open file) for every tensor of one shard; a truncated or corrupt shard is a
    ValueError naming it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            for name in names:
                yield name, f
    except SafetensorError as e:
        raise ValueError(f"checkpoint shard {path.name} cannot be read (truncated or not a "
                         f"safetensors file?): {e}") from None


def load_weights(model: nn.Module, model_dir: str) -> None:
    """Fill every parameter of ``model`` from ``model_dir/*.safetensors``.

    Raises FileNotFoundError without checkpoint files and ValueError for weights the model does
    not have, missing weights, or shape mismatches.
    """
    files, indexed = checkpoint_files(model_dir)
    params = dict(model.named_parameters())
    tied = bool(getattr(model, "tie_word_embeddings", False))
    renames = getattr(model, "checkpoint_renames", None)
    # Tensors of parts the model does not serve (a multimodal checkpoint's vision tower).
    ignored = tuple(getattr(model, "checkpoint_ignores", ()))
    loaded: dict[str, set[ShardId]] = {name: set() for name in params}
    unexpected: list[str] = []
    seen: set[str] = set()
    for path in files:
        for hf_name, f in _tensors(path):
            seen.add(hf_name)
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            if ignored and hf_name.startswith(ignored):
                continue
            name, shard_id = _map_name(hf_name, renames)
            if tied and name == "lm_head.weight":
                continue  # the head shares the embedding's weight
            param = params.get(name)
            if param is None:
                unexpected.append(hf_name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            tensor = f.get_tensor(hf_name)
            if tensor.dtype in _FP8_DTYPES and param.dtype not in _FP8_DTYPES:
                # Cast without its scale it would be a different weight, silently.
                raise ValueError(f"{hf_name} in {path.name} is {tensor.dtype} but this model "
                                 f"holds {name} in {param.dtype}: the checkpoint's "
                                 f"quantization_config does not cover it")
            with torch.no_grad():
                try:
                    loader(param, tensor, shard_id)
                except ValueError as e:
                    raise ValueError(f"{hf_name} in {path.name}: {e}") from None
            # A tensor without a shard id fills the whole parameter (a fused qkv_proj too).
            loaded[name] |= (_loaded_shards(param, shard_id) if shard_id is not None
                             else _expected_shards(name, param))
    if indexed is not None:
        absent = sorted(set(indexed) - seen)
        if absent:
            raise ValueError(f"checkpoint in {model_dir}: tensors its index lists are not in "
                             f"their shards: {_summary(absent)}")
    if unexpected:
        raise ValueError(f"checkpoint in {model_dir} has weights this model does not: "
                         f"{_summary(unexpected)}")
    missing = []
    for name, got in loaded.items():
        expected = _expected_shards(name, params[name])
        if not expected <= got:
            missing.append(name if expected == {None} else _describe_missing(name, expected - got))
    if missing:
        raise ValueError(f"checkpoint in {model_dir} is missing weights: {_summary(missing)}")
    process_weights_after_loading(model)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each quantized layer turn what it loaded into what it multiplies by (requantize
    fused scales, transpose for a kernel, quantize a full-precision weight at load)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


# vLLM's --load-format dummy: weights drawn from U(-1e-3, 1e-3), on the model's own device.
DUMMY_WEIGHT_RANGE = 1e-3


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights in place of a checkpoint (``load_format="dummy"``): for benchmarks of a
    model's shape without its files. Drawn on the parameters' device, seeded, float32 ones
    rounded to bfloat16 values as a widened bf16 checkpoint's are; each TP rank
    draws its own shard (so outputs are not comparable across TP sizes). FP8 weights get codes
    spread over the format's range and scales that bring them back to the same range, so a
    quantized model computes on numbers like the plain one's."""
    for index, (name, param) in enumerate(model.named_parameters()):
        generator = torch.Generator(param.device).manual_seed(seed * 1_000_003 + index)
        with torch.no_grad():
            _fill_dummy(name, param.data, generator)
    for name, buffer in model.named_buffers():
        if is_scale_name(name):  # a scale computed at load (--quantization fp8)
            _fill_dummy(name, buffer, None)
    process_weights_after_loading(model)


def _fill_dummy(name: str, tensor: torch.Tensor, generator: torch.Generator | None) -> None:
    if tensor.dtype == FP8_DTYPE:
        wide = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)
        tensor.copy_(wide.uniform_(-FP8_MAX, FP8_MAX, generator=generator))
    elif is_scale_name(name):
        # Weight scales map FP8_MAX onto the dummy range; an activation scale lets activations
        # up to FP8_MAX through unclipped.
        tensor.fill_(1.0 if name.endswith("input_scale") else DUMMY_WEIGHT_RANGE / FP8_MAX)
    else:
        tensor.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)
        if tensor.dtype == torch.float32:
            # bfloat16 values, as a float32 model holds a bf16 checkpoint's weights (the form
            # the weights' memory traffic depends on: workers.layers.cpu_bf16_weights).
            tensor.copy_(tensor.bfloat16())


def _summary(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")
