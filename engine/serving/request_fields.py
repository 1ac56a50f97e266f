"""Request fields other servers define that this one does not implement, and what it does with
them: no field is accepted and silently ignored where its value asks for something.

The catalogue is vLLM's `ChatCompletionRequest` and `CompletionRequest` (OpenAI's fields and
vLLM's extensions; vllm/entrypoints/openai/protocol.py, late 2025) plus the older vLLM names
(`guided_*`) and OpenAI fields vLLM leaves out. The models in openai_protocol.py declare what is
implemented; an undeclared field arrives as a pydantic extra and is looked up here:

- NOT_IMPLEMENTED: refused with a 400 naming it, unless its value is one that asks for nothing
  (what a client library or a vLLM default sends: `tools: []`, `response_format: {"type":
  "text"}`, `add_generation_prompt: true`); `null` always asks for nothing.
- WITHOUT_EFFECT: accepted, because no value of theirs changes the result here (an end user's
  id for the operator's logs, a tool-call option without tools).
- Anything else: a field no known client defines for these routes; ignored, as vLLM and OpenAI
  ignore unknown fields (vLLM logs them).

README's "Request fields" table is checked against these sets (tests/entrypoints).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

# Field -> the values that ask for nothing, on /v1/completions and (unless CHAT_NO_OP names
# them differently) /v1/chat/completions.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    # Chat's echo (vLLM: prepend the last message) and completions' top_logprobs (chat's name;
    # completions take logprobs: k): each route implements the other's.
    "echo": (False,), "top_logprobs": (0,),
    "use_beam_search": (False,), "length_penalty": (1, 1.0),
    # Tool calling is the chat route's (completions have no template to render tools with),
    # and OpenAI's older function calling is not built.
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    # vLLM's structural tags (structured outputs that switch on at a trigger string).
    "structural_tag": (),
    # The chat route's reasoning and template fields on completions, which render no
    # template (chat declares them).
    "reasoning_effort": (), "include_reasoning": (True,),
    # The chat template's inputs: the server's template (--chat-template) is the only one,
    # rendered with the generation prompt, the tools and chat_template_kwargs (chat).
    "chat_template": (), "chat_template_kwargs": ({},), "documents": ([],),
    "add_generation_prompt": (True,), "continue_final_message": (False,),
    # Completions add the tokenizer's special tokens (BOS) and chat leaves them to the
    # template, as vLLM's defaults do; the other choice is not offered.
    "add_special_tokens": (True,),
    "mm_processor_kwargs": ({},), "prompt_embeds": (),
    # Sampling and output options vLLM has and this server does not.
    "truncate_prompt_tokens": (), "allowed_token_ids": (), "bad_words": ([],),
    "spaces_between_special_tokens": (True,), "logits_processors": (), "vllm_xargs": ({},),
    "return_token_ids": (False,),
    # vLLM's request id (the response's id), prefix-cache salt and disaggregated prefill.
    "request_id": (), "cache_salt": (), "kv_transfer_params": (),
    # OpenAI's, beyond vLLM's: other modalities, predicted outputs, hosted tools, storage.
    "modalities": (["text"],), "audio": (), "prediction": (), "web_search_options": (),
    "verbosity": (), "store": (False,), "service_tier": ("auto", "default"),
}

# Where the chat route's values that ask for nothing differ from completions'.
CHAT_NO_OP: dict[str, tuple[Any, ...]] = {"add_special_tokens": (False,)}

# Accepted whatever their value: nothing here changes with it.
WITHOUT_EFFECT: dict[str, str] = {
    "user": "an end user's id, for the operator's logs (OpenAI and vLLM change nothing by it)",
    "metadata": "tags OpenAI keeps with a stored completion; nothing is stored here",
    "parallel_tool_calls": "an option of tool calling, which only the chat route has",
}

# Keys of a chat message beside `role` and `content` that carry something to the chat template:
# dropping them would change the prompt without a word. Value: what asks for nothing.
MESSAGE_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {"function_call": ()}


def _same(value: Any, no_op: Any) -> bool:
    # 0 == False and 1 == True in Python: a bool must be met by a bool, and so on.
    return value == no_op and (type(value) is type(no_op)
                               or {type(value), type(no_op)} <= {int, float})


def asks_for_nothing(value: Any, no_ops: tuple[Any, ...]) -> bool:
    return value is None or any(_same(value, v) for v in no_ops)


def _first_asking(fields: dict[str, Any], table: dict[str, tuple[Any, ...]]
                  ) -> tuple[str, Any] | None:
    """The first of `fields` that `table` names with a value outside its no-op values."""
    for name, value in fields.items():
        no_ops = table.get(name)
        if no_ops is not None and not asks_for_nothing(value, no_ops):
            return name, value
    return None


def unsupported_field(body: BaseModel, chat: bool) -> tuple[str, Any] | None:
    """The first field of `body` (as sent: undeclared fields are pydantic extras) that asks for
    a feature this server does not implement, with its value; None when there is none."""
    if getattr(body, "suffix", None):  # OpenAI's insert mode: a declared field, but not built
        return "suffix", body.suffix
    return _first_asking(body.model_extra or {},
                         {**NOT_IMPLEMENTED, **CHAT_NO_OP} if chat else NOT_IMPLEMENTED)


def unsupported_message_field(extras: dict[str, Any]) -> tuple[str, Any] | None:
    """The first key of a chat message's extras that would carry something to the template."""
    return _first_asking(extras, MESSAGE_NOT_IMPLEMENTED)


def shown(value: Any, limit: int) -> str:
    """`value`'s repr for an error message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."
