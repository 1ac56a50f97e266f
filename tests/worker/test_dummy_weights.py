"""`--load-format dummy`: a model's shape from its config.json alone
(engine/benchmarks/inputs/model_shapes.py),
weights drawn where the model lives, so that real-shape benchmarks need no checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from engine.benchmarks.inputs.model_shapes import SHAPES, main, write_shape
from engine.core.long_rope import long_rope_threshold
from engine.entrypoints.llm import LLM
from engine.sampling_params import SamplingParams

# The config class transformers reads each shape's folder as.
CONFIG_CLASSES = {"llama-3.2-1b": "LlamaConfig", "llama-3.1-8b": "LlamaConfig",
                  "qwen2.5-7b": "Qwen2Config", "qwen3-30b-a3b": "Qwen3MoeConfig",
                  "mixtral-8x7b": "MixtralConfig", "llama-3.1-8b-fp8": "LlamaConfig",
                  "gemma-3-12b": "Gemma3TextConfig", "phi-4-mini": "Phi3Config",
                  "gpt-oss-20b": "GptOssConfig"}
# Fields newer transformers keep elsewhere (rope_parameters, dtype, Gemma's layer pattern):
# checked on their own.
_MOVED = {"rope_theta", "rope_scaling", "torch_dtype", "rope_parameters",
          "sliding_window_pattern"}


def test_real_shapes_are_written_with_a_tokenizer(tiny_model, tmp_path):
    assert set(SHAPES) == set(CONFIG_CLASSES)
    for name in SHAPES:
        folder = write_shape(name, tmp_path / name, tiny_model("llama"))
        config = AutoConfig.from_pretrained(str(folder))
        assert type(config).__name__ == CONFIG_CLASSES[name], name
        shape = SHAPES[name]
        for field, value in shape.items():
            if field not in _MOVED:
                assert getattr(config, field) == value, (name, field)
        rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
        if "rope_parameters" in shape:  # per layer type (Gemma 3)
            assert rope == shape["rope_parameters"], name
        else:
            assert rope["rope_theta"] == shape["rope_theta"], name
        if "sliding_window_pattern" in shape:
            pattern = shape["sliding_window_pattern"]
            assert config.layer_types[:pattern] == ["sliding_attention"] * (pattern - 1) + [
                "full_attention"], name
        assert str(getattr(config, "dtype", None) or config.torch_dtype).endswith("bfloat16")
        assert (folder / "tokenizer.json").exists()
        assert not list(folder.glob("*.safetensors"))  # the point: no weights
    assert SHAPES["llama-3.1-8b"]["num_hidden_layers"] == 32
    # The FP8 8B is the 8B with the block-wise FP8 layout its checkpoints ship with.
    fp8 = AutoConfig.from_pretrained(str(tmp_path / "llama-3.1-8b-fp8"))
    assert fp8.quantization_config == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                       "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert {k: v for k, v in SHAPES["llama-3.1-8b-fp8"].items()
            if k != "quantization_config"} == SHAPES["llama-3.1-8b"]
    assert getattr(AutoConfig.from_pretrained(str(tmp_path / "llama-3.1-8b")),
                   "quantization_config", None) is None
    moe = AutoConfig.from_pretrained(str(tmp_path / "qwen3-30b-a3b"))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    mixtral = AutoConfig.from_pretrained(str(tmp_path / "mixtral-8x7b"))
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (8, 2)
    phi = AutoConfig.from_pretrained(str(tmp_path / "phi-4-mini"))
    assert phi.rope_parameters["rope_type"] == "longrope"
    assert long_rope_threshold(phi) == 4096
    assert len(phi.rope_parameters["long_factor"]) == 48  # 128 dims x 0.75 / 2
    oss = AutoConfig.from_pretrained(str(tmp_path / "gpt-oss-20b"))
    assert oss.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert oss.rope_parameters["rope_type"] == "yarn"
    with pytest.raises(ValueError, match="unknown shape"):
        write_shape("gpt-5", tmp_path / "x", tiny_model("llama"))


def test_every_id_of_the_shape_decodes_to_visible_text(tiny_model, tmp_path):
    """Dummy weights sample any id of the shape's vocabulary; the tokenizer (here the tiny
    model's, far smaller) is filled up so that each decodes to text a client sees (the first
    H100 run's bursts timed no TTFT: their ids decoded to nothing), and prompts encode as
    before."""
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(tiny_model("llama"))
    shape = AutoTokenizer.from_pretrained(str(write_shape("llama-3.1-8b", tmp_path / "s",
                                                          tiny_model("llama"))))
    vocab_size = SHAPES["llama-3.1-8b"]["vocab_size"]
    assert len(source) < 1000 and len(shape) == vocab_size  # the probe: it was filled
    assert all(shape.decode([i]).strip() for i in (len(source), 70_000, vocab_size - 1))
    text = "The quick brown fox jumps over the lazy dog."
    assert shape.encode(text) == source.encode(text)


def test_dummy_weights_run_a_config_only_model(tiny_model, tmp_path, capsys):
    source = tiny_model("llama")
    folder = tmp_path / "shape"
    assert main(["llama-3.2-1b", str(folder), "--tokenizer-from", source,
                 "--num-hidden-layers", "2"]) == 0
    # A small hidden size keeps the CPU run short; the 1B shape's other fields stay.
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(model=str(folder), dtype="float32", max_model_len=64)  # probe: no checkpoint
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(model=str(folder), dtype="float32", max_model_len=64, load_format="dummy")
        try:
            # (oneDNN-prepacked linear weights cannot be read back: the rest are checked)
            weights = [p for p in llm.engine.executor.runner.model.parameters()
                       if not p.is_mkldnn]
            assert all(float(p.abs().max()) <= 1e-3 for p in weights)
            assert any(float(p.abs().max()) > 0 for p in weights)
            (out,) = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params)
            runs.append(out.token_ids)
        finally:
            llm.shutdown()
    assert len(runs[0]) == 4 and runs[0] == runs[1]  # seeded: the same weights each time


def test_the_phi_4_mini_shape_serves_from_dummy_weights(tiny_model, tmp_path):
    """Its partial rotary and LongRoPE table at the shape's head size (128 dims, 96 rotating),
    narrowed to two heads and two layers so that a CPU draws the weights in seconds."""
    folder = tmp_path / "phi"
    assert main(["phi-4-mini", str(folder), "--tokenizer-from", tiny_model("llama"),
                 "--num-hidden-layers", "2"]) == 0
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=256, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=512)
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(folder), dtype="float32", max_model_len=64, load_format="dummy")
    try:
        rotary = llm.engine.executor.runner.model.model.rotary_emb
        assert (rotary.rotary_dim, rotary.long_offset) == (96, 4096)
        assert llm.engine.scheduler.long_rope_after == 4096
        (out,) = llm.generate({"prompt_token_ids": [5, 6, 7, 8]},
                              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finally:
        llm.shutdown()
    assert len(out.token_ids) == 4


def test_load_format_is_checked(tiny_model):
    with pytest.raises(ValueError, match="load_format"):
        LLM(model=tiny_model("llama"), load_format="npz")
    assert Path(tiny_model("llama")).exists()
