"""A bound on what one server holds: `--max-num-queued-reqs` and `--max-num-queued-tokens`
(vLLM's names). A request that would take the server past either is refused at once with 429
and `Retry-After`, so a gateway can send it elsewhere while it still has time; a request
already admitted is never dropped to make room.

What counts, as the server's edge sees it: every engine request an HTTP request has started
and that has not ended (waiting or running; `n` samples count as n), and the prompt tokens of
those whose first output has not come yet (a prompt's samples share its prefill, so a prompt
counts once). The ledger is kept where requests are admitted, on the API server's event loop:
two requests arriving together cannot both pass a bound only one of them fits under, which a
count read from the engine's last step could not promise.

The request bound is checked twice: on arrival, before the chat template and the tokenizer run
(a place is reserved for each engine request the HTTP request will start), and at admission
with the prompt's tokens. Under a flood the requests refused cost the server no tokenizing,
which would otherwise be taken from the ones it serves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.outputs import RequestOutput

if TYPE_CHECKING:
    from engine.ipc.async_client import RequestStream

# The reasons a request is refused, as the rejection counters label them (vLLM's reasons).
QUEUED_REQUESTS, QUEUED_TOKENS = "max_num_queued_reqs", "max_num_queued_tokens"
# What a refusal's Retry-After says, in seconds: a queue bound is a moment's state, not a quota.
RETRY_AFTER_S = 1
# Names a 429's reason for a gateway (one of the reasons above, or engine.serving.doomed's):
# a fleet's ingress tries a queue bound's refusal on another replica.
REJECTED_HEADER = "x-sloserve-rejected"


def queue_full_headers(reason: str) -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S), REJECTED_HEADER: reason}


@dataclass(frozen=True)
class QueueBounds:
    max_requests: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("--max-num-queued-reqs", self.max_requests),
                            ("--max-num-queued-tokens", self.max_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def bounded(self) -> bool:
        return self.max_requests is not None or self.max_tokens is not None


class QueueFull(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class AdmissionLedger:
    bounds: QueueBounds
    # Told the reason of each refusal (the rejection counters).
    on_reject: Callable[[str], None] = lambda reason: None
    # Engine request id -> its prompt's tokens still counted (0 once its first output came, or
    # for a prompt's later samples).
    held: dict[str, int] = field(default_factory=dict)
    queued_tokens: int = 0
    # Engine requests of HTTP requests still being prepared (templated, tokenized): counted
    # against the request bound from arrival on.
    reserved: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.held)

    def check_room(self, count: int) -> None:
        """QueueFull (counted as a refusal) when the held and reserved requests leave no room
        for ``count`` more; nothing is reserved."""
        self._check_requests(count)

    def reserve(self, count: int) -> Place:
        """A place for ``count`` engine requests while their prompts are prepared, or QueueFull
        when the held and reserved ones leave no room for them."""
        self._check_requests(count)
        self.reserved += count
        return Place(self, count)

    def admit(self, request_ids: Sequence[str], prompt_tokens: Sequence[int],
              place: Place | None = None) -> None:
        """Hold ``request_ids`` (``prompt_tokens``: each one's count, 0 for a sample that shares
        an earlier one's prompt), or raise QueueFull naming the bound, holding nothing.
        ``place``: what was reserved for them on arrival, given up here either way."""
        if place is not None:
            place.release()
        added = sum(prompt_tokens)
        self._check_requests(len(request_ids))
        limit = self.bounds.max_tokens
        # One request alone is always let in, however long: a bound on tokens must not refuse
        # a prompt that an idle server would serve.
        if limit is not None and self.held and self.queued_tokens + added > limit:
            self.on_reject(QUEUED_TOKENS)
            raise QueueFull(QUEUED_TOKENS,
                            f"the server has {self.queued_tokens} prompt tokens to prefill and "
                            f"this request adds {added}: over its bound of {limit} "
                            f"(--max-num-queued-tokens); retry later or elsewhere")
        for request_id, tokens in zip(request_ids, prompt_tokens):
            self.held[request_id] = tokens
        self.queued_tokens += added

    def _check_requests(self, count: int) -> None:
        limit = self.bounds.max_requests
        taken = self.num_requests + self.reserved
        if limit is not None and taken + count > limit:
            self.on_reject(QUEUED_REQUESTS)
            raise QueueFull(QUEUED_REQUESTS,
                            f"the server holds {taken} requests (waiting, running or being "
                            f"tokenized) and this one adds {count}: over its bound of {limit} "
                            f"(--max-num-queued-reqs); retry later or elsewhere")

    def prefilled(self, request_id: str) -> None:
        self.queued_tokens -= self.held.get(request_id, 0)
        if request_id in self.held:
            self.held[request_id] = 0

    def release(self, request_id: str) -> None:
        """Idempotent: a request ends once, but may be told so from several places."""
        self.queued_tokens -= self.held.pop(request_id, 0)

    def track(self, request_id: str, source: RequestStream) -> TrackedSource:
        return TrackedSource(self, request_id, source)


class Place:
    """Room reserved in a ledger for a request being prepared; given back once (admitted, or
    failed before it)."""

    def __init__(self, ledger: AdmissionLedger, count: int) -> None:
        self.ledger, self.count = ledger, count

    def release(self) -> None:
        self.ledger.reserved -= self.count
        self.count = 0


class TrackedSource:
    """An engine request's outputs, its ledger told when the first one comes and when the
    iteration ends or is closed (closing a source that never started releases it too)."""

    def __init__(self, ledger: AdmissionLedger, request_id: str,
                 source: RequestStream) -> None:
        self.ledger, self.request_id, self.source = ledger, request_id, source
        self._first = True

    def __aiter__(self) -> TrackedSource:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            out = await self.source.__anext__()
        except BaseException:
            self.ledger.release(self.request_id)
            raise
        if self._first and out.token_ids:
            self._first = False
            self.ledger.prefilled(self.request_id)
        if out.finished:
            self.ledger.release(self.request_id)
        return out

    def close(self) -> None:
        self.ledger.release(self.request_id)
        self.source.close()

    async def aclose(self) -> None:
        self.close()
