"""The offline API as a user drives it: text prompts, stops, bad input, the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=tiny_model("llama"), dtype="float32", max_model_len=512)


def test_text_prompt_roundtrip(llm):
    (out,) = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=8,
                                                                ignore_eos=True))
    assert len(out.token_ids) == 8
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time
    assert m.num_preemptions == m.num_kv_preemptions == m.num_slo_preemptions == 0


def test_max_tokens_and_stop_token_ids(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (ref,) = llm.generate("Paris is", greedy)
    stop_at = ref.token_ids[5]
    first = ref.token_ids.index(stop_at)
    (out,) = llm.generate("Paris is", SamplingParams(temperature=0, max_tokens=12,
                                                     ignore_eos=True, stop_token_ids=[stop_at]))
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_string(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (ref,) = llm.generate("Deadlines matter", greedy)
    text = ref.text.strip()
    assert len(text) > 4, "the tiny model should produce some text to stop on"
    stop = text[2:4]
    (out,) = llm.generate("Deadlines matter", SamplingParams(temperature=0, max_tokens=24,
                                                             ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == ref.text[: ref.text.index(stop)]
    assert len(out.token_ids) < len(ref.token_ids)


def test_eos_finishes(llm, tiny_model):
    # Make the EOS the token the model greedily produces at step 3.
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    (ref,) = llm.generate("Hello", greedy)
    saved, llm.inputs.eos_token_ids = llm.inputs.eos_token_ids, [ref.token_ids[3]]
    try:
        (out,) = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10))
    finally:
        llm.inputs.eos_token_ids = saved
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[: ref.token_ids.index(ref.token_ids[3]) + 1]


def test_max_model_len_bounds_generation(tiny_model):
    """The exact fit runs to the context's last position; one token more is refused (vLLM's
    message, tests/entrypoints/test_context_limit.py)."""
    small = LLM(model=tiny_model("llama"), dtype="float32", max_model_len=40)
    prompt = {"prompt_token_ids": list(range(1, 31))}
    (out,) = small.generate(prompt, SamplingParams(temperature=0, max_tokens=10,
                                                   ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    with pytest.raises(ValueError, match=r"maximum context length is 40 tokens\. However, you "
                                         r"requested 41 tokens \(30 in the prompt, 11 in"):
        small.generate(prompt, SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))


@pytest.mark.parametrize("prompt,params,field", [
    ("", None, "empty"),
    ({"prompt_token_ids": []}, None, "empty"),
    ({"prompt_token_ids": list(range(1, 600))}, None, "max_model_len"),
    ({"prompt_token_ids": [1, 10**6]}, None, "vocabulary"),
])
def test_bad_prompt_rejected_and_engine_keeps_serving(llm, prompt, params, field):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=field):
        llm.generate([good, prompt], params)
    assert not llm.engine.has_unfinished_requests()  # the good one was not stranded
    (out,) = llm.generate(good, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p")])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unsupported_architecture_is_refused(tmp_path, tiny_model):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    config = json.loads((Path(tiny_model("llama")) / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=str(folder))


def test_pool_too_small_for_max_model_len(tiny_model):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=tiny_model("llama"), dtype="float32", max_model_len=512, num_kv_blocks=8)


def test_cli_generate(tiny_model):
    cmd = [sys.executable, "-m", "engine", "generate", "The quick brown", "--model",
           tiny_model("llama"), "--dtype", "float32", "--no-chat", "--max-tokens", "5"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "finish_reason=" in result.stderr


def test_cli_bad_input_is_a_clear_error(tiny_model):
    cmd = [sys.executable, "-m", "engine", "generate", "hi", "--model", tiny_model("llama"),
           "--temperature", "-2", "--no-chat"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "temperature" in result.stderr and "Traceback" not in result.stderr
