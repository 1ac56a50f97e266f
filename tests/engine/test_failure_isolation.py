"""A failure that belongs to one request finishes that request with an error; the engine, and the
other requests in the same batch, go on exactly as if it had not been there."""

from __future__ import annotations

import multiprocessing
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.processing.detokenizer import IncrementalDetokenizer
from engine.outputs import EngineCoreOutput
from engine.processing.output_processor import OutputProcessor
from workers.sample.sampler import Sampler

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
FAULTY_SEED = 666  # marks the request whose sampling the tests break


@pytest.fixture(scope="module")
def llm(tiny_model):
    llm = LLM(model=tiny_model("llama"), dtype="float32", max_model_len=256)
    yield llm
    llm.shutdown()


def _all_blocks_free(llm: LLM) -> bool:
    return llm.engine.scheduler.kv_cache_manager.num_free_blocks == llm.engine.model.num_blocks


def _prompts(n: int, seed: int, avoid: int | None = None, length: int = 20) -> list[dict]:
    rng = random.Random(seed)
    choices = [t for t in range(3, 390) if t != avoid]
    return [{"prompt_token_ids": rng.sample(choices, length + 7 * i)} for i in range(n)]


# ---- bad sampling parameters --------------------------------------------------------------------

def test_tiny_temperature_runs_greedy_and_engine_survives(llm):
    prompts = _prompts(3, seed=1)
    want = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    tiny = SamplingParams(temperature=1e-40, max_tokens=12, ignore_eos=True)
    got = llm.generate(prompts, tiny)
    assert [o.token_ids for o in got] == want
    assert all(o.finish_reason == "length" for o in got)
    assert _all_blocks_free(llm)


@pytest.mark.parametrize("kwargs,field", [({"temperature": float("nan")}, "temperature"),
                                          ({"top_p": float("nan")}, "top_p"),
                                          ({"seed": 2**64}, "seed")])
