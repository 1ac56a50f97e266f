"""The sampling parameters vLLM users use, against loop-by-loop reference implementations of
their OpenAI / vLLM definitions, at the sampler and through the engine on a tiny model."""


import pytest
import torch

from engine.sampling_params import SamplingParams
from tests.utils.sampling_reference import _reference
from workers.sample.logits_processors import TokenHistory, process_logits
from workers.sample.sampler import Sampler

VOCAB = 40


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": 1.5},
    {"presence_penalty": -0.7},
    {"frequency_penalty": 0.8},
    {"frequency_penalty": -2.0},
    {"repetition_penalty": 1.7},
    {"repetition_penalty": 0.6},
    {"logit_bias": {3: 5.0, 17: -100.0}},
    {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2,
     "logit_bias": {9: 2.5}},
])
def test_processors_match_the_reference(kwargs):
    sp = SamplingParams(**kwargs)
    prompt, output = [1, 2, 3, 3, 30], [3, 7, 7, 7, 12]
    logits = _logits()
    got = process_logits(logits, sp, TokenHistory(prompt, output))
    want = torch.tensor(_reference(logits.tolist(), sp, prompt, output, []))
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.equal(got, logits)  # probe: the parameter really changed something


def test_min_tokens_mask_blocks_stop_tokens():
    logits = _logits()
    blocked = [int(logits.argmax()), 5]
    got = process_logits(logits, SamplingParams(min_tokens=2), TokenHistory(blocked_token_ids=blocked))
    assert torch.isinf(got[blocked]).all() and torch.isfinite(got[[0, 1]]).all()
    out = Sampler()(logits[None], [SamplingParams(temperature=0, min_tokens=2)], [0],
                    [TokenHistory(blocked_token_ids=blocked)])
    assert out.token_ids[0] not in blocked


def test_greedy_follows_logit_bias_and_penalties():
    logits = _logits()
    top = int(logits.argmax())
    pushed = Sampler()(logits[None], [SamplingParams(temperature=0, logit_bias={7: 100.0})], [0])
    assert pushed.token_ids == [7] != [top]
    penalized = Sampler()(logits[None], [SamplingParams(temperature=0, presence_penalty=2.0,
                                                        frequency_penalty=2.0)], [0],
                          [TokenHistory(output_token_ids=[top] * 10)])
    assert penalized.token_ids[0] != top


def test_min_p_keeps_only_likely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(seed=0)
    draws = {sampler(logits, [SamplingParams(temperature=1.0, min_p=0.5)], [0]).token_ids[0]
             for _ in range(200)}
    assert draws == {0, 1}  # 0.15 < 0.5 * 0.5


def test_a_row_with_every_token_blocked_fails_alone():
    logits = torch.zeros(2, 4)
    sp = SamplingParams(temperature=0, logit_bias={i: -100.0 for i in range(4)})
    out = Sampler()(logits, [SamplingParams(temperature=0), sp], [0, 0],
                    [TokenHistory(), TokenHistory(blocked_token_ids=[0, 1, 2, 3])])
    assert out.token_ids[0] == 0 and out.token_ids[1] is None and "no token" in str(out.errors[1])


def test_out_of_vocabulary_bias_fails_the_row():
    out = Sampler()(_logits()[None], [SamplingParams(logit_bias={VOCAB + 5: 1.0})], [0])
    assert out.token_ids == [None] and "outside the vocabulary" in str(out.errors[0])


def test_sampled_logprobs_are_after_temperature_with_rank_and_top_k():
    logits = _logits()[None]
    sp = SamplingParams(temperature=0.5, logprobs=3, seed=4)
    out = Sampler()(logits, [sp], [0])
    lp = out.logprobs[0]
    expected = torch.log_softmax(logits[0] / 0.5, -1)
    token = out.token_ids[0]
    assert lp.token_ids == [token]
    assert lp.logprobs[0] == pytest.approx(expected[token].item(), abs=1e-5)
    assert lp.ranks[0] == int((expected > expected[token]).sum()) + 1
    assert lp.top_token_ids[0] == expected.topk(3).indices.tolist()
    greedy = Sampler()(logits, [SamplingParams(temperature=0, logprobs=0)], [0]).logprobs[0]
    assert greedy.ranks == [1] and greedy.top_token_ids == [[]]
    assert greedy.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1).max().item(),
                                               abs=1e-5)
