"""LongRoPE's two rotary regimes (Phi-3's long-context checkpoints, Phi-4-mini).

A LongRoPE config carries two sets of rotary frequency factors: ``short_factor`` for sequences
of at most ``original_max_position_embeddings`` tokens (the pretraining length) and
``long_factor`` for longer ones. HF transformers rotates every token of a sequence by the
factors its whole length calls for: a prompt longer than the threshold runs long from its
first token, and when a generated sequence grows past it, HF's Phi-3 drops the cache and
computes the whole sequence again with the long factors (``prepare_inputs_for_generation``).

The engine does the same, per request, whatever the batching and chunking: a request's
``long_rope`` is true once its sequence (computed or pending) is longer than the threshold;
the scheduler sends it with each step (``ScheduledRequest.long_rope``) and the workers rotate
that request's tokens by the long table (workers/layers/rotary.py). A running request that
crosses the threshold is computed again from its first token (a recompute, as a KV-pressure
preemption does), so its KV never mixes the regimes; and the prefix cache keeps the regimes
apart by chaining each regime's block hashes from its own root.
"""

from __future__ import annotations

import hashlib
from typing import Any

# The parent of a long-regime request's first block (the short regime's is all zeros).
LONG_ROPE_ROOT_HASH = hashlib.sha256(b"sloserve longrope long_factor").digest()


def long_rope_threshold(config: Any) -> int | None:
    """The sequence length past which a LongRoPE config rotates by its long factors (its
    ``original_max_position_embeddings``); None for any other rope (one regime)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict) or params.get("rope_type", params.get("type")) != "longrope":
        return None
    threshold = (params.get("original_max_position_embeddings")
                 or getattr(config, "original_max_position_embeddings", None))
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ValueError(f"a longrope config needs original_max_position_embeddings, a positive "
                         f"integer (the length past which long_factor applies), got {threshold!r}")
    return threshold
