"""Reading ``quantization_config``: which layers get which FP8 scheme, and the refusals that name
what is not served (workers.quantization.config, .compressed_tensors, .fp8_config). No model is
built."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from tests.utils.fp8_checkpoints import quantization_config
from workers.quantization import get_quant_config

QKV = "model.layers.0.self_attn.qkv_proj"
GATE_UP = "model.layers.3.mlp.gate_up_proj"
DOWN = "model.layers.3.mlp.down_proj"


def _config(quant: dict | None) -> SimpleNamespace:
    return SimpleNamespace(quantization_config=quant)


def _scheme(quant: dict | None, prefix: str, quantization: str | None = None):
    method = get_quant_config(_config(quant), quantization).linear_method(prefix)
    return None if method is None else method.scheme


def test_plain_checkpoints_have_no_quantization():
    assert get_quant_config(_config(None)) is None


def test_block_layout():
    scheme = _scheme(quantization_config("block"), QKV)
    assert (scheme.weight_strategy, scheme.scale_name, scheme.activations, scheme.block) == \
        ("block", "weight_scale_inv", "dynamic", (128, 128))


def test_per_tensor_fp8_checkpoints_with_static_activations():
    scheme = _scheme({"quant_method": "fp8", "activation_scheme": "static"}, DOWN)
    assert (scheme.weight_strategy, scheme.scale_name, scheme.activations) == \
        ("tensor", "weight_scale", "static")


def test_compressed_tensors_layouts():
    channel = _scheme(quantization_config("channel"), GATE_UP)
    assert (channel.weight_strategy, channel.activations) == ("channel", "dynamic")
    tensor = _scheme(quantization_config("tensor"), GATE_UP)
    assert (tensor.weight_strategy, tensor.activations) == ("tensor", "static")
    weight_only = quantization_config("channel")
    weight_only["config_groups"]["group_0"]["input_activations"] = None
    assert _scheme(weight_only, DOWN).activations == "none"
    block = quantization_config("channel")
    group = block["config_groups"]["group_0"]
    group["weights"].update(strategy="block", block_structure=[128, 128])
    group["input_activations"].update(strategy="group", group_size=128)
    assert _scheme(block, DOWN).weight_strategy == "block"


def test_online_quantization_is_per_channel_and_quantized_at_load():
    scheme = _scheme(None, QKV, quantization="fp8")
    assert (scheme.weight_strategy, scheme.activations, scheme.online) == \
        ("channel", "dynamic", True)
    # An FP8 checkpoint asked to be fp8 is served as it is.
    assert _scheme(quantization_config("block"), QKV, "fp8").weight_strategy == "block"


def test_ignored_modules_keep_model_dtype_weights():
    quant = quantization_config("block")
    quant["modules_to_not_convert"] = ["lm_head", "model.layers.3.mlp.down_proj"]
    assert _scheme(quant, DOWN) is None
    assert _scheme(quant, GATE_UP) is not None
    ct = quantization_config("channel")
    ct["ignore"] = ["lm_head", "re:.*layers\\.3\\.mlp\\..*"]
    assert _scheme(ct, DOWN) is None and _scheme(ct, GATE_UP) is None
    assert _scheme(ct, QKV) is not None
    targeted = quantization_config("channel")
    targeted["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    assert _scheme(targeted, QKV) is not None and _scheme(targeted, DOWN) is None


def test_a_fused_layer_whose_parts_disagree_is_refused():
    quant = quantization_config("block")
    quant["ignored_layers"] = ["model.layers.0.self_attn.k_proj"]
    with pytest.raises(ValueError, match=r"fused layer model\.layers\.0\.self_attn\.qkv_proj.*"
                                         r"k_proj: not quantized"):
        _scheme(quant, QKV)


@pytest.mark.parametrize("change,match", [
    ({"fmt": "e5m2"}, r"fmt 'e5m2'"),
    ({"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({"activation_scheme": "static"}, r"needs activation_scheme 'dynamic'"),
    ({"quant_method": "awq"}, r"quant_method 'awq' \(a method this engine does not implement\)"),
    ({"quant_method": "mxfp9"}, r"unsupported quantization_config quant_method 'mxfp9'"),
])
def test_fp8_refusals(change, match):
    with pytest.raises(ValueError, match=match):
        get_quant_config(_config({**quantization_config("block"), **change}))


@pytest.mark.parametrize("path,value,match", [
    (("kv_cache_scheme",), {"num_bits": 8, "type": "float"}, r"kv_cache_scheme \(an FP8 KV"),
    (("sparsity_config",), {"format": "sparse-24"}, r"sparsity_config"),
    (("config_groups", "group_0", "weights", "num_bits"), 4, r"num_bits=4"),
    (("config_groups", "group_0", "weights", "symmetric"), False, r"symmetric=False"),
    (("config_groups", "group_0", "input_activations", "type"), "int",
     r"input activations .*type='int'"),
    (("config_groups", "group_0", "output_activations"), {"num_bits": 8},
     r"output activations"),
])
def test_compressed_tensors_refusals(path, value, match):
    quant = copy.deepcopy(quantization_config("channel"))
    node = quant
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ValueError, match=match):
        get_quant_config(_config(quant))


def test_unknown_quantization_flag():
    with pytest.raises(ValueError, match=r"quantization 'awq' is not supported; choose one of fp8"):
        get_quant_config(_config(None), "awq")
