"""Structured outputs through the engine (the offline LLM and EngineCore, a tiny seeded model):
every output is in its grammar's language, sampled greedily or at random, and neither a KV
preemption (recompute) nor parallel samples (n > 1) change what a request gets; grammars
compile off the step loop (a request is not scheduled before its grammar is ready, an abort
while it compiles leaves nothing behind, a failed compile refuses only that request); a
simulated engine (`--simulate`) follows the grammar too.

Mid-forward preemption (recompute, pause, suspend) with constrained requests:
tests/preemption/test_structured_preemption.py."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import pytest
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.config import build_engine_config
from engine.core.request import Request, RequestStatus
from engine.runtime.engine_core import EngineCore
from engine.structured_output.params import StructuredOutputsParams as Structured

# Bounded languages: a random tiny model must finish them well within MAX_TOKENS.
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["colour", "ok"]}
CONSTRAINTS = {
    "json": Structured(json=SCHEMA, disable_any_whitespace=True),
    "json-spaced": Structured(json=SCHEMA),
    "regex": Structured(regex=r"[a-c]{2,4}-[0-9]{3}"),
    "choice": Structured(choice=["alpha", "beta", "gamma delta"]),
    "grammar": Structured(grammar='root ::= "(" item ("," item)? ")"\nitem ::= [xyz] | "none"'),
}
MAX_TOKENS = 120


def _in_language(kind: str, text: str) -> bool:
    if kind.startswith("json"):
        value = json.loads(text)
        return set(value) == {"colour", "ok"} and value["colour"] in ("red", "green", "blue") \
            and isinstance(value["ok"], bool)
    if kind == "regex":
        return re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", text) is not None
    if kind == "choice":
        return text in ("alpha", "beta", "gamma delta")
    return re.fullmatch(r"\((?:[xyz]|none)(?:,(?:[xyz]|none))?\)", text) is not None


def _prompts(vocab: int, n: int, seed: int = 0, length: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length + i)] for i in range(n)]


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    # The tokenizer's EOS (a special token, left out of the text), which the tiny model's
    # config otherwise sets to an ordinary one.
    return tiny_model("llama", eos_token_id=0)


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model=model, dtype="float32", block_size=16)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_every_output_is_in_its_grammars_language(llm, kind):
    prompts = _prompts(llm.engine.vocab_size, 3, seed=len(kind))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                            structured_outputs=CONSTRAINTS[kind])
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                             structured_outputs=CONSTRAINTS[kind])
    unconstrained = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for params in (greedy, sampled):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for out in outs:
            (choice,) = out.outputs
            assert choice.finish_reason == "stop", (kind, choice.text)
            assert _in_language(kind, choice.text), (kind, choice.text)
    # Probe: unconstrained, the random model writes nothing of the kind.
    free = llm.generate([{"prompt_token_ids": p} for p in prompts], unconstrained)
    assert not any(_in_language(kind, o.outputs[0].text) if not kind.startswith("json")
                   else o.outputs[0].text.startswith("{") for o in free)


def test_parallel_samples_each_follow_the_grammar_as_a_lone_request_would(llm):
    prompt = _prompts(llm.engine.vocab_size, 1, seed=3)[0]
    params = SamplingParams(temperature=1.0, seed=21, n=4, max_tokens=MAX_TOKENS,
                            structured_outputs=CONSTRAINTS["grammar"])
    (together,) = llm.generate([{"prompt_token_ids": prompt}], params)
    texts = [c.text for c in together.outputs]
    assert all(_in_language("grammar", t) for t in texts)
    assert len(set(texts)) > 1  # probe: the samples really differ (each its own state)
    alone = [llm.generate([{"prompt_token_ids": prompt}], params.child(i))[0].outputs[0].text
             for i in range(4)]
    assert texts == alone


# Long enough outputs that six requests outgrow a 24-block pool while they decode.
LONG = {"regex": Structured(regex=r"[a-c]{50,60}-[0-9]{3}"),
        "json": Structured(json={"type": "object", "required": ["s"], "properties": {
            "s": {"type": "string", "pattern": "^[a-z ]{50,60}$"}}})}


def test_kv_preemption_changes_no_constrained_output(model):
    roomy = LLM(model=model, dtype="float32", num_kv_blocks=512, max_model_len=256)
    cramped = LLM(model=model, dtype="float32", num_kv_blocks=24, max_model_len=256)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, roomy.engine.vocab_size) for _ in range(n)]
               for n in (100, 90, 80, 70, 60, 50)]
    kinds = ["regex", "json"] * 3
    params = [SamplingParams(temperature=t, seed=3, max_tokens=MAX_TOKENS,
                             structured_outputs=LONG[k])
              for k, t in zip(kinds, [0, 0, 1.0, 1.0, 0, 1.0])]
    requests = [{"prompt_token_ids": p} for p in prompts]
    want, got = roomy.generate(requests, params), cramped.generate(requests, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for kind, out in zip(kinds, got):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        assert (re.fullmatch(r"[a-c]{50,60}-[0-9]{3}", text) if kind == "regex"
                else re.fullmatch(r"[a-z ]{50,60}", json.loads(text)["s"])), text
    # Probe: the cramped pool really recomputed constrained requests mid-output.
    assert sum(o.metrics.num_kv_preemptions for o in got) > 0
    assert sum(o.metrics.num_kv_preemptions for o in want) == 0


def _engine(model: str, **overrides) -> EngineCore:
    return EngineCore(build_engine_config(model, device="cpu", dtype="float32",
                                          num_kv_blocks=64, block_size=16, **overrides))


def _request(req_id: str, prompt: list[int], constraint: Structured | None,
             eos: int | None = 0) -> Request:
    return Request(request_id=req_id, prompt_token_ids=prompt, eos_token_id=eos,
                   ttft_slo_ms=5_000,
                   sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  structured_outputs=constraint))


def _run(engine: EngineCore, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        engine.step()


def test_a_request_waits_for_its_grammar_off_the_step_loop(model, monkeypatch):
    engine = _engine(model)
    try:
        release = threading.Event()
        compiled_on: list[str] = []
        compile_for_vocabulary = engine.grammars.compile

        def slow_compile(params):
            compiled_on.append(threading.current_thread().name)
            release.wait(30)
            return compile_for_vocabulary(params)

        monkeypatch.setattr(engine.grammars, "compile", slow_compile)
        woken = threading.Event()
        engine.wake = woken.set
        prompts = _prompts(engine.vocab_size, 2, seed=9)
        constrained = _request("constrained", prompts[0], CONSTRAINTS["choice"])
        plain = _request("plain", prompts[1], None)
        arrival = constrained.arrival_time
        engine.submit_request(constrained)
        engine.submit_request(plain)
        _run(engine)  # the plain request is served while the grammar compiles
        assert plain.is_finished and plain.num_output_tokens > 0
        assert engine.scheduler.get_request("constrained") is None and not woken.is_set()
        assert compiled_on and compiled_on[0].startswith("sloserve-grammar")
        release.set()
        assert woken.wait(30)  # the grammar thread handed it over and woke the loop
        _run(engine)
        assert constrained.is_finished and _in_language("choice", _text(model, constrained))
        # Its deadline counted from its arrival, not from the end of the compile.
        assert constrained.arrival_time == arrival
        assert constrained.first_token_time > plain.finish_time
    finally:
        engine.shutdown()


def test_an_abort_while_compiling_and_a_failed_compile_touch_nothing_else(model, monkeypatch):
    engine = _engine(model)
    try:
        release = threading.Event()
        compile_for_vocabulary = engine.grammars.compile

        def compile_or_fail(params):
            release.wait(30)
            if params.regex == "FAIL":
                raise ValueError("structured outputs: the regex is not valid: probe")
            return compile_for_vocabulary(params)

        monkeypatch.setattr(engine.grammars, "compile", compile_or_fail)
        handed = threading.Semaphore(0)
        engine.wake = handed.release
        prompts = _prompts(engine.vocab_size, 3, seed=11)
        aborted = _request("aborted", prompts[0], CONSTRAINTS["regex"])
        failing = _request("failing", prompts[1], Structured(regex="FAIL"))
        served = _request("served", prompts[2], CONSTRAINTS["regex"])
        for request in (aborted, failing, served):
            engine.submit_request(request)
        engine.abort_requests(["aborted"])
        release.set()
        assert handed.acquire(timeout=30) and handed.acquire(timeout=30)  # failing, served
        assert not handed.acquire(timeout=0.5)  # the aborted one never wakes the loop
        _run(engine)
        assert engine.take_rejected() == [("failing",
                                           "structured outputs: the regex is not valid: probe")]
        assert served.is_finished and _in_language("regex", _text(model, served))
        assert aborted.num_output_tokens == 0 and engine.scheduler.get_request("aborted") is None
        engine.scheduler.check_invariants()
    finally:
        engine.shutdown()


def test_a_simulated_engine_follows_the_grammar(sim_model):
    engine = EngineCore(build_engine_config(sim_model, simulate="h100-llama-3.1-8b",
                                            max_model_len=4096))
    try:
        tokenizer = AutoTokenizer.from_pretrained(sim_model)
        requests = [_request(f"r{i}", _prompts(len(tokenizer), 1, seed=i, length=40)[0],
                             CONSTRAINTS[kind], eos=tokenizer.eos_token_id)
                    for i, kind in enumerate(["json", "regex", "choice"])]
        for request in requests:
            engine.add_request(request)
        _run(engine)
        for request, kind in zip(requests, ["json", "regex", "choice"]):
            assert request.status.finish_reason == "stop"
            text = tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
            assert _in_language(kind, text), (kind, text)
    finally:
        engine.shutdown()


def _text(model: str, request: Request) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model)
    return tokenizer.decode(request.output_token_ids, skip_special_tokens=True)


def test_a_token_the_grammar_refuses_fails_that_request_alone(model):
    """Scheduler.update_from_output's check: a sampled token outside the step's mask (a bug
    between the mask and the grammar, forced here) ends that request with an error."""
    engine = _engine(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
        refused = tokenizer.encode("z", add_special_tokens=False)[0]
        execute = engine.executor.execute_model

        def tampered(scheduler_output):
            output = execute(scheduler_output)
            if "bad" in output.sampled_token_ids:
                output.sampled_token_ids["bad"] = refused
            return output

        engine.executor.execute_model = tampered
        prompts = _prompts(engine.vocab_size, 2, seed=13)
        bad = _request("bad", prompts[0], CONSTRAINTS["choice"])
        good = _request("good", prompts[1], CONSTRAINTS["choice"])
        engine.add_request(bad)
        engine.add_request(good)
        _run(engine)
        assert bad.status is RequestStatus.FINISHED_ERROR and bad.num_output_tokens == 0
        assert bad.error == f"structured outputs: the grammar refused sampled token {refused}"
        assert good.status.finish_reason == "stop" and _in_language("choice", _text(model, good))
        engine.scheduler.check_invariants()
        assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.model.num_blocks
    finally:
        engine.shutdown()


def test_prepare_describes_the_vocabulary_before_any_constrained_request(model, caplog):
    """On the H100 the first schema took 2.3 s, most of it describing Llama 3's 128k tokens.
    `prepare` builds the description on the grammar thread ahead of any request (a server's
    engine process does before it reports ready: tests/entrypoints/test_structured_outputs_http)."""
    import logging

    engine = _engine(model)
    try:
        assert not engine.grammars.prepared  # probe: nothing built it by itself
        with caplog.at_level(logging.INFO, logger="engine.structured_output.compiler"):
            engine.grammars.prepare().result(60)
        assert engine.grammars.prepared and not engine.has_unfinished_requests()
        assert "the vocabulary's description" in caplog.text
    finally:
        engine.shutdown()
