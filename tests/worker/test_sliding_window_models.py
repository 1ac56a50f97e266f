"""Sliding-window layers served as HF computes them: which layers slide in each family (HF's
reading of ``sliding_window``, ``use_sliding_window``, ``layer_types``), the logits of every
position equal HF's in float32 for prompts several windows long (chunks that straddle the
window, decodes past it, a mixed batch, the CPU's fused decode loop), the engine's greedy
output equal to HF's ``generate`` with prefix caching and under KV preemptions, and bad
configs named at load."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kernels import cpu_fused, select_backend  # noqa: E402
from tests.utils.paged_helpers import (PagedSequence, assert_chunks_match_hf,  # noqa: E402
                                       make_kv_caches, paged_step)
from tests.utils.tiny_models import (load_tiny_model, make_tiny_config,  # noqa: E402
                                     make_tiny_model)
from workers.models import build_model  # noqa: E402

ATOL = 2e-4  # as tests/worker/test_models.py: float32 summation-order noise is ~1e-5
WINDOW = 24

# arch -> (config overrides, the layers HF slides among the tiny models' 3).
FAMILIES = {
    # Every layer (HF's Mistral and Mixtral read no layer_types).
    "mistral": ({"sliding_window": WINDOW}, [0, 1, 2]),
    "mixtral": ({"sliding_window": WINDOW}, [0, 1, 2]),
    # layer_types from max_window_layers: the layers from it on slide.
    "qwen2": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
              [1, 2]),
    "qwen3": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
              [2]),
    # Qwen2-MoE: every other layer below max_window_layers.
    "qwen2_moe": ({"use_sliding_window": True, "sliding_window": WINDOW,
                   "max_window_layers": 3}, [0, 2]),
    # Qwen3-MoE: every layer, whatever its layer types.
    "qwen3_moe": ({"use_sliding_window": True, "sliding_window": WINDOW}, [0, 1, 2]),
}



def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", FAMILIES)
def test_each_family_slides_the_layers_hf_slides_and_matches_it(tmp_path, arch: str) -> None:
    overrides, sliding = FAMILIES[arch]
    model_dir = make_tiny_model(tmp_path, arch, seed=0, **overrides)
    model = load_tiny_model(model_dir)
    assert model.layer_windows == [WINDOW if i in sliding else None for i in range(3)]
    # 70 tokens, nearly three windows: a 40-token prefill and a 12-token chunk over it (both
    # straddle the window), then 18 decodes past it.
    seq = PagedSequence(_tokens(70, seed=1), blocks=[7, 2, 11, 4, 0])
    assert_chunks_match_hf(model, model_dir, seq, [40, 12], decodes=18, num_blocks=16,
                           atol=ATOL)
    # Probe: the window changes the answer, so full attention would not have matched.
    model.layer_windows = [None] * 3
    with pytest.raises(AssertionError):
        assert_chunks_match_hf(model, model_dir, PagedSequence(seq.tokens, seq.blocks),
                               [40, 12], decodes=18, num_blocks=16, atol=ATOL)


def test_a_mixed_batch_on_the_fused_cpu_kernels_matches_hf(tmp_path, monkeypatch) -> None:
    """Decodes past the window beside a chunk over a cached prefix in one step, the decodes on
    the CPU's compiled loop (a model the fused kernels serve: hidden 256)."""
    if not cpu_fused.warm_up():
        pytest.skip("the fused CPU kernels cannot be compiled here (no C++ compiler?)")
    model_dir = make_tiny_model(tmp_path, "mistral", seed=0, sliding_window=WINDOW,
                                hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                num_key_value_heads=2, initializer_range=0.1)
    model = load_tiny_model(model_dir)
    model.use_kernels(select_backend(torch.device("cpu")))
    assert model.kernels.paged_attention is cpu_fused.paged_attention  # probe: the fused loop
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    a = PagedSequence(_tokens(61, seed=2), blocks=[5, 12, 1, 9])
    b = PagedSequence(_tokens(60, seed=3), blocks=[20, 2, 14, 8])
    with torch.no_grad():
        ref_a, ref_b = (hf(torch.tensor([s.tokens])).logits[0] for s in (a, b))
    caches = make_kv_caches(model, 32, 16)
    paged_step(model, caches, [(a, 50), (b, 25)], num_decodes=0)
    for _ in range(11):  # a decodes past its window while b's chunks go on
        paged_step(model, caches, [(a, 1), (b, 3)], num_decodes=1)
    paged_step(model, caches, [(b, 2)], num_decodes=0)
    torch.testing.assert_close(torch.stack(a.logits), ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.stack(b.logits), ref_b, atol=ATOL, rtol=0)


def test_the_engine_generates_as_hf_with_prefix_caching_and_kv_preemptions(tmp_path) -> None:
    from engine import LLM, SamplingParams

    model_dir = make_tiny_model(tmp_path, "qwen2", seed=0, use_sliding_window=True,
                                sliding_window=WINDOW, max_window_layers=1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [_tokens(50, seed=s) for s in range(4)]
    # The first prompt twice: its second copy finds the first's blocks in the prefix cache.
    prompts.append(list(prompts[0]))
    expected = []
    for prompt in prompts:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                          pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    # 5 requests of 80 tokens in 18 blocks of one layer each (a KV cache group per layer: one
    # full, two sliding; engine.core.kv_groups), admitted on their first chunk of 16 tokens
    # alone: as their prompts grow, the pool runs out and requests are preempted and
    # recomputed.
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=18, max_model_len=96,
              enable_prefix_caching=True, max_num_batched_tokens=16,
              full_sequence_admission=False)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        stats = llm.engine.scheduler.stats()
    finally:
        llm.shutdown()
    assert [list(o.token_ids) for o in outputs] == expected
    # Probes: KV preemptions happened, and the prefix cache served hits.
    assert sum(o.metrics.num_kv_preemptions for o in outputs if o.metrics) > 0
    assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("overrides, message", [
    ({"sliding_window": 0.5}, "sliding_window must be a positive integer"),
    ({"sliding_window": -3}, "sliding_window must be a positive integer"),
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
     "unsupported layer_types"),
])
def test_bad_window_configs_are_named(overrides, message: str) -> None:
    config = make_tiny_config("qwen2", use_sliding_window=True, sliding_window=WINDOW,
                              architectures=["Qwen2ForCausalLM"])
    # Past HF's own field checks (a checkpoint's config.json is read without all of them).
    config.__dict__.update(overrides)
    with pytest.raises(ValueError, match=message):
        build_model(config, torch.float32, torch.device("cpu"))
