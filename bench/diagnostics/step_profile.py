"""Where a CPU decode step's wall time goes: schedule, prepare_inputs, forward, LM head, sampling,
update_from_output and the LLM's output processing, as medians over decode-only steps.

Each part is timed by wrapping the method that does it (the engine's step observers,
engine/runtime/step_timing.py, time whole steps only), so the figures are the engine's own code paths, not a re-implementation. "host" is
everything in a step but the model forward and the LM head: the work to cut where it
shows. Prints one JSON object; `--profile` also runs one configuration under cProfile and prints
its top entries (to stderr).

    python -m bench.diagnostics.step_profile                  # 16/64-way decode over 64/2000 tokens
    python -m bench.diagnostics.step_profile --configs 16x64 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict

import torch

PARTS = ("schedule", "prepare_inputs", "forward", "lm_head", "sampling", "execute_other",
         "update_from_output", "output_processing", "loop_other")


class StepTimer:
    """Wraps the engine's step methods with timers; one record per LLM-loop iteration."""

    def __init__(self, llm) -> None:
        from engine.processing import output_processor

        self.records: list[dict[str, float]] = []
        self._wrapped: list[tuple[object, str, object]] = []
        self._current: dict[str, float] = defaultdict(float)
        self._decode_only = False
        engine = llm.engine
        scheduler = engine.scheduler
        runner = engine.executor.runner
        self._wrap(scheduler, "schedule", "schedule", self._note_kind)
        self._wrap(scheduler, "update_from_output", "update_from_output")
        self._wrap(runner, "execute", "execute")
        self._wrap(runner, "prepare_inputs", "prepare_inputs")
        self._wrap(runner.model, "forward", "forward")
        if getattr(runner, "decode_pass", None) is not None:
            # Decode-only steps through every layer in one call (workers.graphs.cpu_decode_pass).
            self._wrap(runner.decode_pass, "run", "forward")
        self._wrap(runner.model, "compute_logits", "lm_head")
        # The sampler's device work (all of it on a CPU); its read back lands in execute_other.
        self._wrap(runner, "_launch_sample", "sampling")
        self._wrap(engine, "step", "step")
        # The output processor is made per generate() call: wrap its class, and close the
        # iteration's record after it (it is the last thing LLM._run does with a step's outputs).
        cls = output_processor.OutputProcessor
        self._unpatch = (cls, cls.process)
        original = cls.process
        timer = self

        def process(proc_self, outputs):
            started = time.perf_counter()
            try:
                return original(proc_self, outputs)
            finally:
                timer._current["output_processing"] += time.perf_counter() - started
                timer._close()

        cls.process = process
        self._last_close = time.perf_counter()

    def _note_kind(self, out) -> None:
        self._decode_only = bool(out.requests) and all(
            len(r.token_ids) == 1 and not r.resume for r in out.requests)
        self._current["num_requests"] = len(out.requests)

    def _wrap(self, obj, name: str, part: str, after=None) -> None:
        original = getattr(obj, name)
        # Put back by restore(): the instance's own attribute where it had one, else none.
        self._wrapped.append((obj, name, obj.__dict__.get(name)))
        current = self._current

        def timed(*args, **kwargs):
            started = time.perf_counter()
            out = original(*args, **kwargs)
            current[part] += time.perf_counter() - started
            if after is not None:
                after(out)
            return out

        setattr(obj, name, timed)

    def _close(self) -> None:
        now = time.perf_counter()
        record = dict(self._current)
        record["iteration"] = now - self._last_close
        record["decode_only"] = self._decode_only
        self._last_close = now
        self._current.clear()
        self._decode_only = False
        self.records.append(record)

    def restore(self) -> None:
        cls, original = self._unpatch
        cls.process = original
        for obj, name, own in reversed(self._wrapped):
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
        self._wrapped.clear()

    def reset(self) -> None:
        self.records.clear()
        self._current.clear()
        self._last_close = time.perf_counter()


