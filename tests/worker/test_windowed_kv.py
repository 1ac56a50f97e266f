"""Windowed KV: a Gemma-3-layout model (five sliding layers per global one) serves a
conversation many windows long in a pool smaller than its full-attention KV, because each
sliding layer's group gives back the blocks its window has passed and the pool hands them out
again; every turn equals HF transformers' greedy output, the turns after the first hit the
prefix cache, and no request is preempted for KV."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from engine.core.kv_groups import pool_blocks_needed  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.utils.tiny_models import make_tiny_model  # noqa: E402

WINDOW = 24
BLOCK = 4


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_conversation_many_windows_long_reuses_the_blocks_its_windows_passed(tmp_path) -> None:
    from engine import LLM

    model_dir = make_tiny_model(tmp_path, "gemma3", seed=0, num_hidden_layers=6,
                                sliding_window=WINDOW, sliding_window_pattern=6)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert hf.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    # Three turns: each sends the conversation so far and a new message.
    turns, history = [], []
    for turn, new in enumerate((40, 30, 30)):
        prompt = history + _tokens(new, seed=turn)
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
        turns.append((prompt, expected))
        history = prompt + expected
    longest = len(history)  # 148 tokens: six windows

    # A pool that holds the conversation only if the sliding layers let go: full attention
    # would need 6 layers x 37 blocks of it at the end.
    llm = LLM(model=model_dir, dtype="float32", block_size=BLOCK, num_kv_blocks=120,
              max_model_len=256, max_num_batched_tokens=16, enable_prefix_caching=True)
    try:
        scheduler = llm.engine.scheduler
        kv = scheduler.kv_cache_manager
        assert [g.window for g in kv.groups] == [None] + [WINDOW] * 5
        assert pool_blocks_needed(kv.groups, 256, BLOCK, 16) <= 120 < 6 * -(-longest // BLOCK)
        # Request id -> the most blocks it held over every group, its tables' longest length.
        held: dict[str, tuple[int, int]] = {}
        given_back: set[int] = set()
        reused: set[int] = set()
        update, give_back, allocate = (scheduler.update_from_output, kv._give_back_passed,
                                       kv.pool.allocate)

        def observed(scheduler_output, runner_output):
            # Each request's most blocks held over every group, with its tables' length.
            for request in scheduler_output.requests:
                rid = request.req_id
                most, longest = held.get(rid, (0, 0))
                held[rid] = (max(most, kv.num_held_blocks(rid)),
                             max(longest, kv.num_blocks_of(rid)))
            return update(scheduler_output, runner_output)

        def giving_back(req_id: str, group: int, first_needed: int) -> None:
            before = {b.block_id for b in kv.req_blocks[req_id][group] if b is not None}
            give_back(req_id, group, first_needed)
            given_back.update(before - {b.block_id for b in kv.req_blocks[req_id][group]
                                        if b is not None})

        def allocating(num_blocks: int):
            blocks = allocate(num_blocks)
            reused.update(given_back & {b.block_id for b in blocks})
            return blocks

        scheduler.update_from_output = observed
        kv._give_back_passed = giving_back
        kv.pool.allocate = allocating
        outputs = [llm.generate([{"prompt_token_ids": prompt}],
                                SamplingParams(temperature=0, max_tokens=16,
                                               ignore_eos=True))[0]
                   for prompt, _ in turns]
        stats = scheduler.stats()
    finally:
        llm.shutdown()
    assert [list(o.token_ids) for o in outputs] == [expected for _, expected in turns]
    assert stats.prefix_cache_hits > 0 and scheduler.num_kv_preemptions == 0
    # The last turn held at most the full group's table and each sliding group's window and
    # chunk: about a third of its full-attention KV.
    most, length = max(held.values(), key=lambda pair: pair[1])
    assert length == -(-(longest - 1) // BLOCK)  # its last token is sampled, not computed
    assert most <= length + 5 * (-(-(WINDOW - 1 + 16) // BLOCK) + 1)
    assert most / (6 * length) < 0.45
    assert given_back and reused  # probe: blocks a window passed were handed out again
