"""A request's grammar state: where its committed output stands in its grammar.

It advances only when EngineCore commits a step's sampled token (Scheduler.update_from_output),
never when a step is scheduled: a step stopped between two layers and rolled back, a KV
preemption (recompute keeps the output tokens, so the state stays where they left it) and a
suspended pass change nothing here, and the next step's mask is computed again from the same
state. Each parallel sample (n > 1) is a request of its own, with a state of its own over the
one compiled grammar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine.structured_output.bitmask import words_for

if TYPE_CHECKING:
    import xgrammar


class RequestGrammar:
    __slots__ = ("_matcher", "_words", "_vocab_size")

    def __init__(self, compiled: xgrammar.CompiledGrammar, stop_token_ids: list[int],
                 vocab_size: int) -> None:
        """``stop_token_ids``: what ends the request (its EOS and stop_token_ids): the grammar
        allows them once its language is complete."""
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        self._vocab_size = vocab_size
        self._words = np.empty((1, words_for(vocab_size)), dtype=np.int32)

    def next_token_bitmask(self) -> bytes:
        """The tokens allowed next (bit t of word t // 32): the ScheduledRequest's mask."""
        self._matcher.fill_next_token_bitmask(self._words, 0)
        return self._words.tobytes()

    def accept(self, token_id: int) -> bool:
        """Advance by a committed token; False if the grammar does not allow it (the state is
        unchanged then)."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing may follow."""
        return bool(self._matcher.is_terminated())
