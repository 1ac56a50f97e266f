"""Frontend side of a new request: tokenization, chat templates, EOS handling, validation.

Shared by the offline `LLM` and the API server, so both turn the same input into the same
request and reject bad input with the same message.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from engine.config import ModelConfig
from engine.processing.piecewise_encoding import encode_in_pieces
from engine.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


def validate_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Raises ValueError naming what is wrong; the only prompt check, used on both sides."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt is empty: it must contain at least one token")
    if n > max_model_len:
        raise ValueError(f"prompt has {n} tokens, longer than max_model_len {max_model_len}")
    # The common case at C speed: the API server checks each prompt on its event loop, and a
    # 30k-token prompt checked token by token held it some 10 ms (every other request's
    # arrival stamp and stream waited). Anything else goes through the search that names it.
    if (set(map(type, prompt_token_ids)) == {int} and 0 <= min(prompt_token_ids)
            and max(prompt_token_ids) < vocab_size):
        return
    for token in prompt_token_ids:  # (a None token, too: not an int)
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise ValueError(f"prompt_token_ids: token {token!r} is outside the vocabulary "
                             f"[0, {vocab_size})")


def check_fits_context(prompt_len: int, max_tokens: int, max_model_len: int, *,
                       messages: bool = False) -> None:
    """Raises ValueError, in vLLM's (and OpenAI's) words, when the prompt and the completion
    asked for cannot both fit the context: such a request could only be cut short, so it is
    refused up front, naming the numbers. ``messages``: the prompt came from chat messages.
    A max_tokens the client left out is not checked (it means "up to the context")."""
    if prompt_len + max_tokens > max_model_len:
        what = "messages" if messages else "prompt"
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens. "
                         f"However, you requested {prompt_len + max_tokens} tokens "
                         f"({prompt_len} in the {what}, {max_tokens} in the completion). "
                         f"Please reduce the length of the {what} or completion.")


class InputProcessor:
    def __init__(self, model_dir: str, tokenizer_dir: str | None = None,
                 chat_template: str | None = None) -> None:
        """``tokenizer_dir``: a tokenizer folder other than the model's; ``chat_template``: Jinja
        text replacing the tokenizer's template (for every chat use: LLM.chat, the chat route,
        /tokenize with messages)."""
        self.tokenizer = load_tokenizer(tokenizer_dir or model_dir)
        if chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("a chat template needs a tokenizer, and the model folder has "
                                 "none (give --tokenizer)")
            self.tokenizer.chat_template = chat_template
        self.eos_token_ids = eos_token_ids(model_dir, self.tokenizer)
        # Whether encoding keeps the GIL (`holding_gil`).
        self._backend = None
        # Encoding in pieces, with this called between them (`between_pieces`).
        self._between: Callable[[], object] | None = None

    def holding_gil(self) -> InputProcessor:
        """This processor (the same tokenizer) encoding through its fast tokenizer's backend
        directly, which keeps the GIL, for short inputs encoded on an event loop: the batch call
        the tokenizer otherwise makes releases the GIL for the Rust side, and in a process with
        other busy threads (a tokenizing lane, a router) the loop then waits a switch interval
        (5 ms) or more to get it back, for an encode that takes one or two milliseconds. The
        token ids are the same: the one backend does the work either way. A tokenizer with no
        fast backend encodes as before."""
        view = copy.copy(self)
        backend = getattr(self.tokenizer, "_tokenizer", None)
        view._backend = backend if hasattr(backend, "encode_batch") else None
        return view

    def between_pieces(self, between: Callable[[], object]) -> InputProcessor:
        """This processor (the same tokenizer) encoding a long text in pieces, with `between()`
        called between two pieces (engine.processing.piecewise_encoding): the same token ids,
        from a tokenizing lane that can stop while more urgent work is owed. A tokenizer with
        no fast backend encodes whole."""
        view = copy.copy(self)
        view._between = between
        return view

    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._between is not None:
            backend = getattr(self.tokenizer, "_tokenizer", None)
            if hasattr(backend, "encode_batch"):
                return encode_in_pieces(backend, text, add_special_tokens, self._between)
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    @classmethod
    def for_model(cls, config: ModelConfig) -> InputProcessor:
        return cls(config.model, config.tokenizer, config.chat_template)

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer; pass prompt_token_ids instead")
        try:  # a lone surrogate: HF tokenizers raise a TypeError that does not say why
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"prompt is not valid Unicode text: a lone surrogate "
                             f"{prompt[exc.start]!r} at character {exc.start}") from exc
        return self._encode_text(prompt, add_special_tokens)

    def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """``tools``: OpenAI's tool definitions, which the template renders (tool calling);
        ``template_kwargs``: further template variables (Qwen3's `enable_thinking`)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; pass a plain prompt instead")
        try:
            # Rendered, then encoded without special tokens: what apply_chat_template's own
            # tokenize=True does, through _encode_text (see holding_gil).
            text = self.tokenizer.apply_chat_template(messages, tools=tools,
                                                      add_generation_prompt=add_generation_prompt,
                                                      tokenize=False,
                                                      **(template_kwargs or {}))
        except Exception as exc:  # template errors (bad roles, missing content) are bad input
            raise ValueError(f"messages: the chat template rejected them: {exc}") from exc
        return self._encode_text(text, add_special_tokens=False)

    def with_eos(self, params: SamplingParams) -> tuple[SamplingParams, int | None]:
        """The model's EOS id for the request, with any further EOS ids (generation_config may
        list several) added to its stop_token_ids."""
        if params.ignore_eos or not self.eos_token_ids:
            return params, None
        eos, *extra = self.eos_token_ids
        missing = [t for t in extra if t not in params.stop_token_ids]
        if missing:
            params = msgspec.structs.replace(params,
                                             stop_token_ids=params.stop_token_ids + missing)
        return params, eos


def has_tokenizer(folder: str) -> bool:
    return any((Path(folder) / f).exists() for f in ("tokenizer.json", "tokenizer.model",
                                                     "tokenizer_config.json"))


def load_tokenizer(model_dir: str):
    """The folder's tokenizer, or None when the folder has none (token-id prompts only)."""
    folder = Path(model_dir)
    if not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def eos_token_ids(model_dir: str, tokenizer) -> list[int]:
    """EOS ids from generation_config.json (may be a list), else config.json, else the
    tokenizer's."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return [tokenizer.eos_token_id]
    return []
