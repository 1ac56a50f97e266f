"""`/tokenize` and `/detokenize` (their request shapes: engine.serving.tokenize_api), with the
server's own tokenizer, off the event loop."""

from __future__ import annotations

from engine.ipc.async_client import AsyncEngineClient
from engine.serving.serving_models import OpenAIServingModels
from engine.serving.tokenize_api import (DetokenizeRequest, TokenizeRequest, detokenize_request,
                                         tokenize_request)
from engine.serving.tokenize_lanes import TokenizeLanes, text_size


class OpenAIServingTokenization:
    def __init__(self, client: AsyncEngineClient, models: OpenAIServingModels,
                 lanes: TokenizeLanes) -> None:
        self.client = client
        self.models = models
        self.lanes = lanes

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.models.check_model_name(body.model)
        # A document's tokenization takes the long lane, so that a turn never waits on it.
        size = text_size(body.prompt if body.prompt is not None
                         else [m.content for m in body.messages or ()])
        ids = await self.lanes.on_lane(size, lambda inputs: tokenize_request(inputs, body))
        strs = (await self.lanes.run(self.client.inputs.tokenizer.convert_ids_to_tokens, ids)
                if body.return_token_strs else None)
        return {"count": len(ids), "max_model_len": self.client.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.models.check_model_name(body.model)
        return {"prompt": await self.lanes.run(detokenize_request, self.client.inputs, body)}
