"""The model names this server answers to: `/v1/models` lists them, and a request naming any
other model is a 404 that lists them."""

from __future__ import annotations

import time
from pathlib import Path

from engine.ipc.async_client import AsyncEngineClient
from engine.serving.api_errors import APIError
from engine.serving.server_settings import ServerSettings


def served_name(model_dir: str) -> str:
    """The name a model folder is served under by default: its base name."""
    return Path(model_dir).name


class OpenAIServingModels:
    """The served names (`--served-model-name`, listed in order) and the folder's base name
    (accepted, not listed)."""

    def __init__(self, settings: ServerSettings, client: AsyncEngineClient) -> None:
        self.client = client
        self.model_root = settings.model_root
        self.listed = (settings.served_model_name, *settings.other_served_names)
        self.accepted = set(self.listed)
        if settings.model_root is not None:
            self.accepted.add(served_name(settings.model_root))

    def card(self, name: str) -> dict:
        """One model as /v1/models shows it."""
        return {"id": name, "object": "model", "created": int(time.time()),
                "owned_by": "sloserve", "root": self.model_root,
                "max_model_len": self.client.max_model_len}

    def list_models(self) -> dict:
        return {"object": "list", "data": [self.card(name) for name in self.listed]}

    def check_model_name(self, name: str | None) -> None:
        """A 404 naming the served models unless `name` is one of them (None: not given)."""
        if name is not None and name not in self.accepted:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(f'`{n}`' for n in self.listed)}", "model")
