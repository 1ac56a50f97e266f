"""`sloserve bench structured`: what structured outputs cost a decode step, side by side in one
run: a batch of requests decoding under a JSON schema against the same batch unconstrained.

Both batches decode the same number of tokens: the plain one with `ignore_eos`, the
constrained one under a schema whose string field must be longer than `--max-tokens` (the
grammar never completes, so every request runs to its limit). Rounds alternate plain and
constrained (this 2-core machine is noisy); each request's TPOT is its decode time over its
tokens after the first (the engine's own stamps), and the median over requests and rounds is
printed. Beside it, the time the scheduler spent filling the grammar bitmasks (timed around
each fill), per row and per step, and the schema's compile time (the first, and a cache hit;
the vocabulary's description is built at startup and is not in either).
Prints one JSON object; the target: TPOT overhead <= 10% at batch 16.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from engine.benchmarks.attainment.constraints import LONG_STRING_SCHEMA
from engine.benchmarks.inputs.random_prompts import random_prompts
from engine.benchmarks.measure.figures import print_result
from engine.benchmarks.standalone import standalone_main



@contextmanager
def _timed_fills(times: list[float]) -> Iterator[None]:
    """Each RequestGrammar.next_token_bitmask call's seconds, appended to ``times``."""
    from engine.structured_output.matcher import RequestGrammar

    fill = RequestGrammar.next_token_bitmask

    def timed(self: RequestGrammar) -> bytes:
        started = time.perf_counter()
        try:
            return fill(self)
        finally:
            times.append(time.perf_counter() - started)

    RequestGrammar.next_token_bitmask = timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        RequestGrammar.next_token_bitmask = fill  # type: ignore[method-assign]


def _tpots(outputs: list) -> list[float]:
    tpots = []
    for out in outputs:
        metrics, tokens = out.metrics, len(out.outputs[0].token_ids)
        if tokens > 1 and metrics.first_token_time is not None:
            tpots.append((metrics.finish_time - metrics.first_token_time) / (tokens - 1))
    return tpots


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights (a bench shape's folder, no checkpoint)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", default="auto",
                        help="auto: bfloat16 on a GPU or where this CPU runs it natively, "
                             "else float32")
    parser.add_argument("--batch", type=int, default=16, help="requests decoding together")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="batches per side")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="also write the JSON object printed at the end here")


def run(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.entrypoints.default_model import model_path_or_default
    from engine.structured_output.params import StructuredOutputsParams

    model = model_path_or_default(args.model)
    llm = LLM(model=model, dtype=args.dtype, device=args.device, load_format=args.load_format,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p}
               for p in random_prompts(llm.engine.vocab_size, args.batch, args.prompt_len, 0)]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constraint = StructuredOutputsParams(json=LONG_STRING_SCHEMA)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                 structured_outputs=constraint)
    # The vocabulary's description, which the engine starts building once it is up; then the
    # schema alone (its first compile), then the cache.
    llm.engine.grammars.prepare().result()
    started = time.perf_counter()
    llm.engine.grammars.compile(constraint)
    first_compile_s = time.perf_counter() - started
    started = time.perf_counter()
    llm.engine.grammars.compile(constraint)
    cached_compile_s = time.perf_counter() - started
    llm.generate(prompts[:2], plain)  # warm-up of both paths
    llm.generate(prompts[:2], constrained)

    tpot = {"plain": [], "constrained": []}
    fills: list[float] = []
    constrained_steps = 0
    for round_index in range(args.rounds):
        # Alternate which side goes first, so that a drift of the machine favours neither.
        order = ["plain", "constrained"] if round_index % 2 == 0 else ["constrained", "plain"]
        for side in order:
            if side == "plain":
                outputs = llm.generate(prompts, plain)
            else:
                steps_before = llm.engine.scheduler.step_id
                with _timed_fills(fills):
                    outputs = llm.generate(prompts, constrained)
                constrained_steps += llm.engine.scheduler.step_id - steps_before
                assert all(o.outputs[0].finish_reason == "length" for o in outputs)
            assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outputs)
            tpot[side].extend(_tpots(outputs))
    plain_ms = 1000 * statistics.median(tpot["plain"])
    constrained_ms = 1000 * statistics.median(tpot["constrained"])
    result = {
        "model": model, "device": llm.engine.config.model.device, "dtype": args.dtype,
        "batch": args.batch,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "plain_tpot_ms": round(plain_ms, 3),
        "constrained_tpot_ms": round(constrained_ms, 3),
        "tpot_overhead": round(constrained_ms / plain_ms - 1.0, 4),
        "bitmask_fill_us_per_row": round(1e6 * statistics.median(fills), 2),
        "bitmask_fill_ms_per_step": round(1000 * sum(fills) / max(constrained_steps, 1), 4),
        "bitmask_fill_share_of_tpot": round(sum(fills) / max(constrained_steps, 1)
                                            / (constrained_ms / 1000), 4),
        "first_compile_ms": round(1000 * first_compile_s, 1),
        "cached_compile_ms": round(1000 * cached_compile_s, 3),
        "target": "tpot_overhead <= 0.10 at batch 16",
    }
    print_result(result, args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    """As a script: the same options as the subcommand."""
    return standalone_main(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
