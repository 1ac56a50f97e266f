"""Gemma 2 and Gemma 3 (text) served as HF computes them: Gemma's norms (1 + weight, in
float32), the norms around attention and MLP, GeGLU, scaled embeddings, query_pre_attn_scalar,
sliding layers (Gemma 3's with their own rotary base beside global ones, linearly scaled in the
larger models; Gemma 2's soft-capped attention scores and logits), on the PyTorch layers and the
CPU's fused kernels, in the engine, a multimodal Gemma 3 checkpoint's text model, and the
configs they refuse."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kernels import cpu_fused, select_backend  # noqa: E402
from tests.utils.hf_greedy import engine_greedy, hf_greedy  # noqa: E402
from tests.utils.paged_helpers import PagedSequence, assert_chunks_match_hf  # noqa: E402
from tests.utils.tiny_models import (load_tiny_model, make_tiny_config,  # noqa: E402
                                     make_tiny_model)
from workers.models import build_model  # noqa: E402
from workers.models.gemma import GemmaRMSNorm  # noqa: E402

ATOL = 2e-4  # as tests/worker/test_models.py: float32 summation-order noise is ~1e-5
# Gemma 3 4B and larger: the global layers' rotary scaled linearly by 8, the local ones not.
SCALED_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}



def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("overrides", [{}, {"rope_parameters": SCALED_ROPE}],
                         ids=["local-and-global-base", "global-scaled-linearly"])
def test_gemma3_matches_hf(tmp_path, overrides) -> None:
    model_dir = make_tiny_model(tmp_path, "gemma3", seed=0, **overrides)
    model = load_tiny_model(model_dir)
    # Probes: the tiny model slides layers 0 and 2 over 24 tokens, each with its own rotary
    # table, and its norms hold 1 + the checkpoint's weights.
    assert model.layer_windows == [24, None, 24]
    assert model.model.layer_rope_kind == ["sliding_attention", "full_attention",
                                           "sliding_attention"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    norm = model.model.layers[1].pre_feedforward_layernorm
    assert isinstance(norm, GemmaRMSNorm)
    torch.testing.assert_close(norm.weight, 1 + hf.model.layers[1].pre_feedforward_layernorm
                               .weight.detach(), atol=0, rtol=0)
    # 70 tokens: a 40-token prefill and a 12-token chunk over it straddle the window; 18 decodes
    # go past it.
    seq = PagedSequence(_tokens(70, seed=1), blocks=[7, 2, 11, 4, 0])
    assert_chunks_match_hf(model, model_dir, seq, [40, 12], decodes=18, num_blocks=16,
                           atol=ATOL)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_on_the_fused_cpu_kernels_matches_hf(tmp_path, arch: str) -> None:
    if not cpu_fused.warm_up():
        pytest.skip("the fused CPU kernels cannot be compiled here (no C++ compiler?)")
    model_dir = make_tiny_model(tmp_path, arch, seed=0, hidden_size=256,
                                intermediate_size=512, initializer_range=0.1)
    model = load_tiny_model(model_dir)
    model.use_kernels(select_backend(torch.device("cpu")))
    # Probe: the norms and the decode attention run on the compiled kernels.
    assert model.model.layers[0].pre_feedforward_layernorm.fused is cpu_fused.rms_norm
    assert model.kernels.paged_attention is cpu_fused.paged_attention
    seq = PagedSequence(_tokens(60, seed=2), blocks=[3, 1, 0, 2])
    assert_chunks_match_hf(model, model_dir, seq, [30, 10], decodes=20, num_blocks=8,
                           atol=ATOL)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_the_engine_generates_as_hf(tmp_path, arch: str) -> None:
    model_dir = make_tiny_model(tmp_path, arch, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [_tokens(50, seed=s) for s in range(3)]
    prompts.append(list(prompts[0]))  # a prefix-cache hit
    expected = hf_greedy(hf, prompts, 20)
    outputs, hits = engine_greedy(model_dir, prompts, 20, num_kv_blocks=64, max_model_len=256,
                                  max_num_batched_tokens=32)
    assert outputs == expected
    assert hits > 0  # probe: the repeated prompt was served from the cache


def test_gemma2_matches_hf_with_its_soft_caps(tmp_path) -> None:
    model_dir = make_tiny_model(tmp_path, "gemma2", seed=0)
    model = load_tiny_model(model_dir)
    assert model.layer_windows == [24, None, 24]
    assert (model.attn_softcap, model.final_logit_softcap) == (2.0, 5.0)
    seq = PagedSequence(_tokens(70, seed=1), blocks=[7, 2, 11, 4, 0])
    assert_chunks_match_hf(model, model_dir, seq, [40, 12], decodes=18, num_blocks=16,
                           atol=ATOL)
    # Probes: without either cap the logits are not HF's.
    for cap in ("attn_softcap", "final_logit_softcap"):
        saved = getattr(model, cap)
        setattr(model, cap, None)
        with pytest.raises(AssertionError):
            assert_chunks_match_hf(model, model_dir, PagedSequence(seq.tokens, seq.blocks),
                                   [40, 12], decodes=2, num_blocks=16, atol=ATOL)
        setattr(model, cap, saved)


@pytest.mark.parametrize("overrides, message", [
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a positive number"),
    ({"use_bidirectional_attention": True}, "bidirectional attention"),
    ({"hidden_activation": "relu"}, "unsupported hidden activation 'relu'"),
])
def test_configs_it_cannot_compute_are_named(overrides, message: str) -> None:
    config = make_tiny_config("gemma3", architectures=["Gemma3ForCausalLM"])
    config.__dict__.update(overrides)
    with pytest.raises(ValueError, match=message):
        build_model(config, torch.float32, torch.device("cpu"))


def _multimodal_checkpoint(path) -> str:
    """A tiny Gemma 3 checkpoint as the multimodal releases are (gemma-3-12b-it): a vision tower
    and projector beside the text model, under ``language_model.``, saved by transformers."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from engine.benchmarks.inputs.random_checkpoints import ARCHS
    from tests.utils.tiny_models import TINY_DEFAULTS

    text = {**TINY_DEFAULTS, **ARCHS["gemma3"][3]}
    config = Gemma3Config(text_config=text, mm_tokens_per_image=4,
                          vision_config=dict(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=32, patch_size=8))
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(path))
    return str(path)


def test_a_multimodal_checkpoint_serves_its_text_model_as_hf(tmp_path) -> None:
    from transformers import Gemma3ForConditionalGeneration

    from engine.model_folder import load_hf_config

    model_dir = _multimodal_checkpoint(tmp_path)
    config = load_hf_config(model_dir)
    # Probe: the folder is the multimodal one, served through its text config.
    assert config.architectures == ["Gemma3ForConditionalGeneration"]
    assert type(config).__name__ == "Gemma3TextConfig"
    model = load_tiny_model(model_dir)
    hf = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    seq = PagedSequence(_tokens(60, seed=3), blocks=[3, 1, 0, 2])
    with torch.no_grad():
        ref = hf(torch.tensor([seq.tokens])).logits[0]
    from tests.utils.paged_helpers import make_kv_caches, paged_step

    caches = make_kv_caches(model, 8, 16)
    paged_step(model, caches, [(seq, 40)], num_decodes=0)
    for _ in range(20):
        paged_step(model, caches, [(seq, 1)], num_decodes=1)
    torch.testing.assert_close(torch.stack(seq.logits), ref, atol=ATOL, rtol=0)