def test_non_finite_params_are_refused_before_anything_runs(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(_prompts(1, seed=2), SamplingParams(max_tokens=4, **kwargs))
    (out,) = llm.generate(_prompts(1, seed=2), GREEDY)
    assert out.finish_reason == "length" and _all_blocks_free(llm)


# ---- a fault in one request's sampling ----------------------------------------------------------

def test_sampling_fault_fails_only_its_request(llm, monkeypatch, caplog):
    prompts = _prompts(4, seed=3)
    params = [GREEDY, SamplingParams(temperature=1.0, seed=FAULTY_SEED, max_tokens=12,
                                     ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True), GREEDY]
    clean = [prompts[i] for i in (0, 2, 3)]
    want = llm.generate(clean, [params[i] for i in (0, 2, 3)])

    real = Sampler._seeded_uniforms  # the seeded row's own draw, made on the host
    fired: list[int] = []

    def faulty(self, out, sp, index):
        if sp.seed == FAULTY_SEED and index == 3:  # mid-decode, after three good tokens
            fired.append(index)
            raise RuntimeError("injected sampling fault")
        return real(out, sp, index)

    monkeypatch.setattr(Sampler, "_seeded_uniforms", faulty)
    got = llm.generate(prompts, params)
    assert fired == [3]  # probe: the fault really fired, once
    failed = got[1]
    assert failed.finish_reason == "error" and len(failed.token_ids) == 3
    assert failed.error == "sampling failed: RuntimeError: injected sampling fault"
    assert [o.token_ids for o in (got[0], got[2], got[3])] == [o.token_ids for o in want]
    assert all(o.finish_reason == "length" for o in (got[0], got[2], got[3]))
    assert _all_blocks_free(llm)
    assert any("injected sampling fault" in r.exc_text for r in caplog.records
               if r.exc_text and failed.request_id in r.getMessage())
    # The engine keeps serving.
    assert llm.generate(clean[:1], GREEDY)[0].token_ids == want[0].token_ids


# ---- a fault while detokenizing / matching stop strings (the API side) --------------------------

_MARKER = "\x00poison-stop"  # a stop string that marks the request whose stop check breaks


def _faulty_stop_check(real):
    fired: list[int] = []

    def check(self, delta_len):
        if _MARKER in self._stop:
            fired.append(delta_len)
            raise UnicodeError("injected detokenizer fault")
        return real(self, delta_len)

    return check, fired


def test_output_processor_fails_one_request_and_processes_the_rest(llm, monkeypatch):
    check, fired = _faulty_stop_check(IncrementalDetokenizer._check_stop)
    monkeypatch.setattr(IncrementalDetokenizer, "_check_stop", check)
    processor = OutputProcessor(llm.tokenizer)
    for req_id, stop in (("a", ["zzz"]), ("b", [_MARKER]), ("c", [])):
        processor.add_request(req_id, None, [5, 6, 7], SamplingParams(stop=stop), 0.0)
    token_ids = llm.tokenizer.encode("hello world", add_special_tokens=False)
    step = [EngineCoreOutput(req_id=r, new_token_ids=token_ids) for r in ("a", "b", "c")]
    result = processor.process(step)
    assert fired  # probe: b's stop check ran and raised
    assert result.failed == ["b"] and result.stopped == []
    by_id = {o.request_id: o for o in result.outputs}
    assert by_id["b"].finished and by_id["b"].finish_reason == "error"
    assert by_id["b"].error == "detokenization failed: UnicodeError: injected detokenizer fault"
    expected = llm.tokenizer.decode([5, 6, 7, *token_ids])[len(llm.tokenizer.decode([5, 6, 7])):]
    assert by_id["a"].text == by_id["c"].text == expected
    assert not by_id["a"].finished and not by_id["c"].finished
    assert processor.num_unfinished == 2  # b is forgotten; a later output for it is ignored
    late = processor.process([EngineCoreOutput(req_id="b", new_token_ids=[9]),
                              EngineCoreOutput(req_id="a", new_token_ids=[9])])
    assert [o.request_id for o in late.outputs] == ["a"]


def test_detokenizer_fault_in_generate_fails_one_request_and_frees_its_kv(llm, monkeypatch):
    prompts = _prompts(3, seed=4)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = llm.generate([prompts[0], prompts[2]], long)
    check, fired = _faulty_stop_check(IncrementalDetokenizer._check_stop)
    monkeypatch.setattr(IncrementalDetokenizer, "_check_stop", check)
    marked = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[_MARKER])
    got = llm.generate(prompts, [long, marked, long])
    assert fired  # probe: the fault fired
    assert got[1].finish_reason == "error" and "injected detokenizer fault" in got[1].error
    # It failed early, so the core was still running it: all blocks free means it was aborted.
    assert len(got[1].token_ids) < 40
    assert [got[0].token_ids, got[2].token_ids] == [o.token_ids for o in want]
    assert _all_blocks_free(llm)


# ---- a bad logits row from the model itself, also across TP ranks -------------------------------

POISON = 77  # this token's input embedding is NaN in the poisoned model


@pytest.fixture(scope="module")
def poisoned_model(tiny_model, tmp_path_factory) -> str:
    """A model whose forward pass yields NaN for any request that contains POISON and for no
    other (untied, so the LM head stays finite)."""
    path = tmp_path_factory.mktemp("poisoned")
    shutil.copytree(tiny_model("mistral"), path, dirs_exist_ok=True)
    weights_file = Path(path) / "model.safetensors"
    weights = load_file(str(weights_file))
    weights["model.embed_tokens.weight"][POISON] = float("nan")
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    return str(path)


def _poison_batch() -> tuple[list[dict], list[int]]:
    """Clean prompts (no POISON) and, interleaved, prompts with POISON in the middle."""
    clean = _prompts(5, seed=6, avoid=POISON, length=30)
    poisoned = [{"prompt_token_ids": p["prompt_token_ids"][:9] + [POISON]
                 + p["prompt_token_ids"][9:]} for p in _prompts(2, seed=7, avoid=POISON)]
    batch = clean[:2] + poisoned[:1] + clean[2:4] + poisoned[1:] + clean[4:]
    return batch, [2, 5]


# Chunked prefill and a pool small enough that the failed requests' blocks are reused.
POISON_ENGINE = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=48,
                     num_kv_blocks=40, watermark=0.0)


