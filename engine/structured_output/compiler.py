"""EngineCore's grammar compiler: requests' grammars compiled for the model's vocabulary on a
thread of its own, never on the step loop, and cached (xgrammar's compiler keeps what it
compiled, keyed by the schema, regex or grammar and its options).

A request with structured outputs reaches the scheduler only once its grammar is compiled
(EngineCore.submit_request): it is not scheduled meanwhile, the monitor does not see it, and
its TTFT deadline, counted from its arrival, has already spent the compile time. The
vocabulary's description (xgrammar's TokenizerInfo: each token's bytes) is built on the same
thread, by the first request that needs it or ahead of any (``prepare``): it takes 0.9 s for a
49k-token vocabulary on this CPU and 2.3 s for Llama 3's 128k (the H100 machine, 2026-11-28).
A server prepares it before it reports ready (engine/ipc/core_process.py): an agent's first
turn is as urgent as any, and a build while requests run would slow their steps (most of it is
Python, holding the GIL).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from engine.structured_output.grammar import compile_for_vocabulary
from engine.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

# xgrammar's own threads per compilation: it splits the vocabulary among them.
COMPILE_THREADS = 2


class GrammarCompiler:
    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        """``vocab_size``: the model's (the logits' width, which may exceed the tokenizer's)."""
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sloserve-grammar")
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None

    def prepare(self) -> Future[xgrammar.GrammarCompiler]:
        """Build the vocabulary's description on the compile thread now, ahead of any request
        (a request's compile queues behind it). Call it once startup's timed work is done: on
        a CPU it takes the cores that a startup calibration would be measuring. The future
        holds the exception of a tokenizer xgrammar cannot read (each constrained request then
        fails with it)."""
        return self._pool.submit(self._vocabulary_compiler)

    @property
    def prepared(self) -> bool:
        """Whether the vocabulary's description is built."""
        return self._compiler is not None

    def submit(self, params: StructuredOutputsParams) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar, later; the future raises ValueError for a grammar xgrammar
        refuses (the API server checked it, so only a vocabulary-dependent failure)."""
        return self._pool.submit(self.compile, params)

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """On the caller's thread (the offline engine's add_request, the pool's)."""
        return compile_for_vocabulary(self._vocabulary_compiler(), params)

    def then(self, params: StructuredOutputsParams,
             done: Callable[[xgrammar.CompiledGrammar | None, str | None], None]) -> None:
        """Compile on the pool, then call ``done(compiled, None)`` or ``done(None, error)`` on
        the pool's thread (an error line safe to show a client)."""
        def finish(future: Future[xgrammar.CompiledGrammar]) -> None:
            try:
                compiled = future.result()
            except ValueError as exc:
                done(None, str(exc))
            except Exception as exc:  # a bug or a tokenizer xgrammar cannot read: this request's
                done(None, f"structured outputs: compiling the grammar failed "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
            else:
                done(compiled, None)
        self.submit(params).add_done_callback(finish)

    def _vocabulary_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                started = time.perf_counter()
                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS)
                logger.info("structured outputs: the vocabulary's description (%d tokens) "
                            "built in %.2f s", self.vocab_size, time.perf_counter() - started)
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
