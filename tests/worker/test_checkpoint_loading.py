"""Checkpoints loaded as HF writes them (sharded with an index, experts one by one or stacked,
tied heads), and every checkpoint we cannot load exactly refused at startup with the file or the
tensor named: never served with random or missing weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from tests.utils.paged_helpers import PagedSequence, make_kv_caches, paged_step  # noqa: E402
from tests.utils.tiny_models import make_tiny_model  # noqa: E402
from workers.models import build_model  # noqa: E402
from workers.startup.weight_loader import INDEX_FILE, load_weights  # noqa: E402

TOKENS = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(3)).tolist()


def _our_logits(model_dir: str | Path) -> torch.Tensor:
    model = build_model(AutoConfig.from_pretrained(model_dir), torch.float32, "cpu")
    load_weights(model, str(model_dir))
    seq = PagedSequence(TOKENS, blocks=[4, 1, 7])
    paged_step(model, make_kv_caches(model, 8, 16), [(seq, len(TOKENS))], num_decodes=0)
    return torch.stack(seq.logits)


def _hf_logits(model_dir: str | Path) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return hf(torch.tensor([TOKENS])).logits[0]


def _sharded(tmp_path: Path, arch: str) -> Path:
    """A tiny ``arch`` checkpoint saved by transformers in several shards with an index."""
    source = make_tiny_model(tmp_path / "whole", arch)
    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).save_pretrained(
        str(folder), max_shard_size="100KB")
    return folder


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "llama"])
def test_sharded_checkpoint_with_index_equals_hf(tmp_path: Path, arch: str) -> None:
    folder = _sharded(tmp_path, arch)
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 2 and (folder / INDEX_FILE).exists()  # probe: really sharded
    torch.testing.assert_close(_our_logits(folder), _hf_logits(folder), atol=2e-4, rtol=0)


def test_stacked_experts_load_as_per_expert_ones(tmp_path: Path) -> None:
    """transformers' in-memory layout (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
    [E, H, I]), as some tools save it, gives the same model as the per-expert tensors."""
    source = make_tiny_model(tmp_path / "per-expert", "qwen3_moe")
    weights = load_file(str(Path(source) / "model.safetensors"))
    config = AutoConfig.from_pretrained(source)
    stacked = {k: v for k, v in weights.items() if ".experts." not in k}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        expert = [f"{prefix}.{e}" for e in range(config.num_experts)]
        stacked[f"{prefix}.gate_up_proj"] = torch.stack([
            torch.cat([weights[f"{e}.gate_proj.weight"], weights[f"{e}.up_proj.weight"]])
            for e in expert])
        stacked[f"{prefix}.down_proj"] = torch.stack([weights[f"{e}.down_proj.weight"]
                                                      for e in expert])
    folder = tmp_path / "stacked"
    folder.mkdir()
    save_file(stacked, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text((Path(source) / "config.json").read_text())
    assert not any(".experts.0." in k for k in stacked)  # probe: no per-expert tensor left
    torch.testing.assert_close(_our_logits(folder), _our_logits(source), atol=0, rtol=0)


def test_a_missing_expert_is_named(tmp_path: Path) -> None:
    source = make_tiny_model(tmp_path, "mixtral")
    path = Path(source) / "model.safetensors"
    weights = load_file(str(path))
    save_file({k: v for k, v in weights.items()
               if not k.startswith("model.layers.1.block_sparse_moe.experts.5.")}, str(path))
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.experts"
                                         r"\.w13_weight \(experts \[5\]: w1, w3\)"):
        _our_logits(source)


def test_an_expert_beyond_the_config_is_named(tmp_path: Path) -> None:
    source = make_tiny_model(tmp_path, "qwen3_moe")
    path = Path(source) / "model.safetensors"
    weights = load_file(str(path))
    extra = weights["model.layers.0.mlp.experts.0.up_proj.weight"].clone()
    save_file({**weights, "model.layers.0.mlp.experts.8.up_proj.weight": extra}, str(path))
    with pytest.raises(ValueError, match=r"experts\.8\.up_proj\.weight in model\.safetensors: "
                                         r"expert 8 is out of range: the config has 8 experts"):
        _our_logits(source)


def test_a_truncated_shard_is_named(tmp_path: Path) -> None:
    folder = _sharded(tmp_path, "qwen3_moe")
    victim = sorted(folder.glob("*.safetensors"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"checkpoint shard {victim.name} cannot be read"):
        _our_logits(folder)


def test_a_shard_the_index_lists_but_is_not_there_is_named(tmp_path: Path) -> None:
    folder = _sharded(tmp_path, "llama")
    victim = sorted(folder.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=rf"lists shards that are not there: "
                                                rf"{victim.name}"):
        _our_logits(folder)


def test_a_tensor_the_index_lists_but_no_shard_holds_is_named(tmp_path: Path) -> None:
    folder = _sharded(tmp_path, "llama")
    index = json.loads((folder / INDEX_FILE).read_text())
    shard = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = shard
    (folder / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"tensors its index lists are not in their shards: "
                                         r"model\.layers\.0\.mlp\.extra\.weight"):
        _our_logits(folder)


def test_the_engine_refuses_to_start_on_a_broken_checkpoint(tmp_path: Path) -> None:
    """Through the offline LLM (as `sloserve serve FOLDER` starts): a clear error, no engine."""
    from engine import LLM
    from tests.utils.tiny_tokenizer import save_tiny_tokenizer

    source = make_tiny_model(tmp_path, "qwen3_moe")
    save_tiny_tokenizer(tmp_path)
    path = Path(source) / "model.safetensors"
    weights = load_file(str(path))
    save_file({k: v for k, v in weights.items()
               if "layers.2.mlp.experts.3.down_proj" not in k}, str(path))
    with pytest.raises(Exception, match=r"model\.layers\.2\.mlp\.experts\.w2_weight "
                                        r"\(experts \[3\]: w2\)"):
        LLM(model=source, dtype="float32")


def test_an_fp8_tensor_where_the_model_keeps_full_precision_is_named(tmp_path: Path) -> None:
    """An FP8 LM head in a checkpoint whose config quantizes nothing: refused, never cast
    without its scale."""
    source = make_tiny_model(tmp_path, "mixtral")
    path = Path(source) / "model.safetensors"
    weights = load_file(str(path))
    weights["lm_head.weight"] = weights["lm_head.weight"].to(torch.float8_e4m3fn)
    save_file(weights, str(path))
    with pytest.raises(ValueError, match=r"lm_head\.weight in model\.safetensors is "
                                         r"torch\.float8_e4m3fn but this model holds "
                                         r"lm_head\.weight in torch\.float32"):
        _our_logits(source)