def _check_poison_run(llm: LLM, want: list[list[int]]) -> None:
    batch, bad = _poison_batch()
    got = llm.generate(batch, GREEDY)
    for i, out in enumerate(got):
        if i in bad:
            assert out.finish_reason == "error" and out.token_ids == []
            assert out.error == ("sampling failed: NonFiniteLogits: the model produced "
                                 "non-finite logits (NaN or inf) for this request")
    clean = [o for i, o in enumerate(got) if i not in bad]
    assert [o.token_ids for o in clean] == want
    assert all(o.finish_reason == "length" for o in clean)
    # The failed requests' blocks (holding NaN) go back to the pool and are reused without
    # leaking into anyone else's output.
    again = llm.generate([b for i, b in enumerate(batch) if i not in bad] * 2, GREEDY)
    assert [o.token_ids for o in again] == want * 2


@pytest.fixture(scope="module")
def poison_reference(poisoned_model) -> list[list[int]]:
    batch, bad = _poison_batch()
    llm = LLM(model=poisoned_model, **POISON_ENGINE)
    try:
        outs = llm.generate([b for i, b in enumerate(batch) if i not in bad], GREEDY)
        # Probe: the poisoned request really yields NaN logits (the engine ran the model).
        runner = llm.engine.executor.runner
        ids = torch.tensor(batch[bad[0]]["prompt_token_ids"])
        assert torch.isnan(runner.model.model.embed_tokens(ids)).any()
    finally:
        llm.shutdown()
    assert all(o.finish_reason == "length" for o in outs)
    return [o.token_ids for o in outs]


def test_nan_logits_fail_only_their_requests(poisoned_model, poison_reference):
    llm = LLM(model=poisoned_model, **POISON_ENGINE)
    try:
        _check_poison_run(llm, poison_reference)
        assert _all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_nan_logits_fail_only_their_requests_at_tp2(poisoned_model, poison_reference):
    """Only rank 0 samples, so a request that fails there leaves the ranks in step: the same
    group keeps serving and its outputs equal TP=1's."""
    llm = LLM(model=poisoned_model, tensor_parallel_size=2, **POISON_ENGINE)
    try:
        _check_poison_run(llm, poison_reference)
        assert _all_blocks_free(llm)
        assert all(p.is_alive() for p in llm.engine.executor._procs)
    finally:
        llm.shutdown()
    assert not multiprocessing.active_children()


def test_server_fails_only_the_poisoned_request(poisoned_model, poison_reference, tmp_path):
    """End to end through `sloserve serve`: the poisoned request gets an OpenAI-shaped error
    (streamed or not) with no traceback, the server log has the traceback under its request id,
    and the same server then serves a clean request exactly as the offline engine did."""
    import httpx

    from tests.utils.server_helpers import ServerProcess, collect_stream, sse_data

    batch, bad = _poison_batch()
    server = ServerProcess(poisoned_model, tmp_path / "server.log")
    try:
        body = {"prompt": batch[bad[0]]["prompt_token_ids"],
                "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert plain.status_code == 500
        error = plain.json()["error"]
        assert error["message"] and "Traceback" not in plain.text
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as response:
            streamed = collect_stream(sse_data(response.iter_lines()))
        assert streamed["error"] is not None and streamed["done"]
        assert "Traceback" not in str(streamed["error"])
        # Probe: the failures were the sampler's, logged with their traceback in EngineCore.
        log = server.log(tail=200_000)
        # (The startup calibration's random prompts may hold POISON too: not counted.)
        failed = [line for line in log.splitlines()
                  if "sampling failed; the request is finished with an error" in line
                  and "startup-calibration" not in line]
        assert len(failed) == 2
        assert "NonFiniteLogits" in log and "Traceback" in log
        clean = {**body, "prompt": batch[0]["prompt_token_ids"]}
        ok = httpx.post(f"{server.url}/v1/completions", json=clean, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        assert ok.json()["usage"]["completion_tokens"] == len(poison_reference[0])
        stats, _ = server.wait_all_blocks_free()
        assert stats["num_free_blocks"] == stats["num_blocks"]
    finally:
        code, _, left = server.stop()
    assert code in (0, -15) and not left
