"""What a replica tells the fleet's router about its load, and what the router knows of a request.

A replica's `ReplicaLoad` is what its own scheduler knows: the step-time model with its error,
the queue as (remaining prefill tokens, time to deadline), the running step's predicted
remaining time and whether the monitor may stop it, free KV blocks and the hashes of its cached
prefix blocks. The router predicts a request's TTFT on the replica by inserting the request into
that queue with that model (engine.load.prediction).

Times are relative to `made_at` (wall clock, time.time(): the one clock every process of a fleet
shares, across nodes too, to NTP accuracy): the router ages a report by `now - made_at`.
"""

from __future__ import annotations

import msgspec

from monitor.step_time_model import StepTimeModel

# Prefix hashes a report carries at most: the most recently cached blocks. Enough to recognise
# the system prompts and documents a replica holds; a report stays a few tens of KiB.
MAX_REPORTED_PREFIX_HASHES = 4096


class QueuedRequest(msgspec.Struct, array_like=True, frozen=True):
    """One request of a replica's queue, as its monitor sees it."""

    remaining_prefill_tokens: int
    # Seconds from `made_at` to its TTFT deadline (negative: already late); None: no objective,
    # or its first token is already out.
    time_to_deadline_s: float | None
    # Its TTFT objective in seconds (None: none): aging counts in it, as in the monitor.
    slo_s: float | None = None


class ReplicaLoad(msgspec.Struct, kw_only=True, frozen=True):
    """A replica's load at `made_at`; built in the EngineCore process from the monitor's snapshot."""

    made_at: float
    # The step-time model the replica's monitor predicts with (online refit included), and its
    # honest error (relative_error / relative_speedup).
    step_model: StepTimeModel
    # Waiting for admission (paused SLO-preemption victims included: their prefill is owed).
    waiting: list[QueuedRequest] = []
    # Prefilling in the running step.
    running: list[QueuedRequest] = []
    # Requests past their prefill (decoding), and the KV tokens their decode steps read: every
    # prefill step of this replica carries them.
    num_decoding: int = 0
    decode_context: int = 0
    # Predicted seconds left in the running step at `made_at` (0: idle), and whether the monitor
    # may stop it between two layers for a tighter waiter (a prefill step with SLO preemption on).
    step_remaining_s: float = 0.0
    step_preemptible: bool = False
    # Whether this replica stops a forward pass for an urgent waiter at all, and the priority
    # margin its gate asks for (SLOPreemptionConfig).
    slo_preemption: bool = True
    preempt_margin: float = 1.2
    num_free_blocks: int = 0
    num_blocks: int = 0
    block_size: int = 16
    # The step's token budget: a prompt longer than it is prefilled in chunks of it, each a
    # step of its own (0: unknown, predicted as one step).
    max_num_batched_tokens: int = 0
    # First 8 bytes (big-endian int) of the chain hash of each cached full block, most recent
    # last, at most MAX_REPORTED_PREFIX_HASHES (engine.load.prefix_hashes computes the same
    # for a request's prompt).
    cached_prefix_hashes: list[int] = []
    # Requests in the replica (waiting + running + decoding).
    num_requests: int = 0
    # Its server's bound on them (--max-num-queued-reqs; None: unbounded): a replica at it
    # refuses new requests with 429, so the router sends them elsewhere.
    max_queued_requests: int | None = None


class RouteHint(msgspec.Struct, kw_only=True, frozen=True):
    """What the ingress tells the router of a request before any replica sees it."""

    request_id: str
    prompt_tokens: int
    # Its TTFT objective in seconds (None: none) and when the ingress read it (time.time()).
    ttft_slo_s: float | None
    arrived_at: float
    # Chain hashes of the prompt's full blocks (same truncation as cached_prefix_hashes), for
    # the block size of the fleet's replicas.
    prefix_hashes: list[int] = []

    def deadline(self) -> float | None:
        return None if self.ttft_slo_s is None else self.arrived_at + self.ttft_slo_s


_load_encoder = msgspec.msgpack.Encoder()
_load_decoder = msgspec.msgpack.Decoder(ReplicaLoad)


def encode_load(load: ReplicaLoad) -> bytes:
    return _load_encoder.encode(load)


def decode_load(data: bytes) -> ReplicaLoad:
    return _load_decoder.decode(data)
