"""Greedy generation by HF transformers and by the offline engine on the same checkpoint (test
helper): what every family's engine-level test compares."""

from __future__ import annotations

from typing import Any

import torch


def hf_greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """HF ``generate``'s greedy continuation of each prompt, one prompt at a time."""
    return [model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def engine_greedy(model_dir: str, prompts: list[list[int]], max_tokens: int,
                  **engine_args: Any) -> tuple[list[list[int]], int]:
    """The offline engine's greedy outputs for ``prompts`` in one batch (float32, prefix
    caching on, unless ``engine_args`` say otherwise), and the tokens its prefix cache
    served."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model_dir, **{"dtype": "float32", "enable_prefix_caching": True,
                                  **engine_args})
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=max_tokens,
                                              ignore_eos=True))
        hits = llm.engine.scheduler.stats().prefix_cache_hits
    finally:
        llm.shutdown()
    return [list(o.token_ids) for o in outputs], hits
