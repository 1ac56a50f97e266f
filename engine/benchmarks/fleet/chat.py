"""`fleet-chat`: conversations on a fleet, where a router that knows each replica's cache matters.

`fleet-bursts` (engine/benchmarks/fleet/bursts.py) shows that on sloserve replicas an urgent turn
hardly cares where it lands: every replica stops its document's prefill for it. What a replica
cannot do is hold a cache it does not have. In a chat, each turn resends the conversation so far
and adds a short message; the replica that served the previous turn holds the history in its
prefix cache and prefills only the new message, any other prefills the whole history, which on
an 8B model takes longer than the turn's objective. This trace is that:

- `opening` (one per conversation): the conversation's first request, a history of
  OPENING_PROMPT tokens (a pasted file, a long system prompt and earlier turns), 16 output
  tokens, a relaxed TTFT objective of OPENING_SLO_MS.
- `urgent` (the follow-up turns, TURNS_PER_CONVERSATION each): the previous turn's prompt, a
  stand-in for its answer (ANSWER_TOKENS), and a new message of Uniform(64, 512) tokens; a TTFT
  objective from 150 ms (64 new tokens) to 300 ms (512), as `fleet-bursts`' urgent turns. They
  come in bursts from different conversations (fleet-bursts' burst arrivals), and a
  conversation's next turn comes at least THINK_S after its previous one (the user read the
  answer).
- `document`: as in `fleet-bursts` (8k-32k tokens, 10-30 s objectives, Poisson arrivals).

The requests of a conversation carry its `session`, so an HTTP replay salts them alike (their
prefix is shared, as a real user's is) and salts conversations apart. `rate` is the mean rate of
all requests; DOCUMENT_SHARE of them are documents.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from engine.benchmarks.attainment.traces import (AbsoluteSLO, PromptSource, TierSpec,
                                                 Tokenizer, Trace, TraceRequest, Uniform,
                                                 _apportion)
from engine.benchmarks.fleet.bursts import (BURST_GAP_S, BURST_SIZE, DOCUMENT_OUTPUT_TOKENS,
                                            DOCUMENT_PROMPT, DOCUMENT_SLO, URGENT_OUTPUT_TOKENS,
                                            URGENT_PROMPT, URGENT_SLO, burst_arrivals)

DOCUMENT_SHARE = 0.25
OPENING_PROMPT = Uniform(2048, 8192)
OPENING_SLO_MS = 2000.0
ANSWER_TOKENS = URGENT_OUTPUT_TOKENS
TURNS_PER_CONVERSATION = 4
THINK_S = 2.0


def fleet_chat_tiers() -> list[TierSpec]:
    """The tiers as the trace's meta describes them (shares of all requests)."""
    chat = 1.0 - DOCUMENT_SHARE
    opening_share = chat / (1 + TURNS_PER_CONVERSATION)
    return [TierSpec("urgent", chat - opening_share, URGENT_PROMPT, URGENT_OUTPUT_TOKENS,
                     URGENT_SLO),
            TierSpec("opening", opening_share, OPENING_PROMPT, URGENT_OUTPUT_TOKENS,
                     AbsoluteSLO(OPENING_SLO_MS)),
            TierSpec("document", DOCUMENT_SHARE, DOCUMENT_PROMPT, DOCUMENT_OUTPUT_TOKENS,
                     DOCUMENT_SLO)]


