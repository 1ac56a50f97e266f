"""What is not served is refused at startup with the method, scheme, tensor or layer named, never
served with random or missing weights: by EngineCore before any rank starts for a
``quantization_config`` it does not understand, by the weight loader for a checkpoint whose
tensors do not match what its config says."""

from __future__ import annotations

import json
import multiprocessing
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.executor.model_support import check_architecture
from engine.model_folder import load_hf_config
from tests.utils.fp8_checkpoints import quantization_config

ENGINE = dict(dtype="float32", num_kv_blocks=16, max_model_len=64)


def _copy_with(source: str, target: Path, *, quant: dict | None = None,
               drop: str | None = None, retype: str | None = None) -> str:
    """``source`` copied to ``target``: with another quantization_config, without the tensor
    ``drop``, or with the tensor ``retype`` stored in bfloat16."""
    shutil.copytree(source, target)
    if quant is not None:
        config = json.loads((target / "config.json").read_text())
        config["quantization_config"] = quant
        (target / "config.json").write_text(json.dumps(config))
    if drop or retype:
        tensors = load_file(str(target / "model.safetensors"))
        if drop:
            del tensors[drop]
        if retype:
            tensors[retype] = tensors[retype].to(torch.bfloat16)
        save_file(tensors, str(target / "model.safetensors"))
    return str(target)


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "made-up"])
def test_an_unknown_quant_method_is_refused_before_any_rank_starts(fp8_source, tmp_path,
                                                                   method):
    model = _copy_with(fp8_source(), tmp_path / "m", quant={"quant_method": method, "bits": 4})
    with pytest.raises(ValueError, match=rf"quant_method '{method}'"):
        LLM(model=model, tensor_parallel_size=2, **ENGINE)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("weights,match", [
    ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True,
      "dynamic": False}, r"num_bits=4, type='int', strategy='group'"),
    ({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True,
      "dynamic": False}, r"type='int'"),
    ({"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
      "dynamic": False}, r"strategy='group'"),
])
def test_an_unsupported_compressed_tensors_scheme_is_named(fp8_source, tmp_path, weights, match):
    quant = quantization_config("channel")
    quant["config_groups"]["group_0"]["weights"] = weights
    quant["config_groups"]["group_0"].pop("input_activations")
    quant["format"] = "float-quantized"
    model = _copy_with(fp8_source(), tmp_path / "m", quant=quant)
    with pytest.raises(ValueError, match=rf"group_0.*{match}"):
        LLM(model=model, **ENGINE)


def test_a_packed_int4_checkpoint_is_refused_by_its_format(fp8_source, tmp_path):
    quant = quantization_config("channel")
    quant["format"] = "pack-quantized"
    model = _copy_with(fp8_source(), tmp_path / "m", quant=quant)
    with pytest.raises(ValueError, match=r"format 'pack-quantized'"):
        LLM(model=model, **ENGINE)


def test_a_missing_weight_scale_inv_is_named(fp8_checkpoint, tmp_path):
    quantized, _ = fp8_checkpoint("llama", "block")
    name = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    model = _copy_with(quantized, tmp_path / "m", drop=name)
    with pytest.raises(ValueError, match=r"missing weights: "
                                         r"model\.layers\.1\.self_attn\.qkv_proj\."
                                         r"weight_scale_inv \(shards \['k'\]\)"):
        LLM(model=model, **ENGINE)


def test_full_precision_tensors_in_an_fp8_checkpoint_are_named(fp8_checkpoint, tmp_path):
    quantized, _ = fp8_checkpoint("llama", "block")
    name = "model.layers.0.mlp.down_proj.weight"
    model = _copy_with(quantized, tmp_path / "m", retype=name)
    with pytest.raises(ValueError, match=rf"{name}.*expects float8_e4m3fn weights.*bfloat16"):
        LLM(model=model, **ENGINE)


def test_block_weights_split_only_at_block_edges(fp8_source, tmp_path):
    """4 KV heads of 32: k and v are one 128-row block each at TP=1, half a block a rank at
    TP=2, where their block scales cannot be split."""
    from engine.benchmarks.inputs.random_checkpoints import make_random_model
    from tests.utils.fp8_checkpoints import write_fp8_checkpoint

    source = fp8_source()
    folder = tmp_path / "narrow-heads"
    shutil.copytree(source, folder)  # the tokenizer; config and weights are replaced
    vocab = json.loads((Path(source) / "config.json").read_text())["vocab_size"]
    make_random_model(folder, "llama", seed=0, vocab_size=vocab, hidden_size=256,
                      intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=32, num_hidden_layers=1, initializer_range=0.3)
    quantized, _ = write_fp8_checkpoint(folder, tmp_path / "fp8", tmp_path / "ref", "block")
    LLM(model=quantized, **ENGINE).shutdown()  # whole blocks at TP=1
    with pytest.raises(Exception, match=r"model\.layers\.0\.self_attn\.qkv_proj \(part 'k'\): "
                                        r"64 output rows per rank .* 128-wide FP8 blocks"):
        LLM(model=quantized, tensor_parallel_size=2, **ENGINE)
    assert not multiprocessing.active_children()


def test_quantization_flag_must_agree_with_the_checkpoint(fp8_checkpoint):
    quantized, _ = fp8_checkpoint("llama", "channel")
    with pytest.raises(ValueError, match=r"quantization 'fp8' asked for.*'compressed-tensors'"):
        LLM(model=quantized, quantization="fp8", **ENGINE)
    with pytest.raises(ValueError, match=r"quantization must be None or 'fp8'"):
        LLM(model=quantized, quantization="int8", **ENGINE)


def test_fp8_on_a_gpu_without_fp8_is_refused_naming_its_capability(fp8_checkpoint,
                                                                    monkeypatch):
    """EngineCore's startup check on a GPU of compute capability 8.0 (an A100): the GPU is
    faked, the check is the one that runs on a real one."""
    quantized, _ = fp8_checkpoint("llama", "block")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"FP8 support \(compute capability 8\.9 or newer.*"
                                         r"NVIDIA A100 has compute capability 8\.0"):
        check_architecture(load_hf_config(quantized), None, "cuda")
    # An FP8-capable GPU (an L4 is 8.9) passes the same check.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    check_architecture(load_hf_config(quantized), None, "cuda")
