"""`POST /v1/completions`: a prompt, or a list of them, each text or token ids, served as
engine requests that run together (engine.serving.serving_engine)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from engine.serving.api_errors import APIError
from engine.serving.forwarded_prompts import forwarded_prompts
from engine.serving.openai_protocol import CompletionRequest
from engine.serving.serving_engine import OpenAIServing, Prompt
from engine.serving.tokenize_lanes import TokenizeLanes


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_completion(self, body: CompletionRequest, request: Request) -> Response:
        try:
            given = body.prompts
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from exc
        with self.serving.arriving(body, request, len(given), chat=False) as checked:
            # A fleet's ingress tokenized the text prompts to route the request.
            forwarded = forwarded_prompts(request, len(given))
            prompts: list[Prompt] = []
            for index, prompt in enumerate(given):
                if not isinstance(prompt, str):
                    prompts.append((None, list(prompt)))
                elif forwarded is not None:
                    prompts.append((prompt, forwarded[index]))
                else:
                    prompts.append((prompt, await _encode(self.serving.lanes, prompt)))
            return await self.serving.serve(body, request, prompts, checked)


async def _encode(lanes: TokenizeLanes, prompt: str) -> list[int]:
    try:
        return await lanes.encode(prompt)
    except ValueError as exc:
        raise APIError(400, str(exc), "prompt") from exc
