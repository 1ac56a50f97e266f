"""What `sloserve serve` tells its HTTP server beyond the engine's configuration: the names it
answers to, the API key, the SLO defaults and floor, the output parsers, the queue bounds."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import ShutdownConfig
from engine.serving.admission import QueueBounds
from engine.serving.doomed import OnDoomed


@dataclass
class ServerSettings:
    # The name responses carry; /v1/models lists it first.
    served_model_name: str
    # Further names listed and accepted (`--served-model-name A B C`: these are B and C).
    other_served_names: tuple[str, ...] = ()
    # The model folder, listed as each model's `root`; its base name is accepted too.
    model_root: str | None = None
    api_key: str | None = None
    max_request_body_bytes: int = 1 << 20
    default_ttft_slo_ms: float | None = None
    default_tpot_slo_ms: float | None = None
    # The tightest TTFT objective a client may ask for: clients choose their own SLOs, and a
    # stream of needlessly tight ones would hold every other request back.
    min_ttft_slo_ms: float | None = None
    # /metrics and /debug/stats behind the API key too (/health stays open for probes).
    metrics_require_api_key: bool = False
    # On SIGTERM: abort what is in flight, or drain first (engine.serving.drain).
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)
    # The tool-call format the model writes (engine.serving.tool_calls.parsers; `openai`:
    # harmony's); None: the one its chat template shows, if exactly one.
    tool_call_parser: str | None = None
    # How a reasoning model's thinking is split from its answer (engine.serving.
    # reasoning_parsers; `openai_gptoss`: harmony's channels); None: not split, all of it is
    # content, unless the chat template writes harmony.
    reasoning_parser: str | None = None
    # --max-num-queued-reqs / --max-num-queued-tokens (engine.serving.admission).
    queue_bounds: QueueBounds = field(default_factory=QueueBounds)
    # --on-doomed: a request this server cannot serve within its TTFT objective even ahead of
    # everything it holds is served anyway, or refused with 429 (engine.serving.doomed).
    on_doomed: OnDoomed = "serve"
