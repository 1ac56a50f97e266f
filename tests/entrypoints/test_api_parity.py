"""OpenAI / vLLM API parity through a real server and the `openai` SDK: logprobs (checked
against a direct log-softmax of the Hugging Face model's logits), chat top_logprobs, echo with
prompt logprobs, prompt lists, n > 1 sharing the prompt's KV, the sampling parameters, streaming
and not, and a 400 for each bad value."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.utils.server_helpers import ServerProcess, copy_with_chat_template, sample, scrape

MAX_MODEL_LEN = 256
BLOCK_SIZE = 4
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    return copy_with_chat_template(tiny_model("llama", max_position_embeddings=MAX_MODEL_LEN),
                                   tmp_path_factory.mktemp("parity") / "tiny-chat")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    server = ServerProcess(model_dir, tmp_path_factory.mktemp("log") / "server.log",
                           "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "256",
                           "--max-model-len", str(MAX_MODEL_LEN))
    yield server
    server.assert_clean_stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    """token ids -> log-softmax of the HF model's logits at every position [len, vocab]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def _model(client) -> str:
    return client.models.list().data[0].id


def _as_ids(tokens: list[str | None]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens if t is not None]


def _check_position(entry_logprob: float, top: dict, token: int, want: torch.Tensor, k: int
                    ) -> None:
    assert entry_logprob == pytest.approx(want[token].item(), abs=1e-4)
    assert len(top) in (k, k + 1)  # the top k, plus the chosen token when not among them
    best = sorted(top.values(), reverse=True)[:k]
    assert best == pytest.approx(want.topk(k).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completion_logprobs_equal_the_model_s_log_softmax(client, tokenizer, reference,
                                                           temperature):
    k = 3
    kwargs = dict(model=_model(client), prompt=PROMPT, max_tokens=6, temperature=temperature,
                  seed=5, logprobs=k, extra_body={"return_tokens_as_token_ids": True})
    choice = client.completions.create(**kwargs).choices[0]
    lp = choice.logprobs
    output_ids = _as_ids(lp.tokens)
    assert len(output_ids) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    prompt_ids = _ids(tokenizer, PROMPT)
    ref = reference(prompt_ids + output_ids)
    for i, token in enumerate(output_ids):
        top = {int(t.removeprefix("token_id:")): v for t, v in lp.top_logprobs[i].items()}
        # temperature 1: the logprobs after temperature are the model's own.
        _check_position(lp.token_logprobs[i], lp.top_logprobs[i], token,
                        ref[len(prompt_ids) - 1 + i], k)
        assert token in top
    # Streaming carries the same logprobs, chunk by chunk.
    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = [v for c in chunks for ch in c.choices if ch.logprobs
                for v in ch.logprobs.token_logprobs]
    offsets = [v for c in chunks for ch in c.choices if ch.logprobs
               for v in ch.logprobs.text_offset]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert offsets == lp.text_offset
    assert "".join(ch.text for c in chunks for ch in c.choices) == choice.text


def test_logprobs_after_temperature(client, tokenizer, reference):
    done = client.completions.create(model=_model(client), prompt=PROMPT, max_tokens=3,
                                     temperature=0.5, seed=1, logprobs=0,
                                     extra_body={"return_tokens_as_token_ids": True})
    lp = done.choices[0].logprobs
    prompt_ids = _ids(tokenizer, PROMPT)
    output_ids = _as_ids(lp.tokens)
    # Log-probabilities differ from the logits by a constant per row: the same after softmax.
    ref_logits = reference(prompt_ids + output_ids)
    for i, token in enumerate(output_ids):
        scaled = torch.log_softmax(ref_logits[len(prompt_ids) - 1 + i] / 0.5, -1)
        assert lp.token_logprobs[i] == pytest.approx(scaled[token].item(), abs=1e-4)


def test_chat_top_logprobs(client, model_dir, reference):
    messages = [{"role": "user", "content": "say something"}]
    kwargs = dict(model=_model(client), messages=messages, max_tokens=4, temperature=0,
                  logprobs=True, top_logprobs=2,
                  extra_body={"return_tokens_as_token_ids": True})
    done = client.chat.completions.create(**kwargs)
    content = done.choices[0].logprobs.content
    assert len(content) == 4
    prompt_ids = httpx.post(f"{str(client.base_url).removesuffix('/v1/')}/tokenize",
                            json={"messages": messages}, timeout=30).json()["tokens"]
    output_ids = _as_ids([c.token for c in content])
    ref = reference(list(prompt_ids) + output_ids)
    for i, entry in enumerate(content):
        top = {t.token: t.logprob for t in entry.top_logprobs}
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        _check_position(entry.logprob, top, output_ids[i], ref[len(prompt_ids) - 1 + i], 2)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [e.logprob for c in chunks for ch in c.choices if ch.logprobs
                for e in ch.logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-4)
    # Without logprobs: none, as before.
    plain = client.chat.completions.create(model=_model(client), messages=messages,
                                           max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_scores_the_prompt(client, tokenizer, reference, max_tokens):
    prompt_ids = _ids(tokenizer, PROMPT)
    done = client.completions.create(model=_model(client), prompt=PROMPT, max_tokens=max_tokens,
                                     temperature=0, echo=True, logprobs=1,
                                     extra_body={"return_tokens_as_token_ids": True})
    choice = done.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(prompt_ids) + max_tokens
    assert _as_ids(lp.tokens[:len(prompt_ids)]) == prompt_ids
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ids = _as_ids(lp.tokens)
    ref = reference(ids)
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
    assert done.usage.prompt_tokens == len(prompt_ids)
    assert done.usage.completion_tokens == max_tokens
    if max_tokens == 0:
        assert choice.text == PROMPT and choice.finish_reason == "length"
    streamed = list(client.completions.create(model=_model(client), prompt=PROMPT,
                                              max_tokens=max_tokens, temperature=0, echo=True,
                                              logprobs=1, stream=True))
    text = "".join(ch.text for c in streamed for ch in c.choices)
    scores = [v for c in streamed for ch in c.choices if ch.logprobs
              for v in ch.logprobs.token_logprobs]
    assert text == choice.text
    assert scores[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def test_vllm_prompt_logprobs(client, tokenizer, reference):
    prompt_ids = _ids(tokenizer, PROMPT)
    body = httpx.post(f"{client.base_url}completions",
                      json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2},
                      timeout=60).json()
    scores = body["choices"][0]["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(prompt_ids)
    ref = reference(prompt_ids)
    for j in range(1, len(prompt_ids)):
        entry = scores[j][str(prompt_ids[j])]
        assert entry["logprob"] == pytest.approx(ref[j - 1, prompt_ids[j]].item(), abs=1e-4)
        assert entry["rank"] == int((ref[j - 1] > ref[j - 1, prompt_ids[j]]).sum()) + 1
        assert len(scores[j]) in (2, 3)


def test_prompt_lists_give_one_choice_per_prompt(client, tokenizer):
    texts = ["hello there", "a different prompt", "third"]
    alone = [client.completions.create(model=_model(client), prompt=t, max_tokens=4,
                                       temperature=0).choices[0].text for t in texts]
    listed = client.completions.create(model=_model(client), prompt=texts, max_tokens=4,
                                       temperature=0)
    assert [c.index for c in listed.choices] == [0, 1, 2]
    assert [c.text for c in listed.choices] == alone
    ids = [_ids(tokenizer, t) for t in texts]
    by_ids = client.completions.create(model=_model(client), prompt=ids, max_tokens=4,
                                       temperature=0)
    assert [c.text for c in by_ids.choices] == alone
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))
    streamed = list(client.completions.create(model=_model(client), prompt=texts,
                                              max_tokens=4, temperature=0, stream=True))
    joined = {i: "".join(ch.text for c in streamed for ch in c.choices if ch.index == i)
              for i in range(3)}
    assert [joined[i] for i in range(3)] == alone


def test_n_samples_share_the_prompt_s_kv(client, server, tokenizer):
    prompt = PROMPT + " and then some more words to fill several blocks"
    num_prompt = len(_ids(tokenizer, prompt))
    _, before = scrape(server.url)
    done = client.completions.create(model=_model(client), prompt=prompt, max_tokens=5,
                                     temperature=1.0, seed=7, n=3)
    _, after = scrape(server.url)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert len({c.text for c in done.choices}) > 1  # seeded apart: seed + index
    again = client.completions.create(model=_model(client), prompt=prompt, max_tokens=5,
                                      temperature=1.0, seed=7, n=3)
    assert [c.text for c in again.choices] == [c.text for c in done.choices]
    # The prompt was computed once: both later samples found its full blocks in the cache
    # (a fresh prompt: nothing of it was cached before this request).
    hits = sample(after, "sloserve:prefix_cache_hits_total") - \
        sample(before, "sloserve:prefix_cache_hits_total")
    assert hits >= 2 * ((num_prompt - 1) // BLOCK_SIZE) * BLOCK_SIZE > 0
    assert done.usage.prompt_tokens == num_prompt
    assert done.usage.completion_tokens == 15
    streamed = list(client.completions.create(model=_model(client), prompt=prompt, max_tokens=5,
                                              temperature=1.0, seed=7, n=3, stream=True))
    texts = {i: "".join(ch.text for c in streamed for ch in c.choices if ch.index == i)
             for i in range(3)}
    assert [texts[i] for i in range(3)] == [c.text for c in done.choices]
    chat = client.chat.completions.create(model=_model(client), n=2, max_tokens=3,
                                          messages=[{"role": "user", "content": "hi"}])
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop_token_ids_include_stop_str_and_special_tokens(client, tokenizer):
    base = client.completions.create(model=_model(client), prompt=PROMPT, max_tokens=8,
                                     temperature=0, logprobs=0,
                                     extra_body={"return_tokens_as_token_ids": True})
    ids = _as_ids(base.choices[0].logprobs.tokens)
    stopped = client.completions.create(model=_model(client), prompt=PROMPT, max_tokens=8,
                                        temperature=0, extra_body={"stop_token_ids": [ids[2]]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].stop_reason == ids[2] if hasattr(stopped.choices[0],
                                                                "stop_reason") else True
    assert stopped.usage.completion_tokens == ids.index(ids[2]) + 1
    text = base.choices[0].text
    stop = text[3:5]
    cut = client.completions.create(model=_model(client), prompt=PROMPT, max_tokens=8,
                                    temperature=0, stop=[stop])
    kept = client.completions.create(model=_model(client), prompt=PROMPT, max_tokens=8,
                                     temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].text == text[:text.index(stop)]
    assert kept.choices[0].text == text[:text.index(stop) + len(stop)]


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(
        model=_model(client), prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_text = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_text)
    counts = [c.usage.completion_tokens for c in with_text]
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1].usage.completion_tokens == 4
    plain = list(client.completions.create(model=_model(client), prompt=PROMPT, max_tokens=4,
                                           stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices)  # probe: only when asked


BAD = [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 30}, "prompt_logprobs"),
    ({"n": 0}, "n"),
    ({"n": 100, "prompt": ["a", "b"]}, "n"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"prompt": []}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
]


def test_bad_values_are_400s_naming_the_field(client):
    url = f"{client.base_url}completions"
    for extra, field in BAD:
        response = httpx.post(url, json={"prompt": PROMPT, "max_tokens": 4, **extra}, timeout=30)
        assert response.status_code == 400, (extra, response.text)
        assert field in response.json()["error"]["message"], (extra, response.text)
    chat = httpx.post(f"{client.base_url}chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
    assert chat.status_code == 400 and "top_logprobs" in chat.json()["error"]["message"]
    too_many = httpx.post(f"{client.base_url}chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 25})
    assert too_many.status_code == 400
    assert "top_logprobs must be in [0, 20]" in too_many.json()["error"]["message"]
    # Probe: the server still serves.
    assert client.completions.create(model=_model(client), prompt="x", max_tokens=1).choices


def test_best_of(client):
    kwargs = dict(model=_model(client), prompt=PROMPT, max_tokens=4, temperature=1.0, seed=3)
    drawn = [client.completions.create(**{**kwargs, "seed": 3 + i}, logprobs=0).choices[0]
             for i in range(3)]
    best = client.completions.create(**kwargs, best_of=3, n=2)
    ranked = sorted(drawn, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 12  # every sample drawn
    streamed = httpx.post(f"{client.base_url}completions", timeout=30,
                          json={"prompt": PROMPT, "best_of": 2, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "best_of"


@pytest.mark.parametrize("penalty", [{"presence_penalty": -2.0}, {"frequency_penalty": -1.0},
                                     {"repetition_penalty": 0.3},
                                     {"logit_bias": {"7": 4.0, "42": -3.0}},
                                     {"min_tokens": 3, "stop_token_ids": None}])
def test_penalties_over_http_match_the_reference(client, model_dir, tokenizer, penalty):
    from engine.sampling_params import SamplingParams
    from tests.utils.sampling_reference import _reference_greedy

    prompt = [5, 17, 42, 42, 99, 3, 17, 250, 8, 8, 61]
    kwargs = dict(prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
                  return_tokens_as_token_ids=True)
    plain = httpx.post(f"{client.base_url}completions", json=kwargs, timeout=60).json()
    plain_ids = _as_ids(plain["choices"][0]["logprobs"]["tokens"])
    if "stop_token_ids" in penalty:  # min_tokens: hold back the first greedy token as a stop
        penalty = {**penalty, "stop_token_ids": [plain_ids[0]]}
    body = httpx.post(f"{client.base_url}completions", json={**kwargs, **penalty},
                      timeout=60).json()
    got = _as_ids(body["choices"][0]["logprobs"]["tokens"])
    sp = SamplingParams(temperature=0, max_tokens=6, **{
        k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v)
        for k, v in penalty.items()})
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert got == _reference_greedy(hf, sp, tokenizer.eos_token_id, prompt)
    assert got != plain_ids  # probe: the parameter changed the output
