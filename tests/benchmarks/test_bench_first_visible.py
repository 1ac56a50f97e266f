"""The in-process bench times TTFT to a request's first visible text and tells the engine, as
the API server does: a first token that shows nothing (a special token) does not
count."""

from __future__ import annotations

from transformers import AutoTokenizer

from engine.benchmarks.attainment.runners import FirstVisibleText
from engine.core.request import Request
from engine.outputs import EngineCoreOutput
from engine.sampling_params import SamplingParams


def test_a_special_first_token_is_not_the_first_visible_text(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    special = tokenizer.eos_token_id
    word = tokenizer.encode("hello", add_special_tokens=False)[0]
    assert tokenizer.decode([special], skip_special_tokens=True) == ""  # probe: it is silent
    visible = FirstVisibleText(tokenizer)
    request = Request("r", [word, word], SamplingParams(max_tokens=4), ttft_slo_ms=100.0,
                      reports_first_output=True)
    relaxed = Request("b", [word], SamplingParams(max_tokens=4))  # reports nothing
    visible.add(request)
    visible.add(relaxed)
    out = lambda ids, finish=None: EngineCoreOutput(  # noqa: E731
        req_id="r", new_token_ids=ids, finish_reason=finish)
    assert visible.shown([out([special])], 1.0) == []
    assert visible.shown([out([word])], 2.0) == ["r"] and visible.times == {"r": 2.0}
    assert visible.shown([out([word])], 3.0) == []  # reported once
    silent = Request("s", [word], SamplingParams(max_tokens=1), ttft_slo_ms=100.0,
                     reports_first_output=True)
    visible.add(silent)
    # Finished without any text: nothing more will come, the engine is told all the same.
    assert visible.shown([EngineCoreOutput(req_id="s", new_token_ids=[special],
                                           finish_reason="length")], 4.0) == ["s"]
