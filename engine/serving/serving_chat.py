"""`POST /v1/chat/completions`, and `POST /v1/responses` served as the chat request it amounts
to: the chat template renders the messages, and the output is read for tool calls, a reasoning
model's thinking or harmony's channels as the server's settings and the template say."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from engine.serving.api_errors import APIError
from engine.serving.chat_prompt import ChatPromptError, chat_prompt
from engine.serving.chat_reading import ChatReading
from engine.serving.forwarded_prompts import forwarded_prompts
from engine.serving.harmony import HARMONY_REASONING, HARMONY_TOOLS, renders_harmony
from engine.serving.openai_protocol import ChatCompletionRequest
from engine.serving.reasoning_parsers import REASONING_PARSERS
from engine.serving.responses_api import ResponsesShape
from engine.serving.responses_protocol import (RequestError, ResponsesRequest, as_responses_error,
                                               chat_request, refused_field)
from engine.serving.serving_engine import OpenAIServing
from engine.serving.tool_calls.calling import tool_calling
from engine.serving.tool_calls.parsers import parser_for_template


class OpenAIServingChat:
    """Chat completions over the shared `OpenAIServing`; what the output is read for is the
    server's, settled once from its settings and the model's chat template."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        settings = serving.settings
        # What tool_choice auto reads the model's text with: the server's choice, else its
        # template's format (None: auto is a 400 naming the option).
        template = getattr(serving.client.inputs.tokenizer, "chat_template", None)
        self.template = template if isinstance(template, str) else None
        # gpt-oss's harmony: its channels are the reasoning, the tool calls and the content,
        # read from the special tokens the output keeps (engine.serving.harmony).
        self.harmony = (renders_harmony(self.template)
                        or settings.reasoning_parser == HARMONY_REASONING
                        or settings.tool_call_parser == HARMONY_TOOLS)
        self.tool_parser = None if self.harmony else (
            settings.tool_call_parser or parser_for_template(self.template))
        self.reasoning = (REASONING_PARSERS[settings.reasoning_parser]()
                          if settings.reasoning_parser in REASONING_PARSERS and not self.harmony
                          else None)

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request,
                                     responses: ResponsesShape | None = None) -> Response:
        """``responses``: the request serves /v1/responses, answered in that API's shape."""
        tools = body.tool_dicts
        if self.harmony:
            # Harmony's calls are messages to `functions.NAME`, read whatever the output holds;
            # a call cannot be forced in it by a JSON schema.
            if tools and body.tool_choice not in (None, "auto", "none"):
                raise APIError(400, f"tool_choice {_choice_name(body.tool_choice)} is not "
                                    "supported for a model that writes harmony (gpt-oss): "
                                    "use auto or none", "tool_choice")
            calling = None
        else:
            try:
                calling = tool_calling(tools, body.tool_choice, body.parallel_tool_calls,
                                       self.tool_parser)
            except ValueError as exc:
                raise APIError(400, str(exc), "tool_choice") from exc
        # What a fleet's router renders too (engine.serving.chat_prompt): the same prompt.
        try:
            prompt = chat_prompt(body, self.template)
        except ChatPromptError as exc:
            raise APIError(400, str(exc), exc.param) from exc
        with self.serving.arriving(body, request, 1, chat=True) as checked:
            if (forwarded := forwarded_prompts(request, 1)) is not None:
                ids = forwarded[0]  # a fleet's ingress rendered this prompt to route it
            else:
                try:
                    ids = await self.serving.lanes.apply_chat_template(
                        prompt.messages, True, prompt.tools, prompt.template_kwargs)
                except ValueError as exc:
                    raise APIError(400, str(exc), "messages") from exc
            reading = ChatReading(tools=calling, reasoning=self.reasoning,
                                  harmony=self.harmony)
            return await self.serving.serve(body, request, [(None, ids)], checked,
                                            chat=reading, responses=responses)

    async def create_response(self, body: ResponsesRequest, request: Request) -> Response:
        """Served as the chat request it amounts to (engine.serving.responses_protocol), its
        answer in the Responses shape (engine.serving.responses_api)."""
        if (refused := refused_field(body)) is not None:
            raise APIError(400, refused[1], refused[0])
        try:
            chat = chat_request(body)
        except RequestError as exc:
            raise APIError(400, str(exc), exc.param) from exc
        try:
            return await self.create_chat_completion(
                chat, request, ResponsesShape(body, self.serving.settings.served_model_name))
        except APIError as exc:  # named as this route's request names the field
            exc.message, exc.param = as_responses_error(exc.message, exc.param)
            raise


def _choice_name(choice: object) -> str:
    """A tool_choice as an error names it: the mode, or the function asked for."""
    function = getattr(choice, "function", None)
    return repr(choice) if function is None else f"function {function.name!r}"
