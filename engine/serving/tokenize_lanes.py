"""Where the API server tokenizes, templates and checks grammars: off the event loop, in two
lanes, so that a short urgent turn never queues behind a document's tokenization.

One thread tokenized everything before: a 31k-token text takes 109 ms to encode on this CPU
(Llama 3's tokenizer; some 50 ms on a GPU host's core), and a chat turn with a 150 ms TTFT
objective that arrived just after such a document waited all of it before the scheduler even
heard of it. Now inputs of LONG_INPUT_CHARS or more take the long lane, everything else the
short one. Each lane is one thread with a tokenizer of its own: HF fast tokenizers must not be
reconfigured from two threads at once (truncation and padding settings live in the Rust object),
and one thread per lane keeps the API server's tokenization at two cores at most, whatever the
load. The long lane loads its copy of the tokenizer on its own thread as the server starts
(some 40 MiB for Llama 3's): loaded when the first long input arrived, it cost 0.3-0.6 s of CPU
in every API server of a fleet at once, in the first second of a flood, when urgent turns
needed those cores.

Hugging Face's tokenizers release the GIL while they encode, so the two lanes run side by side.
A long input waits before its lane takes it, and between the pieces the lane encodes it in
(engine.processing.piecewise_encoding), while first outputs with earlier deadlines are owed
soon (`DueFirstOutputs`, where the process keeps that record): on a shared host its
tokenization would take a core from them.

An input under INLINE_INPUT_CHARS (a chat turn of a few hundred tokens: a millisecond or two)
is templated and tokenized on the event loop itself, not in a lane. A trip through a thread
costs a busy loop far more than the work: the result waits for the loop to come round to it,
behind everything else that arrived meanwhile. Under a flood of 80 requests on a 2-core host
the turns took a median 36-51 ms from their route to their token ids through the short lane,
and 2.2 ms inline (bench/RESULTS.md, Overload). The tokenizer is shared with the short lane's
thread (as the detokenizer, on the loop, already shares it): safe, as nothing reconfigures it
(truncation and padding are never set: chat_template_kwargs refuses them). Inline, it encodes
with the GIL held (InputProcessor.holding_gil): released, the loop waited for the GIL again
behind the process's other busy threads, several times the encode's own time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine.processing.input_processor import ChatMessages, InputProcessor
from engine.serving.due_first_outputs import DueFirstOutputs

T = TypeVar("T")

# About 4k tokens of English: some 10-15 ms of encoding on this CPU. Below it an input is a
# turn, not a document, and waits behind at most another turn.
LONG_INPUT_CHARS = 16_384
# About 1k tokens: up to some 3 ms of templating and encoding, done on the event loop.
INLINE_INPUT_CHARS = 4_096


def text_size(value: Any) -> int:
    """Characters of text in a request's input (chat messages: every string in them, the
    keys aside), the measure of how long its tokenization takes."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_size(v) for v in value)
    return 0


class TokenizeLanes:
    def __init__(self, inputs: InputProcessor, load_long_inputs: Callable[[], InputProcessor],
                 due: DueFirstOutputs | None = None) -> None:
        """``inputs``: the short lane's (the engine client's own); ``load_long_inputs``: builds
        the long lane's, on the long lane's thread, once, starting now; ``due``: the first
        outputs a long input waits for (None: it never waits)."""
        self.inputs = inputs
        self._inline_inputs = inputs.holding_gil()
        self.due = due
        self._load_long_inputs = load_long_inputs
        self._long_inputs: InputProcessor | None = None
        self._short = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sloserve-tokenize")
        self._long = ThreadPoolExecutor(max_workers=1,
                                        thread_name_prefix="sloserve-tokenize-long")
        self._long.submit(self._long_lane_inputs)  # loads now, off the event loop

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the short lane (a short input's work: a grammar check, /tokenize,
        decoding an echo)."""
        return await asyncio.get_running_loop().run_in_executor(self._short, fn, *args)

    async def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids, on the lane its length picks. ValueError as
        InputProcessor.encode."""
        return await self.on_lane(text_size(prompt), lambda inputs: inputs.encode(prompt))

    async def apply_chat_template(self, messages: ChatMessages, add_generation_prompt: bool,
                                  tools: list[dict[str, Any]] | None,
                                  template_kwargs: dict[str, Any] | None) -> list[int]:
        """The messages' token ids through the chat template, on the lane their length picks.
        ValueError as InputProcessor.apply_chat_template."""
        return await self.on_lane(
            text_size(messages) + text_size(tools),
            lambda inputs: inputs.apply_chat_template(messages, add_generation_prompt, tools,
                                                      template_kwargs))

    def shutdown(self) -> None:
        for pool in (self._short, self._long):
            pool.shutdown(wait=False, cancel_futures=True)

    async def on_lane(self, size: int, work: Callable[[InputProcessor], T],
                      deadline: float | None = None) -> T:
        """``work(inputs)`` on the lane an input of `size` characters (text_size) takes, with
        that lane's InputProcessor; below INLINE_INPUT_CHARS, here on the event loop. A long
        input waits for the first outputs due before its own ``deadline`` (wall clock; None:
        none): before its lane takes it, and between the pieces it is encoded in."""
        if size < INLINE_INPUT_CHARS:
            return work(self._inline_inputs)
        loop = asyncio.get_running_loop()
        if size < LONG_INPUT_CHARS:
            return await loop.run_in_executor(self._short, work, self.inputs)
        if self.due is None:
            return await loop.run_in_executor(self._long,
                                              lambda: work(self._long_lane_inputs()))
        deferral = self.due.deferral(deadline)
        await deferral.wait()
        # Encoded in pieces, pausing between them while earlier first outputs are owed.
        return await loop.run_in_executor(
            self._long, lambda: work(self._long_lane_inputs().between_pieces(deferral.pause)))

    def _long_lane_inputs(self) -> InputProcessor:
        """On the long lane's thread only (so built once, with no lock)."""
        if self._long_inputs is None:
            self._long_inputs = self._load_long_inputs()
        return self._long_inputs
