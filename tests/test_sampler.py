import pytest
import torch

from engine.sampling_params import SamplingParams
from workers.sampler import Sampler


def _logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits()
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 3, [0, 0, 0])
    assert out == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = _logits()
    sp = SamplingParams(temperature=1.0, seed=7)
    alone = Sampler(seed=1)(logits[1:2], [sp], [4])
    batch = torch.cat([logits[0:1], logits[1:2], logits[1:2]])
    batched = Sampler(seed=2)(batch, [SamplingParams(temperature=1.0), sp, sp], [0, 4, 4])
    assert batched[1] == alone[0] == batched[2]


def test_seed_varies_with_output_index():
    logits = torch.zeros(1, 1000)
    sp = SamplingParams(temperature=1.0, seed=3)
    draws = {Sampler()(logits, [sp], [i])[0] for i in range(20)}
    assert len(draws) > 10


def test_top_k_one_is_greedy():
    logits = _logits(rows=1)
    out = [Sampler(seed=s)(logits, [SamplingParams(temperature=5.0, top_k=1)], [0])[0]
           for s in range(10)]
    assert set(out) == {int(logits.argmax())}


def test_top_p_restricts_to_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(seed=0)
    draws = {sampler(logits, [SamplingParams(temperature=1.0, top_p=0.7)], [0])[0]
             for _ in range(200)}
    assert draws == {0, 1}


def test_temperature_sampling_covers_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.5]]))
    sampler = Sampler(seed=0)
    draws = [sampler(logits, [SamplingParams(temperature=1.0)], [0])[0] for _ in range(200)]
    assert 60 < sum(draws) < 140


@pytest.mark.parametrize("field,kwargs", [
    ("max_tokens", {"max_tokens": 0}),
    ("temperature", {"temperature": -0.1}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("n", {"n": 2}),
])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