def build_fleet_chat(num_requests: int, rate: float, seed: int, tokenizer: Tokenizer,
                     predict_ttft_s: Callable[[int], float],
                     max_prompt_len: int | None = None) -> Trace:
    """The seeded `fleet-chat` trace (see the module docstring)."""
    if num_requests < 1 or not rate > 0:
        raise ValueError(f"fleet-chat: need num_requests >= 1 and rate > 0, got "
                         f"{num_requests}, {rate}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 3401]))
    num_documents, num_chat = _apportion([DOCUMENT_SHARE, 1 - DOCUMENT_SHARE], num_requests)
    num_conversations = math.ceil(num_chat / (1 + TURNS_PER_CONVERSATION)) if num_chat else 0
    num_turns = num_chat - num_conversations
    turn_at, document_at = burst_arrivals(num_turns, num_documents, rate, rng)
    source = PromptSource(tokenizer)
    offsets = iter(rng.permutation(len(source)))

    def text(n: int) -> list[int]:
        return [int(t) for t in source.window(int(next(offsets)), n)]

    def clip(n: int) -> int:
        return n if max_prompt_len is None else min(n, max_prompt_len)

    # (arrival, tier, prompt, slo_ms, session) per request, ordered at the end.
    timed: list[tuple[float, str, list[int], float, str | None]] = []
    for at in document_at:
        n = clip(DOCUMENT_PROMPT.sample(rng))
        timed.append((at, "document", text(n), DOCUMENT_SLO.slo_ms(n, predict_ttft_s), None))

    # Conversations open as the turns need them: a turn goes to the conversation that has
    # waited longest since its last request (at least THINK_S), or opens the next one THINK_S
    # (and up to a second more) before it; the first ones open over the trace's first second,
    # and their turns then come THINK_S after.
    prompts: list[list[int]] = []
    last_at: list[float] = []
    turns_left: list[int] = []
    for at in turn_at:
        ready = [c for c in range(len(prompts))
                 if turns_left[c] > 0 and last_at[c] <= at - THINK_S]
        if ready:
            c = min(ready, key=lambda c: last_at[c])
        elif len(prompts) < num_conversations:
            c = len(prompts)
            opened = at - THINK_S - float(rng.uniform(0.0, 1.0))
            if opened < 0.0:  # the first conversations open over the trace's first second
                opened = float(rng.uniform(0.0, 1.0))
            history = text(clip(OPENING_PROMPT.sample(rng)))
            prompts.append(history)
            last_at.append(opened)
            turns_left.append(TURNS_PER_CONVERSATION)
            timed.append((opened, "opening", history, OPENING_SLO_MS, f"c{c:04d}"))
            at = max(at, opened + THINK_S)
        else:  # every conversation is busy: the oldest one takes it, later
            c = min((c for c in range(len(prompts)) if turns_left[c] > 0),
                    key=lambda c: last_at[c])
            at = last_at[c] + THINK_S
        new_tokens = URGENT_PROMPT.sample(rng)
        prompt = [*prompts[c], *text(ANSWER_TOKENS), *text(new_tokens)]
        if max_prompt_len is not None and len(prompt) > max_prompt_len:
            prompt = prompt[-max_prompt_len:]  # a clipped context keeps its newest tokens
        prompts[c] = prompt
        last_at[c] = at
        turns_left[c] -= 1
        timed.append((at, "urgent", prompt, URGENT_SLO.slo_ms(new_tokens, predict_ttft_s),
                      f"c{c:04d}"))

    timed.sort(key=lambda item: item[0])
    output = {"urgent": URGENT_OUTPUT_TOKENS, "opening": URGENT_OUTPUT_TOKENS,
              "document": DOCUMENT_OUTPUT_TOKENS}
    requests = [TraceRequest(request_id=f"{i:05d}-{tier}", tier=tier, arrival_s=at,
                             prompt_token_ids=prompt, output_tokens=output[tier],
                             ttft_slo_ms=slo_ms, session=session)
                for i, (at, tier, prompt, slo_ms, session) in enumerate(timed)]
    meta = {"workload": "fleet-chat", "seed": seed, "num_requests": len(requests),
            "rate": rate, "arrival": "fleet-chat", "burstiness": None,
            "max_prompt_len": max_prompt_len,
            "tokenizer": str(getattr(tokenizer, "name_or_path", "") or
                             type(tokenizer).__name__),
            "corpus_sha256": source.sha256, "tiers": [t.describe() for t in fleet_chat_tiers()],
            "conversations": len(prompts), "turns_per_conversation": TURNS_PER_CONVERSATION,
            "think_s": THINK_S, "burst_size": list(BURST_SIZE), "burst_gap_s": BURST_GAP_S}
    return Trace(requests=requests, meta=meta)
