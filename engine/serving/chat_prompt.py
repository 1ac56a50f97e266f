"""What a chat request asks the chat template to render: its messages, its tools and its template
variables, read once for everyone who renders it.

The server's chat route and a fleet's ingress (which tokenizes a request to route it) both
render through `chat_prompt`, so that the router's prompt length and prefix-block hashes are
those of the prompt the replica will prefill: a prompt rendered without its tools, or without
a template variable that changes the text, would be routed as another prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.processing.input_processor import ChatMessages, InputProcessor
from engine.serving.openai_protocol import ChatCompletionRequest


class ChatPromptError(ValueError):
    """A chat request the template cannot be given: a 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatPrompt:
    messages: ChatMessages
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any] | None

    def render(self, inputs: InputProcessor) -> list[int]:
        """The prompt's token ids. ValueError as InputProcessor.apply_chat_template (the
        template rejected the messages)."""
        return inputs.apply_chat_template(self.messages, True, self.tools, self.template_kwargs)


def reads_reasoning_effort(template: object) -> bool:
    """Whether a chat template reads OpenAI's `reasoning_effort` (gpt-oss's does)."""
    return isinstance(template, str) and "reasoning_effort" in template


def chat_template_of(inputs: InputProcessor) -> str | None:
    """The chat template the model's tokenizer renders with (--chat-template included)."""
    template = getattr(inputs.tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


def chat_prompt(body: ChatCompletionRequest, template: str | None) -> ChatPrompt:
    """What `body` asks `template` (chat_template_of) to render. ChatPromptError for
    `reasoning_effort` with a template that does not read it, or a message this server cannot
    give a template."""
    template_kwargs = body.chat_template_kwargs
    if body.reasoning_effort is not None:
        if not reads_reasoning_effort(template):
            raise ChatPromptError("reasoning_effort: this model's chat template does not read it",
                                  "reasoning_effort")
        template_kwargs = {**(template_kwargs or {}), "reasoning_effort": body.reasoning_effort}
    try:
        messages = [m.as_template_input() for m in body.messages]
    except ValueError as exc:
        raise ChatPromptError(str(exc), "messages") from exc
    return ChatPrompt(messages=messages, tools=body.tool_dicts, template_kwargs=template_kwargs)
