"""Tensor-parallel runs of the offline LLM (test helper): the same prompts through a chunked
budget and a KV pool too small for all of them at once, at any TP size."""

from __future__ import annotations

from engine import LLM, SamplingParams


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPT_LENGTHS = [150, 40, 97, 12, 70, 120]


def _prompts(n_vocab: int) -> list[dict]:
    import random

    rng = random.Random(5)
    return [{"prompt_token_ids": [rng.randrange(1, n_vocab) for _ in range(n)]}
            for n in PROMPT_LENGTHS]


# Chunked prefill (budget below the longest prompt) and a pool too small for all requests at
# once, so KV-pressure preemption happens in the run.
CRAMPED = dict(dtype="float32", max_num_batched_tokens=64, num_kv_blocks=30, max_model_len=256,
               full_sequence_admission=False, watermark=0.0)


def _run(model: str, tp: int, params: SamplingParams = GREEDY, **overrides):
    llm = LLM(model=model, tensor_parallel_size=tp, **{**CRAMPED, **overrides})
    try:
        outs = llm.generate(_prompts(llm.engine.vocab_size), params)
    finally:
        llm.shutdown()
    if tp > 1:  # every worker left cleanly (none aborted in its interpreter's teardown)
        assert [p.exitcode for p in llm.engine.executor._procs] == [0] * tp
    return outs
