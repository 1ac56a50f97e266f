"""gpt-oss served as HF transformers computes it: attention sinks, biases on q/k/v/o, every
other layer sliding, YaRN rotary, and a mixture of experts with a biased router (softmax over
the top k logits) and clamped-SwiGLU experts with biases, loaded from the stacked, interleaved
layout transformers saves; an MXFP4 checkpoint is refused by name."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from tests.utils.hf_greedy import engine_greedy, hf_greedy  # noqa: E402
from tests.utils.paged_helpers import PagedSequence, assert_chunks_match_hf  # noqa: E402
from tests.utils.tiny_models import load_tiny_model, make_tiny_model  # noqa: E402

ATOL = 2e-4  # float32 summation-order noise


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_gpt_oss_matches_hf(tmp_path) -> None:
    model_dir = make_tiny_model(tmp_path, "gpt_oss", seed=0)
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        # Probes: the layout transformers saves (experts stacked, gate and up interleaved).
        assert tuple(f.get_tensor("model.layers.0.mlp.experts.gate_up_proj").shape) == (4, 64, 256)
        assert "model.layers.0.self_attn.sinks" in f.keys()
    model = load_tiny_model(model_dir)
    assert model.layer_windows == [24, None, 24]
    assert all(s is not None for s in model.layer_sinks)
    # Its experts read their counts on the host: a GPU runs the model without CUDA graphs.
    assert not all(getattr(m, "capturable", True) for m in model.modules())
    # A prompt of three windows, chunks that straddle them, and decodes past them.
    seq = PagedSequence(_tokens(70, seed=1), blocks=[7, 2, 11, 4, 0])
    assert_chunks_match_hf(model, model_dir, seq, [40, 12], decodes=18, num_blocks=16,
                           atol=ATOL)


def test_the_engine_generates_as_hf(tmp_path) -> None:
    model_dir = make_tiny_model(tmp_path, "gpt_oss", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [_tokens(50, seed=s) for s in range(3)]
    prompts.append(list(prompts[0]))  # a prefix-cache hit
    expected = hf_greedy(hf, prompts, 20)
    # Probe: without its sinks the model generates otherwise.
    for layer in hf.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)
    assert hf_greedy(hf, prompts[1:2], 20) != expected[1:2]
    outputs, hits = engine_greedy(model_dir, prompts, 20, num_kv_blocks=64, max_model_len=256,
                                  max_num_batched_tokens=32)
    assert outputs == expected
    assert hits > 0


def test_an_mxfp4_checkpoint_is_refused_by_name(tmp_path) -> None:
    from engine import LLM

    model_dir = make_tiny_model(tmp_path, "gpt_oss", seed=0)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mxfp4"):
        LLM(model=model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256)