def split(records: list[dict[str, float]], skip: int) -> dict:
    """Medians (ms) of each part over decode-only iterations, after the first `skip` of them."""
    steps = [r for r in records if r["decode_only"]][skip:]
    if not steps:
        raise SystemExit(f"no decode-only step after the first {skip}: raise --max-tokens")
    ms: dict[str, list[float]] = defaultdict(list)
    for r in steps:
        g = lambda k: r.get(k, 0.0)  # noqa: E731
        execute_other = g("execute") - g("prepare_inputs") - g("forward") - g("lm_head") \
            - g("sampling")
        parts = {
            "iteration": g("iteration"), "engine_step": g("step"),
            "schedule": g("schedule"), "prepare_inputs": g("prepare_inputs"),
            "forward": g("forward"), "lm_head": g("lm_head"), "sampling": g("sampling"),
            "execute_other": execute_other, "update_from_output": g("update_from_output"),
            "output_processing": g("output_processing"),
        }
        parts["loop_other"] = parts["iteration"] - parts["engine_step"] \
            - parts["output_processing"]
        parts["step_other"] = parts["engine_step"] - g("schedule") - g("execute") \
            - g("update_from_output")
        parts["host"] = parts["iteration"] - parts["forward"] - parts["lm_head"]
        for k, v in parts.items():
            ms[k].append(1000 * v)
    out = {k: round(statistics.median(v), 3) for k, v in ms.items()}
    out["host_pct_of_iteration"] = round(100 * out["host"] / out["iteration"], 2)
    out["decode_steps"] = len(steps)
    return out


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Avoid the lowest ids (special tokens; a tiny test vocabulary has few ids at all).
    return torch.randint(min(100, vocab // 2), vocab, (count, length), generator=g).tolist()


def run_config(llm, concurrency: int, context: int, max_tokens: int, repeats: int,
               profile: bool, shared_prefix: bool = False) -> dict:
    from engine import SamplingParams

    timer = StepTimer(llm)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    splits = []
    tokens: list[list[int]] | None = None
    profile_text = None
    try:
        for rep in range(repeats):
            prompts = _prompts(llm.engine.vocab_size, concurrency, context, seed=rep)
            if shared_prefix:
                # Only the last block differs: prefix caching prefills the rest once, so a long
                # context's decode steps can be measured without prefilling every prompt (the
                # K/V is read per request all the same, but from the same blocks).
                head = prompts[0][:context - 16]
                prompts = [head + p[context - 16:] for p in prompts]
            timer.reset()
            prof = cProfile.Profile() if profile and rep == repeats - 1 else None
            if prof is not None:
                prof.enable()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            if prof is not None:
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
                profile_text = text.getvalue()
            if rep == 0:
                tokens = [list(o.token_ids) for o in outs]
            # The first decode steps run right after the prefill (allocator and cache warm-up).
            splits.append(split(timer.records, skip=2))
    finally:
        timer.restore()
    # Median of each part over the repeats' medians.
    keys = splits[0].keys()
    result = {k: round(statistics.median(s[k] for s in splits), 3) for k in keys}
    result.update(concurrency=concurrency, context=context, max_tokens=max_tokens,
                  repeats=repeats, shared_prefix=shared_prefix,
                  # Compared across versions of the code: the outputs must not change.
                  output_checksum=hash(tuple(map(tuple, tokens))) & 0xFFFFFFFF)
    if profile_text is not None:
        print(f"=== cProfile {concurrency}x{context} (tottime) ===\n{profile_text}",
              file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--configs", nargs="+", default=["16x64", "64x64", "16x2000", "64x2000"],
                        help="CONCURRENCYxCONTEXT decode configurations")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--shared-prefix", action="store_true",
                        help="prompts share all but their last 16 tokens and prefix caching is "
                             "on: long contexts without prefilling each prompt (a CPU prefills "
                             "64 x 2000 tokens in minutes)")
    parser.add_argument("--profile", action="store_true",
                        help="run each configuration's last repeat under cProfile")
    args = parser.parse_args()

    from engine import LLM

    configs = [tuple(map(int, c.split("x"))) for c in args.configs]
    most = max(n * -(-(ctx + args.max_tokens) // 16) for n, ctx in configs)
    llm = LLM(model=args.model, dtype=args.dtype, device="cpu",  # a CPU step, by design
              enable_prefix_caching=args.shared_prefix,
              max_num_batched_tokens=2048, max_num_seqs=max(n for n, _ in configs),
              num_kv_blocks=most + 16,
              max_model_len=max(ctx for _, ctx in configs) + args.max_tokens)
    results = []
    try:
        for n, ctx in configs:
            results.append(run_config(llm, n, ctx, args.max_tokens, args.repeats, args.profile,
                                      args.shared_prefix))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    finally:
        llm.shutdown()
    print(json.dumps({"dtype": args.dtype, "torch_threads": torch.get_num_threads(),
                      "configs": results}, indent=1))


if __name__ == "__main__":
    main()
