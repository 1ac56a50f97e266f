"""Constrained requests survive mid-forward preemption: in every mode (recompute, pause,
suspend), a long constrained prefill that is unwound, a constrained request whose decode row was
in the unwound step, and the constrained urgent request get the same tokens as in a run where
nothing was stopped, and each output is in its grammar's language. The grammar state moves only
on committed tokens (engine.structured_output.matcher), so the unwound step's sampled row,
thrown away with the step, never advanced it. Probes: the step really was unwound, and it held
the decoding request's masked sampling row."""

from __future__ import annotations

import re

import pytest

from engine.core.request import Request
from engine.core.scheduler_output import StepStatus
from engine.runtime.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.structured_output.params import StructuredOutputsParams as Structured
from tests.utils.mid_forward import _engine, _on_long_step, _prompt, _run

CONSTRAINTS = {"long": Structured(regex=r"[a-c]{3,8}-[0-9]{2}"),
               "decoder": Structured(grammar='root ::= "(" [xyz] ("," [xyz])* ")"'),
               "urgent": Structured(choice=["alpha", "beta", "gamma"])}
LANGUAGES = {"long": r"[a-c]{3,8}-[0-9]{2}", "decoder": r"\([xyz](,[xyz])*\)",
             "urgent": r"alpha|beta|gamma"}
# The tiny model's EOS (its config's): the grammar's stop token, the last of each output.
EOS = 2


def _request(req_id: str, prompt: list[int], slo_ms: float | None) -> Request:
    return Request(request_id=req_id, prompt_token_ids=prompt, ttft_slo_ms=slo_ms,
                   eos_token_id=EOS,
                   sampling_params=SamplingParams(temperature=0.0, max_tokens=40,
                                                  structured_outputs=CONSTRAINTS[req_id]))


def _text(model: str, tokens: list[int]) -> str:
    from transformers import AutoTokenizer

    assert tokens and tokens[-1] == EOS, tokens  # the grammar ended it
    return AutoTokenizer.from_pretrained(model).decode(tokens[:-1])


def _start(engine: EngineCore, prompts: dict[str, list[int]]) -> dict[str, Request]:
    """The decoder prefilled and decoding, then the long prompt's first chunk computed."""
    requests = {"decoder": _request("decoder", prompts["decoder"], None)}
    engine.add_request(requests["decoder"])
    engine.step()
    requests["long"] = _request("long", prompts["long"], 60_000)
    engine.add_request(requests["long"])
    engine.step()
    return requests


@pytest.mark.parametrize("mode", ["recompute", "pause", "suspend"])
def test_constrained_outputs_are_unchanged_by_every_preemption_mode(model: str,
                                                                   mode: str) -> None:
    prompts = {"long": _prompt(700, seed=3), "decoder": _prompt(30, seed=5),
               "urgent": _prompt(20, seed=4)}
    reference = _engine(model, slo_preemption=False, max_num_batched_tokens=256)
    try:
        requests = _start(reference, prompts)
        requests["urgent"] = _request("urgent", prompts["urgent"], None)
        reference.add_request(requests["urgent"])
        _run(reference)
        want = {k: r.output_token_ids for k, r in requests.items()}
    finally:
        reference.shutdown()

    engine = _engine(model, slo_preempt_mode=mode, max_num_batched_tokens=256)
    steps: list[tuple] = []
    execute = engine.executor.execute_model

    def recorded(scheduler_output):
        output = execute(scheduler_output)
        steps.append((scheduler_output, output.status))
        return output

    engine.executor.execute_model = recorded
    try:
        requests = _start(engine, prompts)
        assert requests["decoder"].num_output_tokens >= 2  # decoding, under its grammar
        arrived: list[Request] = []

        def arrive() -> None:
            arrived.append(_request("urgent", prompts["urgent"], 200))
            engine.submit_request(arrived[0])

        _on_long_step(engine, layer=1, action=arrive, min_tokens=200)
        _run(engine)
        requests["urgent"] = arrived[0]
        (event,) = engine.slo_preemption.events  # probe: the step really was unwound
        assert event.victim_id == "long" and event.waiter_id == "urgent"
        assert event.applied == mode
        (unwound,) = [s for s, status in steps if status is StepStatus.SLO_PREEMPTED]
        decoder_row = next(r for r in unwound.requests if r.req_id == "decoder")
        assert decoder_row.sample and decoder_row.allowed_token_bitmask is not None
        got = {k: r.output_token_ids for k, r in requests.items()}
    finally:
        engine.shutdown()
    assert got == want
    for name, tokens in got.items():
        assert re.fullmatch(LANGUAGES[name], _text(model, tokens)), (name, tokens)
