"""`--on-doomed`: what a server does with a request whose TTFT objective it cannot meet even if it
served it before everything it holds. `serve` (the default) takes it anyway: it will be late,
but its client may still want the answer. `reject` refuses it at once with 429, the body
carrying `predicted_ttft_ms` and the objective, so that a gateway can send it elsewhere while
it still has time.

Served first means: the running step ends, or is stopped for the request after the preemption
latency where the monitor can stop it; then the request's own prefill, its prefix-cache hit
taken off, chunked at the step budget beside the running decodes (engine.load.prediction.
served_first, on the engine's own load report and step-time model). Doomed is judged at the
model's optimistic speed, the monitor's own bound for writing a request off: no order of the
queue could serve it in time, so refusing it costs nothing that serving it would have met. The
429 reports the point estimate. Only the arriving request is judged, once: a request already
admitted is never dropped to make room, whatever arrives after it.

A fleet's ingress makes the same judgement over every replica (engine.fleet.admission), and its
replicas leave it to the ingress.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

from engine.load.load_report import ReplicaLoad
from engine.load.prediction import ServedFirst, served_first
from engine.load.prefix_hashes import cached_prompt_blocks

logger = logging.getLogger(__name__)

OnDoomed = Literal["serve", "reject"]
ON_DOOMED_CHOICES: tuple[str, ...] = ("serve", "reject")
# The reason the rejection counters give a request refused as doomed (beside the queue bounds'
# max_num_queued_reqs and max_num_queued_tokens: engine.serving.admission).
DOOMED = "doomed"
# How long a request waits for the engine's load report before it is served unjudged. The
# EngineCore process's reader thread answers within a millisecond, during a step too; past this
# the engine's process is starved, and holding the request longer would only make it later.
LOAD_REPORT_TIMEOUT_S = 0.25
# Retry-After is whole seconds (RFC 9110), at least this many.
MIN_RETRY_AFTER_S = 1
# A prompt's cached prefix is found by hashing its blocks until one is not cached: some 4 us a
# block, so a long cached document (1875 blocks of a 30k-token prompt: ~8 ms) is matched off the
# event loop, which relays every open stream; a turn's few blocks are not worth the hop.
HASHED_ON_LOOP_BLOCKS = 64


class RequestDoomed(Exception):
    """The 429 of a request refused as doomed."""

    def __init__(self, slo_ms: float, prediction: ServedFirst) -> None:
        self.slo_ms = slo_ms
        self.predicted_ttft_ms = round(prediction.ttft_s * 1e3, 1)
        self.optimistic_ttft_ms = round(prediction.optimistic_ttft_s * 1e3, 1)
        # A retry finds the running step over; nothing sooner would change the answer.
        self.retry_after_s = max(MIN_RETRY_AFTER_S, math.ceil(prediction.step_remaining_s))
        super().__init__(
            f"this server cannot serve this request within its TTFT objective of "
            f"{slo_ms:g} ms even ahead of every request it holds: its predicted TTFT is "
            f"{self.predicted_ttft_ms:g} ms, {self.optimistic_ttft_ms:g} ms at best "
            f"(--on-doomed reject)")

    @property
    def details(self) -> dict[str, float]:
        """The error body's fields beside its message."""
        return {"predicted_ttft_ms": self.predicted_ttft_ms, "ttft_slo_ms": self.slo_ms}


class DoomedCheck:
    """`--on-doomed reject`'s test of an arriving request, on the engine's load report."""

    def __init__(self, load_report: Callable[[float], Awaitable[ReplicaLoad]],
                 on_reject: Callable[[str], None] = lambda reason: None,
                 off_loop: Callable[..., Awaitable[Any]] | None = None) -> None:
        """``load_report(timeout)``: the engine's load now (AsyncEngineClient.load_report);
        ``on_reject``: told DOOMED for each refusal (the rejection counters); ``off_loop(fn,
        *args)``: runs a long prompt's prefix match off the event loop (None: on it)."""
        self._load_report = load_report
        self._on_reject = on_reject
        self._off_loop = off_loop
        # The last report's cached prefix hashes as a set: requests arriving together share
        # one report (concurrent load queries share their answer), and so its set.
        self._cached: tuple[ReplicaLoad, frozenset[int]] | None = None

    def _cached_hashes(self, load: ReplicaLoad) -> frozenset[int]:
        if self._cached is None or self._cached[0] is not load:
            self._cached = (load, frozenset(load.cached_prefix_hashes))
        return self._cached[1]

    async def check(self, prompts: Sequence[Sequence[int]], slo_ms: float,
                    waited_s: float) -> ServedFirst | None:
        """Raise RequestDoomed if the request (its prompts' token ids, all prefilled for it; its
        objective; the seconds since it arrived) misses its objective even served first.
        Returns the prediction it was judged on; None where there was no report to judge it by
        (it is served)."""
        try:
            load = await self._load_report(LOAD_REPORT_TIMEOUT_S)
        except TimeoutError as exc:
            logger.warning("--on-doomed reject: serving a request unjudged: %s", exc)
            return None
        # Its prompts are prefilled together; the first one's cached prefix is what a prefix
        # hit saves (a list of prompts shares no more than that, as the fleet's router counts).
        match = (prompts[0], load.block_size, self._cached_hashes(load))
        long_prompt = len(prompts[0]) > HASHED_ON_LOOP_BLOCKS * load.block_size
        if self._off_loop is not None and long_prompt:
            blocks = await self._off_loop(cached_prompt_blocks, *match)
        else:
            blocks = cached_prompt_blocks(*match)
        cached = blocks * load.block_size
        prediction = served_first(load, sum(map(len, prompts)), cached, time.time(), waited_s)
        if prediction.optimistic_ttft_s * 1e3 > slo_ms:
            self._on_reject(DOOMED)
            raise RequestDoomed(slo_ms, prediction)
        return prediction
