"""How well the step-time model predicts the engine's own steps, with and without the decode term.

Runs waves of requests with prompts of 64 to 2048 tokens and outputs of 16 to 64 tokens on the
engine (prefill-only steps of many sizes, mixed steps, decode-only steps over short and long
contexts), records every step's features and wall time as the engine feeds them to its online
model, then fits each model variant on the even-numbered steps and reports its relative errors on
the odd-numbered ones, per kind of step:

- `prefill-only`: the model before the decode term (line plus attention term, fitted on steps
  with a prefill chunk only, every decode counted as attention work).
- `decode-term`: the model the engine fits now (both windows, decode term).

    python -m bench.diagnostics.step_model                # default model, ~3 minutes on 2 CPU cores
    python -m bench.diagnostics.step_model --model DIR --requests 16
    python -m bench.diagnostics.step_model --load-steps steps.json   # score recorded steps again
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import numpy as np

from engine.runtime.step_timing import StepTiming
from monitor.step_point import StepPoint
from monitor.step_time_fit import fit_step
from monitor.step_time_model import StepTimeModel

# (tokens, attention, decode_context, decodes, seconds) of one step.
Step = tuple[int, int, int, int, float]


def record_steps(model: str | None, num_requests: int, budget: int, seed: int,
                 wave: int = 4) -> list[Step]:
    from engine.entrypoints.default_model import model_path_or_default
    from engine.entrypoints.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model=model_path_or_default(model), dtype="float32",
              max_num_batched_tokens=budget, enable_prefix_caching=False)
    steps: list[Step] = []
    online = llm.engine.step_time_predictor
    observe = online.observe_point
    observed: list[StepPoint] = []

    def recording(point: StepPoint) -> None:
        observed.append(point)  # the step's features, while the step runs
        observe(point)

    def stepped(timing: StepTiming) -> None:
        # After the step's point: its decodes are the requests that ran one token.
        decodes = sum(1 for _, tokens in timing.requests if tokens == 1)
        for point in observed:
            # Every step here runs all its layers (no preemption): whole-step features.
            steps.append((round(point.tokens), round(point.attention),
                          round(point.decode_context), decodes, point.seconds))
        observed.clear()

    # The predictor's own observations, recorded on their way through; the decode count from
    # the engine's step hook.
    online.observe_point = recording  # type: ignore[method-assign]
    llm.engine.step_observers.append(stepped)
    rng = random.Random(seed)
    vocab = llm.engine.vocab_size
    longest = min(2048, llm.engine.max_model_len - 64)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab)
                                     for _ in range(rng.randint(64, longest))]}
               for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=rng.randint(16, 64), temperature=0.0, ignore_eos=True)
              for _ in range(num_requests)]
    try:
        llm.generate(prompts[:1], params[:1])  # warm-up, not recorded
        steps.clear()
        # In waves: each starts with prefill steps of different sizes and ends decoding alone.
        for start in range(0, num_requests, wave):
            llm.generate(prompts[start:start + wave], params[start:start + wave])
    finally:
        llm.shutdown()
    return steps


def kind_of(step: Step) -> str:
    tokens, attention, _, decodes, _ = step
    if attention == 0:
        return "decode-only"
    return "mixed" if decodes else "prefill-only"


def fit_variants(steps: list[Step], quadratic: bool) -> dict[str, StepTimeModel]:
    prefill = [s for s in steps if s[1] > 0]
    # Before the decode term a decode was attention work: n * (2 * prefix + n) = 2 * context - 1.
    old = [(n, q + 2 * c - d, 0, t) for n, q, c, d, t in prefill]
    return {
        "prefill-only": fit_step(old, quadratic=quadratic, decode=False),
        "decode-term": fit_step([(n, q, c, t) for n, q, c, _, t in steps],
                                quadratic=quadratic, decode=True),
    }


def errors(model: StepTimeModel, name: str, steps: list[Step]) -> dict[str, dict[str, float]]:
    by_kind: dict[str, list[float]] = {}
    for step in steps:
        n, q, c, d, seconds = step
        if name == "prefill-only":
            predicted = model.predict_step(n, q + 2 * c - d)
        else:
            predicted = model.predict_step(n, q, c)
        by_kind.setdefault(kind_of(step), []).append(abs(predicted / seconds - 1))
    return {kind: {"steps": len(e), "median_abs_rel_error": round(statistics.median(e), 4),
                   "p90_abs_rel_error": round(float(np.percentile(e, 90)), 4)}
            for kind, e in sorted(by_kind.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--wave", type=int, default=4, help="requests generated together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quadratic", action="store_true", help="fit the attention term too")
    parser.add_argument("--save-steps", type=Path, default=None, help="write the steps as JSON")
    parser.add_argument("--load-steps", type=Path, default=None,
                        help="score the steps of an earlier --save-steps instead of running")
    args = parser.parse_args()
    if args.load_steps:
        steps = [tuple(step) for step in json.loads(args.load_steps.read_text())]
    else:
        steps = record_steps(args.model, args.requests, args.budget, args.seed, args.wave)
    if args.save_steps:
        args.save_steps.write_text(json.dumps(steps))
    train, test = steps[::2], steps[1::2]
    report = {"steps": len(steps), "kinds": {k: sum(kind_of(s) == k for s in steps)
                                             for k in ("prefill-only", "mixed", "decode-only")}}
    for name, model in fit_variants(train, args.quadratic).items():
        report[name] = {"model": {k: v for k, v in vars(model).items() if k != "r2"},
                        "held_out": errors(model, name, test)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
