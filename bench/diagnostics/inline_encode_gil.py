"""What a short chat turn's tokenization costs an event loop that shares its process with busy
threads: the tokenizer's own call (its batch encode releases the GIL for the Rust side) against
InputProcessor.holding_gil (the backend's encode, which keeps it), alone and beside a thread
that runs Python without pause (as a server's router or tokenizing lane does under a flood).

    python -m bench.diagnostics.inline_encode_gil [--model DIR] [--repeat 200]

Prints, for each, the median and mean wall time per call and this thread's CPU time per call,
side by side in one run, and checks that both give the same token ids.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

TURN = "The quick brown fox jumps over the lazy dog near the river bank. " * 30


def _timed(encode: Callable[[], list[int]], repeat: int) -> tuple[float, float, float]:
    """(median wall ms, mean wall ms, CPU ms) per call; one call first, untimed."""
    encode()
    walls = []
    cpu = time.thread_time()
    for _ in range(repeat):
        start = time.perf_counter()
        encode()
        walls.append((time.perf_counter() - start) * 1e3)
    return (statistics.median(walls), statistics.fmean(walls),
            (time.thread_time() - cpu) / repeat * 1e3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the default "
                                                      "model's)")
    parser.add_argument("--repeat", type=int, default=200, help="timed calls of each")
    args = parser.parse_args(argv)

    from engine.entrypoints.default_model import model_path_or_default
    from engine.processing.input_processor import InputProcessor

    inputs = InputProcessor(str(model_path_or_default(args.model)))
    holding = inputs.holding_gil()
    messages = [{"role": "user", "content": TURN}]
    released = list(inputs.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    if holding.apply_chat_template(messages) != released:
        raise SystemExit("holding_gil gives other token ids than the tokenizer's own call")
    ways = {"tokenizer's call (GIL released)": lambda: list(inputs.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False)),
            "holding_gil (GIL kept)": lambda: holding.apply_chat_template(messages)}
    print(f"a chat turn of {len(released)} tokens, {args.repeat} calls each")
    stop = threading.Event()

    def busy() -> None:
        spins = 0
        while not stop.is_set():
            spins += 1

    for beside in ("alone", "beside a busy thread"):
        thread = None
        if beside != "alone":
            thread = threading.Thread(target=busy, daemon=True)
            thread.start()
        for name, encode in ways.items():
            median, mean, cpu = _timed(encode, args.repeat)
            print(f"{beside:22s} {name:34s} p50 {median:6.2f} ms  mean {mean:6.2f} ms  "
                  f"CPU {cpu:5.2f} ms")
        if thread is not None:
            stop.set()
            thread.join()


if __name__ == "__main__":
    main()
