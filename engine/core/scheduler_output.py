"""What one engine step asks the workers to compute, and what they send back.

These are msgspec Structs because they cross process boundaries (EngineCore -> TP workers) as
msgpack frames. A step is self-contained: each scheduled request carries its block table and the
slice of tokens to compute, so workers keep no per-request state that a rollback would have to undo.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import msgspec

from engine.logprobs import LogprobsLists
from engine.sampling_params import SamplingParams
from monitor.step_point import StepPoint, attention_work, decode_context, step_point


class ScheduledRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    req_id: str
    # Tokens whose KV this step computes: all_token_ids[start_pos : start_pos + len(token_ids)].
    token_ids: list[int]
    start_pos: int
    # Physical KV block ids holding positions [0, start_pos + len(token_ids)): those of the
    # table from index block_table_start on. The workers hold the ones before it from earlier
    # steps (workers/block_tables.py); 0 sends the whole table.
    block_ids: list[int]
    # True when this step reaches the end of the known tokens, so a next token is sampled.
    sample: bool
    sampling_params: SamplingParams
    block_table_start: int = 0
    # A model with several KV cache groups (engine.core.kv_groups): the other groups' ids from
    # block_table_start on (block_ids is the first group's).
    group_block_ids: list[list[int]] = []
    # Index of the token to be sampled within the output (seeds per-token random draws).
    num_output_tokens: int = 0
    # This chunk's pass was suspended (mid-forward preemption, mode suspend): the workers hold
    # its activations at the layer it stopped at, and the layers below that are not run again.
    resume: bool = False
    # Sampling rows whose penalties need the history (else empty: most requests send none).
    prompt_token_ids: list[int] = []
    output_token_ids: list[int] = []
    # Tokens this step must not sample: EOS and stop_token_ids while the output is shorter
    # than min_tokens.
    blocked_token_ids: list[int] = []
    # Structured outputs: the tokens its grammar allows next (engine.structured_output.bitmask),
    # from the state its committed output left; None: no grammar.
    allowed_token_bitmask: bytes | None = None
    # Prompt logprobs: row i of this chunk is scored against prompt_logprob_targets[i] (the
    # prompt token after it); rows past the list are not scored.
    prompt_logprob_targets: list[int] = []
    # A decode scheduled ahead (async scheduling): its one input token is the token the step
    # before sampled for it, which the host has not read back yet. ``token_ids`` holds
    # PENDING_TOKEN; the executor takes the token from the previous step's samples, on the device.
    last_token_pending: bool = False
    # LongRoPE: rotate this request's tokens by the long factors (engine.core.long_rope).
    long_rope: bool = False


# The input token of a decode scheduled before its token was read back (last_token_pending).
PENDING_TOKEN = -1


class SchedulerOutput(msgspec.Struct, kw_only=True):
    step_id: int
    requests: list[ScheduledRequest]
    # Whether workers vote on stopping this step between layers.
    preemptible: bool = False
    # If the step is unwound, workers keep the activations of its prefill chunks at the layer
    # it stopped at (suspend mode); the engine keeps the victim's and frees the others.
    suspend_on_unwind: bool = False
    # Suspended chunks that will never resume (dropped, preempted for KV, finished): free them.
    free_suspended: list[str] = []
    # Requests whose KV blocks were freed since the last step the workers ran (finished,
    # aborted, preempted): they drop their block tables, before this step's updates.
    released_req_ids: list[str] = []

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def attention_work(self) -> int:
        """The step's quadratic cost feature (see monitor.step_point.attention_work)."""
        return attention_work((r.start_pos, len(r.token_ids)) for r in self.requests)

    @property
    def decode_context(self) -> int:
        """The KV tokens the step's decodes read (see monitor.step_point.decode_context)."""
        return decode_context((r.start_pos, len(r.token_ids)) for r in self.requests)

    def step_point(self, seconds: float, num_layers: int,
                   layers: Mapping[str, tuple[int, int]]) -> StepPoint | None:
        """The predictor's point for this step when it took `seconds` and each request ran
        the layers [start, end) of `layers` (all of them when absent): an unwound or resumed
        step ran only some (see monitor.step_point.step_point)."""
        if not layers:
            # Every chunk ran every layer (most steps): the step's own features, whole.
            if not self.requests:
                return None
            return StepPoint(float(self.num_scheduled_tokens), float(self.attention_work),
                             float(self.decode_context), seconds)
        return step_point(((r.start_pos, len(r.token_ids),
                            *layers.get(r.req_id, (0, num_layers))) for r in self.requests),
                          num_layers, seconds)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class StepStatus(enum.Enum):
    OK = "ok"
    ERROR = "error"
    # The workers unwound the forward pass between two layers (the preemption vote).
    SLO_PREEMPTED = "preempted"


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    step_id: int
    status: StepStatus = StepStatus.OK
    # req_id -> sampled token, for the requests scheduled with sample=True.
    sampled_token_ids: dict[str, int] = {}
    # req_id -> the sampled token's logprobs (requests whose parameters ask for them).
    logprobs: dict[str, LogprobsLists] = {}
    # req_id -> logprobs of the prompt tokens this step's chunk scored (prompt_logprob_targets).
    prompt_logprobs: dict[str, LogprobsLists] = {}
    # req_id -> why no token could be sampled for it (OK steps only): that request alone is
    # finished with an error, the rest of the step commits as usual.
    failed: dict[str, str] = {}
    error: str | None = None
    # SLO_PREEMPTED: the layer before whose attention op the pass stopped.
    slo_preempted_layer: int | None = None
    # SLO_PREEMPTED: the layer each TP rank stopped at (rank order); they must all agree.
    unwound_layers: list[int] = []
    # SLO_PREEMPTED with suspend_on_unwind: the prefill chunks whose activations the workers now
    # hold (none if the pass stopped before the first layer finished).
    suspended_req_ids: list[str] = []
    # req_id -> the layer each chunk resuming a suspended pass joined it at (OK and
    # SLO_PREEMPTED): the layers below it did not run in this step (the TTFT predictor's share).
    resumed_layers: dict[str, int] = {}
    # Wall time of the forward pass + sampling, for the TTFT predictor.
    execute_seconds: float = 0.0
    # TP: time rank 0 spent handing the step to the other ranks.
    transport_seconds: float = 0.0
