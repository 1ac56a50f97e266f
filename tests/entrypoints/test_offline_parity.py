"""The API parity features through the offline API (`LLM.generate`): every penalty, logit_bias
and min_tokens against a reference greedy loop over the Hugging Face model, logprobs, n > 1
sharing the prompt's KV, and the parked siblings' life cycle."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.core.request import RequestStatus
from engine.entrypoints.llm import LLM
from engine.sampling_params import SamplingParams
from tests.utils.sampling_reference import PROMPT, _reference_greedy

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(model=model_dir, dtype="float32", max_model_len=128, block_size=4)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kwargs", [
    # Greedy output of a random tiny model rarely repeats a token, so most cases push toward
    # repeats (negative penalties, repetition_penalty < 1) for the penalties to bite.
    {"presence_penalty": -2.0},
    {"frequency_penalty": -1.0},
    {"repetition_penalty": 0.3},
    {"repetition_penalty": 0.3, "frequency_penalty": 1.0, "presence_penalty": 0.5},
    {"logit_bias": {7: 4.0, 42: -3.0}},
])
def test_penalties_match_a_reference_greedy_loop(llm, hf, kwargs):
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, sp)
    (plain,) = llm.generate({"prompt_token_ids": PROMPT},
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert out.token_ids == _reference_greedy(hf, sp, None)
    assert out.token_ids != plain.token_ids  # probe: the parameter changed the output


def test_min_tokens_holds_back_stop_tokens(llm, hf):
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (free,) = llm.generate({"prompt_token_ids": PROMPT}, plain)
    stop = free.token_ids[0]
    (stopped,) = llm.generate({"prompt_token_ids": PROMPT},
                              SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                             ignore_eos=True, stop_token_ids=[stop]))
    assert stopped.token_ids == [stop] and stopped.finish_reason == "stop"  # probe
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        stop_token_ids=[stop], min_tokens=5)
    (held,) = llm.generate({"prompt_token_ids": PROMPT}, sp)
    assert len(held.token_ids) >= 5 and stop not in held.token_ids[:5]
    assert held.token_ids == _reference_greedy(hf, sp, None)


def test_offline_logprobs_and_prompt_logprobs(llm, hf):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2,
                        prompt_logprobs=1)
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, sp)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT + out.token_ids])).logits[0], -1)
    assert len(out.logprobs) == 4 and out.prompt_logprobs[0] is None
    for i, token in enumerate(out.token_ids):
        position = out.logprobs[i]
        assert next(iter(position)) == token and position[token].rank == 1
        assert position[token].logprob == pytest.approx(ref[len(PROMPT) - 1 + i, token].item(),
                                                        abs=1e-4)
        assert len(position) == 2  # greedy: the chosen token is the top one
    assert out.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for p, t in zip(out.logprobs, out.token_ids)))
    for j in range(1, len(PROMPT)):
        entry = out.prompt_logprobs[j][PROMPT[j]]
        assert entry.logprob == pytest.approx(ref[j - 1, PROMPT[j]].item(), abs=1e-4)
    assert [len(p) for p in out.prompt_logprobs[1:]] == [
        1 if p[PROMPT[j]].rank == 1 else 2 for j, p in enumerate(out.prompt_logprobs[1:], 1)]


def test_n_samples_share_the_prompt_and_are_seeded_apart(llm):
    scheduler = llm.engine.scheduler
    prompt = list(range(20, 53))  # 33 tokens: 8 full blocks of 4 before the last token
    hits = scheduler.prefix_cache_hits
    (out,) = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6))
    assert len(out.outputs) == 3 and out.outputs[0] is out
    assert scheduler.prefix_cache_hits - hits == 2 * 32  # the two later samples hit 8 blocks
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    # Seeded apart as vLLM does: sample i is the seed + i request on its own.
    (second,) = llm.generate({"prompt_token_ids": prompt},
                             SamplingParams(temperature=1.0, seed=12, max_tokens=6))
    assert second.token_ids == out.outputs[1].token_ids
    (single,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2))
    assert single.outputs == [single]


def test_parked_siblings_follow_their_leader(llm):
    from engine.core.request import Request

    engine = llm.engine
    scheduler = engine.scheduler
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    leader = Request("lead", list(range(30, 50)), params)
    kept = Request("kept", list(range(30, 50)), params, prefill_after="lead")
    dropped = Request("dropped", list(range(30, 50)), params, prefill_after="lead")
    for r in (leader, kept, dropped):
        engine.add_request(r)
    assert scheduler.siblings.parked_ids == {"kept", "dropped"}  # probe: parked, not queued
    scheduler.check_invariants()
    scheduler.abort_requests(["dropped"])
    assert dropped.status is RequestStatus.FINISHED_ABORTED
    scheduler.abort_requests(["lead"])  # the leader ends before its first token
    assert scheduler.siblings.parked_ids == set() and kept in list(scheduler.waiting)
    while scheduler.has_unfinished_requests():
        engine.step()
        scheduler.check_invariants()
    assert kept.num_output_tokens == 3


def test_best_of_returns_the_most_likely_samples(llm):
    prompt = {"prompt_token_ids": list(range(60, 75))}
    drawn = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=30 + i, max_tokens=5,
                                                 logprobs=0))[0] for i in range(4)]
    (best,) = llm.generate(prompt, SamplingParams(n=2, best_of=4, temperature=1.0, seed=30,
                                                  max_tokens=5))
    ranked = sorted(drawn, key=lambda o: o.cumulative_logprob, reverse=True)
    assert [o.token_ids for o in best.outputs] == [o.token_ids for o in ranked[:2]]
    assert len({tuple(o.token_ids) for o in drawn}) > 2  # probe: the samples differ
    assert best.logprobs is None  # computed to rank them, not asked for
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
