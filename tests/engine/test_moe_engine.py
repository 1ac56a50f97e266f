"""Mixtures of experts through the whole engine: greedy output equal to HF transformers' with
chunked prefill beside decodes, prefix caching, a cramped KV pool, and tensor parallelism
(docs/design.md section 6, for the MoE families)."""

from __future__ import annotations

import multiprocessing
import random

import pytest

from engine import LLM, SamplingParams
from engine.benchmarks.reference.hf_reference import hf_greedy
from tests.utils.tp import CRAMPED, PROMPT_LENGTHS, _run

MAX_NEW = 24
LENGTHS = [5, 300, 17, 121, 63, 251, 33, 9]  # odd lengths; the longest exceed the budget
GREEDY_NEW = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(vocab: int, lengths: list[int], seed: int = 0,
             prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY_NEW):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_greedy_matches_hf_with_chunked_prefill(tiny_model, arch):
    model = tiny_model(arch)
    llm = LLM(model=model, dtype="float32", block_size=16, max_num_batched_tokens=128,
              enable_prefix_caching=False)
    steps: list = []
    llm.engine.step_observers.append(
        lambda timing: steps.append(timing.scheduled) if timing.scheduled is not None else None)
    prompts = _prompts(llm.engine.vocab_size, LENGTHS)
    outs = _generate(llm, prompts)
    assert [o.token_ids for o in outs] == hf_greedy(model, prompts, MAX_NEW)
    # Probes: the budget split prompts into chunks, and chunks shared steps with decodes.
    assert any(r.start_pos > 0 for s in steps for r in s.requests if len(r.token_ids) > 1)
    assert any(any(len(r.token_ids) == 1 for r in s.requests)
               and any(len(r.token_ids) > 1 for r in s.requests) for s in steps)
    # ... and the model really routes: its layers hold experts.
    experts = [m for m in llm.engine.executor.runner.model.modules()
               if type(m).__name__ == "FusedMoE"]
    assert len(experts) == llm.engine.model.hf_config.num_hidden_layers
    llm.engine.scheduler.check_invariants()


def test_greedy_matches_hf_with_prefix_caching(tiny_model):
    model = tiny_model("qwen3_moe")
    llm = LLM(model=model, dtype="float32", block_size=16, max_num_batched_tokens=128,
              enable_prefix_caching=True)
    vocab = llm.engine.vocab_size
    shared = _prompts(vocab, [201], seed=1)[0]
    prompts = _prompts(vocab, [7, 41, 3, 89], seed=2, prefix=shared)
    first = _generate(llm, prompts[:1])
    rest = _generate(llm, prompts[1:])
    assert [o.token_ids for o in first + rest] == hf_greedy(model, prompts, MAX_NEW)
    assert llm.engine.scheduler.kv_cache_manager.prefix_cache_hits > 0  # probe
    assert all(o.metrics.num_cached_tokens >= 192 for o in rest)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_cramped_pool_preempts_and_matches_hf(tiny_model, arch):
    model = tiny_model(arch)
    cramped = LLM(model=model, dtype="float32", num_kv_blocks=24, max_model_len=256)
    prompts = _prompts(cramped.engine.vocab_size, [101, 89, 80, 71, 60, 51])
    got = _generate(cramped, prompts)
    assert [o.token_ids for o in got] == hf_greedy(model, prompts, MAX_NEW)
    assert sum(o.metrics.num_kv_preemptions for o in got) > 0  # probe: KV preemptions happened
    cramped.engine.scheduler.check_invariants()
    assert cramped.engine.scheduler.kv_cache_manager.num_free_blocks == 24


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_tp2_equals_tp1_with_chunking_and_preemption(tiny_model, arch):
    """Each rank holds every expert's half of the intermediate dimension (and the shared
    expert's half); the partial sums meet in one all-reduce."""
    model = tiny_model(arch)
    want = _run(model, tp=1)
    got = _run(model, tp=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.num_kv_preemptions for o in got) > 0  # probes
    assert max(PROMPT_LENGTHS) > CRAMPED["max_num_batched_tokens"]
    assert not multiprocessing.active_children()
