import pytest
import torch

from engine.sampling_params import SamplingParams
from workers.sample.sampler import NonFiniteLogits, Sampler


def _logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits()
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 3, [0, 0, 0])
    assert out.token_ids == logits.argmax(-1).tolist() and not out.errors


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = _logits()
    sp = SamplingParams(temperature=1.0, seed=7)
    alone = Sampler(seed=1)(logits[1:2], [sp], [4]).token_ids
    batch = torch.cat([logits[0:1], logits[1:2], logits[1:2]])
    batched = Sampler(seed=2)(batch, [SamplingParams(temperature=1.0), sp, sp], [0, 4, 4]).token_ids
    assert batched[1] == alone[0] == batched[2]


def test_seed_varies_with_output_index():
    logits = torch.zeros(1, 1000)
    sp = SamplingParams(temperature=1.0, seed=3)
    draws = {Sampler()(logits, [sp], [i]).token_ids[0] for i in range(20)}
    assert len(draws) > 10


def test_top_k_one_is_greedy():
    logits = _logits(rows=1)
    out = [Sampler(seed=s)(logits, [SamplingParams(temperature=5.0, top_k=1)], [0]).token_ids[0]
           for s in range(10)]
    assert set(out) == {int(logits.argmax())}


def test_top_p_restricts_to_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(seed=0)
    draws = {sampler(logits, [SamplingParams(temperature=1.0, top_p=0.7)], [0]).token_ids[0]
             for _ in range(200)}
    assert draws == {0, 1}


def test_temperature_sampling_covers_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.5]]))
    sampler = Sampler(seed=0)
    draws = [sampler(logits, [SamplingParams(temperature=1.0)], [0]).token_ids[0]
             for _ in range(200)]
    assert 60 < sum(draws) < 140


@pytest.mark.parametrize("field,kwargs", [
    ("max_tokens", {"max_tokens": 0}),
    ("temperature", {"temperature": -0.1}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("n", {"n": 0}),
    ("min_p", {"min_p": 1.5}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("repetition_penalty", {"repetition_penalty": 1e-40}),
    ("repetition_penalty", {"repetition_penalty": 1e30}),
    ("min_tokens", {"min_tokens": 20, "max_tokens": 10}),
    ("logprobs", {"logprobs": 21}),
    ("prompt_logprobs", {"prompt_logprobs": -1}),
    ("logit_bias", {"logit_bias": {"x": 1}}),
    ("logit_bias", {"logit_bias": {3: 101}}),
])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# ---- a temperature too small to divide by is greedy, not a crash --------------------------------

def test_tiny_temperature_is_greedy():
    logits = _logits()
    # Probe: dividing by such a temperature really overflows (what made multinomial raise).
    assert not torch.isfinite(logits / 1e-40).all()
    for temperature in (1e-40, 5e-324, 9e-6):
        sp = SamplingParams(temperature=temperature, seed=1)
        assert sp.greedy
        out = Sampler()(logits, [sp] * 3, [0, 1, 2])
        assert out.token_ids == logits.argmax(-1).tolist() and not out.errors
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize("field,kwargs", [
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": float("inf")}),
    ("top_p", {"top_p": float("nan")}),
    ("seed", {"seed": 2**64}),
    ("top_k", {"top_k": 2**70}),
    ("max_tokens", {"max_tokens": 2**63}),
    ("stop_token_ids", {"stop_token_ids": [2**64]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
])
def test_non_finite_and_oversized_numbers_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_extreme_but_valid_params_sample():
    logits = _logits(rows=1, vocab=50)
    # top_k beyond the vocabulary is no filter: the same draw as without it.
    sp = SamplingParams(temperature=1.0, seed=11)
    huge_k = SamplingParams(temperature=1.0, seed=11, top_k=2**62)
    assert Sampler()(logits, [huge_k], [0]).token_ids == Sampler()(logits, [sp], [0]).token_ids
    # A vanishing nucleus keeps only the most likely token.
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-300, seed=5)
    assert Sampler()(logits, [tiny_p], [0]).token_ids == [int(logits.argmax())]
    # Seeds at the ends of the 64-bit range draw, reproducibly.
    for seed in (2**63 - 1, -(2**63)):
        edge = SamplingParams(temperature=1.0, seed=seed)
        first = Sampler(seed=1)(logits, [edge], [7])
        again = Sampler(seed=2)(logits, [edge], [7])
        assert not first.errors and first.token_ids == again.token_ids
    # Huge temperatures flatten the distribution without overflowing anything.
    assert not Sampler()(logits, [SamplingParams(temperature=1e30, seed=1)], [0]).errors


# ---- one row's failure stays in that row --------------------------------------------------------

def test_bad_logit_rows_fail_alone():
    logits = _logits(rows=5)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=4),
              SamplingParams(temperature=1.0, seed=9)]
    indices = [0, 1, 2, 3, 4]
    clean = Sampler(seed=0)(logits, params, indices)
    bad = logits.clone()
    bad[0, 7] = float("nan")   # greedy row: argmax alone would pick the NaN's index
    bad[3, 2] = float("inf")   # random row: softmax gives NaN
    bad[4] = 1e35  # finite, but not once divided by the temperature: refused inside the guard
    params[4] = SamplingParams(temperature=1e-4, seed=9)
    bad[1, :10] = float("-inf")  # -inf is a legitimate "never": this row still samples
    out = Sampler(seed=0)(bad, params, indices)
    assert set(out.errors) == {0, 3, 4}
    assert out.token_ids[0] is None and out.token_ids[3] is None and out.token_ids[4] is None
    assert out.token_ids[2] == clean.token_ids[2]
    assert out.token_ids[1] is not None and out.token_ids[1] >= 10
    assert isinstance(out.errors[0], NonFiniteLogits) and isinstance(out.errors[3], NonFiniteLogits)
    assert "sum to nan" in str(out.errors[4])
    # A row of nothing but -inf leaves no token, even for greedy.
    empty = torch.full((1, 50), float("-inf"))
    assert Sampler()(empty, [SamplingParams(temperature=0)], [0]).token_ids == [None]


def test_an_exception_in_one_row_leaves_the_others(monkeypatch):
    logits = _logits(rows=3)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 666, 2)]
    clean = Sampler(seed=0)(logits, params, [0, 0, 0]).token_ids
    # The seeded draw is the one host-side step every seeded row takes on its own.
    real = Sampler._seeded_uniforms
    fired = []

    def faulty(self, out, sp, index):
        if sp.seed == 666:
            fired.append(index)
            raise RuntimeError("injected")
        return real(out, sp, index)

    monkeypatch.setattr(Sampler, "_seeded_uniforms", faulty)
    out = Sampler(seed=0)(logits, params, [0, 0, 0])
    assert fired == [0]
    assert out.token_ids == [clean[0], None, clean[2]]
    assert isinstance(out.errors[1], RuntimeError)
