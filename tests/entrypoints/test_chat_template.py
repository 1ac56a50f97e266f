"""--chat-template (a file or inline Jinja) and --tokenizer (a folder other than the model's):
what the model is fed changes accordingly, on the chat route and in LLM.chat, and a template or
tokenizer that cannot be used is a startup error naming it."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.entrypoints.cli import main
from engine.processing.chat_template import load_chat_template
from engine.sampling_params import SamplingParams
from tests.utils.inprocess_server import MAX_MODEL_LEN, FakeCore, app_client

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>>"
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
# What TEMPLATE renders MESSAGES to (trim_blocks drops nothing here: no block tag ends a line).
RENDERED = "[user] The quick brown fox\n>>"


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("llama", max_position_embeddings=MAX_MODEL_LEN)


def _ids(folder: str, text: str) -> list[int]:
    # apply_chat_template adds no special tokens: the template spells out every one it wants.
    return AutoTokenizer.from_pretrained(folder).encode(text, add_special_tokens=False)


# ---- load_chat_template ----------------------------------------------------------------------

def test_a_template_comes_from_a_file_or_inline(tmp_path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    # vLLM's single-line form: a typed backslash-n is a newline; other text is kept as is.
    assert load_chat_template(r"{{ messages[0]['content'] }}\nü🙂") == \
        "{{ messages[0]['content'] }}\nü🙂"
    # HF's assistant-mask tag parses.
    load_chat_template("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
                       "{% endfor %}")


@pytest.mark.parametrize("make,message", [
    (lambda d: str(d / "missing.jinja"), "chat template '{d}/missing.jinja': cannot read it"),
    (lambda d: str(d), "chat template '{d}': cannot read it"),
    (lambda d: _write(d / "bad.jinja", "{% for m in messages %}{{ m }}"),
     "chat template file '{d}/bad.jinja' does not parse as a Jinja template (line 1): "
     "Unexpected end of template"),
    (lambda d: _write(d / "empty.jinja", "\n"), "chat template file '{d}/empty.jinja' is empty"),
    (lambda d: "{{ unclosed", "inline chat template '{{{{ unclosed' does not parse"),
])
def test_a_template_that_cannot_be_used_is_named(tmp_path, make, message) -> None:
    with pytest.raises(ValueError) as exc:
        load_chat_template(make(tmp_path))
    assert message.format(d=tmp_path) in str(exc.value)


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# ---- what the model is fed -------------------------------------------------------------------

def test_llm_chat_feeds_the_custom_template(model) -> None:
    from engine.entrypoints.llm import LLM

    llm = LLM(model, chat_template=TEMPLATE, dtype="float32", num_kv_blocks=16)
    try:
        (out,) = llm.chat(MESSAGES, SamplingParams(max_tokens=1, temperature=0))
    finally:
        llm.shutdown()
    assert out.prompt_token_ids == _ids(model, RENDERED)


def test_the_chat_route_and_tokenize_feed_the_custom_template(model, tmp_path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    fake = FakeCore(vocab_size=len(AutoTokenizer.from_pretrained(model)))

    async def run():
        async with app_client(model, fake=fake, chat_template=str(path)) as (http, _):
            chat = await http.post("/v1/chat/completions",
                                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1})
            tokenized = await http.post("/tokenize", json={"model": "tiny",
                                                          "messages": MESSAGES})
            return chat, tokenized

    chat, tokenized = asyncio.run(run())
    assert chat.status_code == 200, chat.text
    assert fake.requests[0].prompt_token_ids == _ids(model, RENDERED)
    assert tokenized.json()["tokens"] == _ids(model, RENDERED)


def test_a_tokenizer_from_another_folder(model, tmp_path) -> None:
    """A model folder without tokenizer files takes text prompts once --tokenizer names one."""
    from engine.entrypoints.llm import LLM

    bare = tmp_path / "bare"
    shutil.copytree(model, bare)
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (bare / name).exists():
            shutil.move(str(bare / name), str(tokenizer_dir / name))
    params = SamplingParams(max_tokens=2, temperature=0)
    without = LLM(str(bare), dtype="float32", num_kv_blocks=16)
    try:
        with pytest.raises(ValueError, match="this model folder has no tokenizer"):
            without.generate("The quick brown fox", params)
    finally:
        without.shutdown()
    llm = LLM(str(bare), tokenizer=str(tokenizer_dir), chat_template=TEMPLATE, dtype="float32",
              num_kv_blocks=16)
    try:
        (out,) = llm.generate("The quick brown fox", params)
        (chat,) = llm.chat(MESSAGES, params)
    finally:
        llm.shutdown()
    assert out.prompt_token_ids == _ids(model, "The quick brown fox") and out.text
    assert chat.prompt_token_ids == _ids(model, RENDERED)


# ---- startup errors --------------------------------------------------------------------------

@pytest.mark.parametrize("flags,message", [
    (["--chat-template", "/no/such/chat.jinja"], "chat template '/no/such/chat.jinja': cannot "
     "read it"),
    (["--chat-template", "{% if %}"], "inline chat template '{% if %}' does not parse"),
    (["--tokenizer", "/no/such/tokenizer"], "tokenizer: '/no/such/tokenizer' is not a local "
     "tokenizer folder"),
])
def test_serve_refuses_an_unusable_template_or_tokenizer(model, flags, message, capsys) -> None:
    assert main(["serve", model, *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_template_without_any_tokenizer_is_refused(model, tmp_path, capsys) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(model, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    assert main(["serve", str(bare), "--chat-template", TEMPLATE]) == 2
    assert "a chat template needs a tokenizer" in capsys.readouterr().err
