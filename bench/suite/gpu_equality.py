"""Greedy equality against HF transformers at mid-size shapes, on the device the engine serves on.

Random-weight Llama and Qwen2 checkpoints (seeded, float32, built here: nothing is fetched) are
run by the engine and by HF transformers' `generate` on the same device, and every greedy output
must be equal token for token. Three scenarios per architecture:

- ``odd_lengths``: prompts of odd lengths up to 4k tokens, served together, the longer ones
  chunked by the token budget;
- ``cramped_pool``: a KV pool too small for the batch, probed: KV preemptions happened;
- ``urgent_mid_prefill``: a short urgent request arrives while a long prompt is being prefilled
  in one step, probed: that step was stopped mid-forward (an SLO preemption), and both outputs
  still equal the reference.

At an output's first diverging token the reference is asked for its top two next tokens: where
the engine's and the reference's tokens are those two and the lead is below
``engine.benchmarks.reference.greedy_divergence.NEAR_TIE_MARGIN``, the divergence is a near-tie of random weights
(CUDA graphs, other kernels and HF sum in other orders), reported as such and passed; a clear
lead, or a token outside the top two, is a mismatch and fails the scenario.

    python -m bench.suite.gpu_equality --device cuda --output equality.json
    python -m bench.suite.gpu_equality --device cpu --smoke    # tiny shapes, for CI
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.suite import dry_run
from engine.benchmarks.reference.greedy_divergence import compare_greedy, hf_top_two
from engine.benchmarks.reference.hf_reference import hf_greedy, load_hf_model
from engine.benchmarks.inputs.random_checkpoints import make_random_model, save_small_tokenizer


@dataclass(frozen=True)
class Shapes:
    """One run's sizes: the checkpoint and each scenario's prompts."""
    model: dict[str, Any]
    odd_lengths: tuple[int, ...]
    budget: int
    max_new_tokens: int
    cramped_prompts: int
    cramped_prompt_len: int
    cramped_blocks: int
    long_prompt: int
    layer_delay_us: int = 0  # the runner's test hook: slows a tiny model's layers on a CPU


FULL = Shapes(
    model=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
               num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
               max_position_embeddings=32768, rms_norm_eps=1e-6, initializer_range=0.1),
    odd_lengths=(1, 3, 17, 127, 513, 1031, 2049, 4095), budget=2048, max_new_tokens=16,
    cramped_prompts=8, cramped_prompt_len=301, cramped_blocks=96, long_prompt=16383)
SMOKE = Shapes(
    model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
               max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.3),
    odd_lengths=(1, 3, 17, 129, 257), budget=128, max_new_tokens=8,
    cramped_prompts=4, cramped_prompt_len=61, cramped_blocks=12, long_prompt=401,
    layer_delay_us=150)


@dataclass
class Scenario:
    name: str
    prompts: int
    equal: int
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    # Outputs that diverged where the reference's top two nearly tie (accepted).
    near_ties: list[dict[str, Any]] = field(default_factory=list)
    probe: dict[str, Any] = field(default_factory=dict)
    probe_ok: bool = True
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.equal + len(self.near_ties) == self.prompts and self.probe_ok


def _prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _compare(name: str, hf: Any, prompts: list[list[int]], got: list[list[int]],
             want: list[list[int]]) -> Scenario:
    divergences = compare_greedy(prompts, got, want, hf_top_two(hf))
    scenario = Scenario(name, prompts=len(prompts), equal=len(prompts) - len(divergences))
    for d in divergences:
        entry = {"prompt_len": len(prompts[d.output]), **d.as_dict(),
                 "engine": got[d.output][d.position:d.position + 4],
                 "reference": want[d.output][d.position:d.position + 4],
                 # The names suite/summary.py reads (NaN: the outputs' lengths differ).
                 "first_diff": d.position,
                 "reference_top2_margin": d.top_two.margin if d.top_two else float("nan")}
        (scenario.near_ties if d.near_tie else scenario.mismatches).append(entry)
    return scenario


def _greedy(max_tokens: int) -> Any:
    from engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def odd_lengths(model: str, hf: Any, shapes: Shapes, device: str) -> Scenario:
    from engine import LLM

    # No deadlines here: the predictor's startup calibration would only cost time.
    llm = LLM(model=model, dtype="float32", device=device, startup_calibration=False,
              max_num_batched_tokens=shapes.budget, max_model_len=max(shapes.odd_lengths) + 64)
    try:
        prompts = _prompts(list(shapes.odd_lengths), shapes.model["vocab_size"], seed=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            _greedy(shapes.max_new_tokens))
        want = hf_greedy(hf, prompts, shapes.max_new_tokens)
        scenario = _compare("odd_lengths", hf, prompts, [o.token_ids for o in outs], want)
        chunked = [n for n in shapes.odd_lengths if n > shapes.budget]
        scenario.probe = {"longest_prompt": max(shapes.odd_lengths), "budget": shapes.budget,
                          "prompts_chunked": len(chunked)}
        return scenario
    finally:
        llm.engine.shutdown()


def cramped_pool(model: str, hf: Any, shapes: Shapes, device: str) -> Scenario:
    from engine import LLM

    llm = LLM(model=model, dtype="float32", device=device, block_size=16,
              startup_calibration=False,
              num_kv_blocks=shapes.cramped_blocks, max_num_batched_tokens=shapes.budget,
              max_model_len=shapes.cramped_prompt_len + 4 * shapes.max_new_tokens,
              enable_prefix_caching=False)
    try:
        prompts = _prompts([shapes.cramped_prompt_len] * shapes.cramped_prompts,
                           shapes.model["vocab_size"], seed=2)
        max_tokens = 4 * shapes.max_new_tokens
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_tokens))
        want = hf_greedy(hf, prompts, max_tokens)
        scenario = _compare("cramped_pool", hf, prompts, [o.token_ids for o in outs], want)
        preemptions = llm.engine.scheduler.num_kv_preemptions
        scenario.probe = {"kv_blocks": shapes.cramped_blocks, "kv_preemptions": preemptions}
        scenario.probe_ok = preemptions > 0
        return scenario
    finally:
        llm.engine.shutdown()


def urgent_mid_prefill(model: str, hf: Any, shapes: Shapes, device: str) -> Scenario:
    """The long prompt is one step; the urgent request is submitted from another thread when
    that step's forward pass reaches a quarter of its layers, with an SLO (its own TTFT alone
    plus a tenth of the long step, both measured here) that the rest of the step would miss."""
    from engine.config import build_engine_config
    from engine.core.request import Request
    from engine.runtime.engine_core import EngineCore
    from workers.preemption.layer_delay import observe_attention_ops

    vocab = shapes.model["vocab_size"]
    long_prompt, urgent_prompt = _prompts([shapes.long_prompt, 33], vocab, seed=3)
    engine = EngineCore(build_engine_config(
        model, dtype="float32", device=device, max_num_batched_tokens=shapes.long_prompt + 64,
        max_model_len=shapes.long_prompt + 64, scheduling_policy="slo",
        enable_prefix_caching=False, slo_preempt_min_tokens=32))
    max_tokens = shapes.max_new_tokens

    def request(req_id: str, prompt: list[int], slo_ms: float) -> Request:
        return Request(request_id=req_id, prompt_token_ids=prompt, ttft_slo_ms=slo_ms,
                       sampling_params=_greedy(max_tokens))

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    try:
        # Unpreempted runs first (warm-up and the step times the urgent SLO is scaled to).
        long_steps, alone = [], []
        for i in range(2):
            engine.add_request(request(f"warm-long{i}", long_prompt, 600_000))
            started = time.monotonic()
            engine.step()
            long_steps.append(time.monotonic() - started)
            drain()
            engine.add_request(request(f"warm-urgent{i}", urgent_prompt, 600_000))
            started = time.monotonic()
            engine.step()
            alone.append(time.monotonic() - started)
            drain()
        long_step_s, alone_s = min(long_steps), min(alone)
        slo_ms = 1000 * (alone_s + 0.1 * long_step_s)

        runner = engine.executor.runner
        num_layers = runner.model.num_layers
        arrived: list[Request] = []
        reached = threading.Event()

        def observer(layer_idx: int, num_tokens: int) -> None:
            if layer_idx == num_layers // 4 and num_tokens >= shapes.long_prompt:
                reached.set()

        def arrive() -> None:
            if reached.wait(timeout=600):
                arrived.append(request("urgent", urgent_prompt, slo_ms))
                engine.submit_request(arrived[0])

        # At the attention op: it runs in Python in an eager pass and between the pieces of a
        # step replayed as CUDA graphs alike (a module hook inside a piece would never fire).
        stop_observing = observe_attention_ops(runner.model, observer)
        long = request("long", long_prompt, 600_000)
        engine.add_request(long)
        threading.Thread(target=arrive, daemon=True).start()
        drain()
        stop_observing()
        assert engine.slo_preemption is not None
        events = [e for e in engine.slo_preemption.events if e.victim_id == "long"]
        got = [long.output_token_ids, arrived[0].output_token_ids if arrived else []]
        want = hf_greedy(hf, [long_prompt, urgent_prompt], max_tokens)
        scenario = _compare("urgent_mid_prefill", hf, [long_prompt, urgent_prompt], got, want)
        scenario.probe = {
            "long_prompt": shapes.long_prompt, "long_step_ms": round(long_step_s * 1000, 2),
            "urgent_alone_ms": round(alone_s * 1000, 2), "urgent_slo_ms": round(slo_ms, 2),
            "slo_preemptions": len(events),
            "stopped_at_layer": [e.layer for e in events], "num_layers": num_layers,
            "urgent_ttft_ms": (round((arrived[0].first_token_time - arrived[0].arrival_time)
                                     * 1000, 2)
                               if arrived and arrived[0].first_token_time else None)}
        scenario.probe_ok = bool(arrived) and len(events) >= 1 and all(
            0 < e.layer < num_layers for e in events)
        return scenario
    finally:
        engine.shutdown()


def _release_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


SCENARIOS = {"odd_lengths": odd_lengths, "cramped_pool": cramped_pool,
             "urgent_mid_prefill": urgent_mid_prefill}


def run(archs: list[str], shapes: Shapes, device: str, scenarios: list[str]
        ) -> dict[str, Any]:
    if shapes.layer_delay_us:
        from workers.preemption.layer_delay import LAYER_DELAY_ENV

        os.environ[LAYER_DELAY_ENV] = str(shapes.layer_delay_us)
    report: dict[str, Any] = {"device": device, "torch": torch.__version__,
                              "model": shapes.model, "archs": {}}
    if device == "cuda" and not dry_run.enabled():
        report["gpu"] = torch.cuda.get_device_name()
        # float32 means float32: TF32 matmuls would make the reference itself drift.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory(prefix="sloserve-equality-") as tmp:
        for arch in archs:
            folder = Path(tmp) / arch
            save_small_tokenizer(folder)
            make_random_model(folder, arch, seed=0, **shapes.model)
            # Under the suite's --dry-run the first scenario's engine configuration is what
            # is checked (bench/suite/dry_run.py): no HF reference is loaded on a device the dry
            # run does not have.
            hf = None if dry_run.enabled() else load_hf_model(str(folder), torch.float32, device)
            results = {}
            for name in scenarios:
                started = time.monotonic()
                scenario = SCENARIOS[name](str(folder), hf, shapes, device)
                scenario.seconds = round(time.monotonic() - started, 1)
                _release_memory(device)  # the next engine sizes its KV pool from free memory
                results[name] = {**asdict(scenario), "passed": scenario.passed}
                print(f"{arch} {name}: {scenario.equal}/{scenario.prompts} equal, probe "
                      f"{'ok' if scenario.probe_ok else 'FAILED'} {scenario.probe}"
                      + (f", near-ties {scenario.near_ties}" if scenario.near_ties else "")
                      + (f", mismatches {scenario.mismatches}" if scenario.mismatches else ""),
                      flush=True)
            report["archs"][arch] = results
            del hf
            _release_memory(device)
    report["passed"] = all(s["passed"] for a in report["archs"].values() for s in a.values())
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes and prompts (CI on a CPU)")
    parser.add_argument("--archs", nargs="+", default=["llama", "qwen2"],
                        choices=["llama", "qwen2", "qwen3", "mistral"])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS),
                        choices=list(SCENARIOS))
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="write the report as JSON here")
    args = parser.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    report = run(args.archs, SMOKE if args.smoke else FULL, device, args.scenarios)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    total = [s for a in report["archs"].values() for s in a.values()]
    print(f"equality: {sum(s['passed'] for s in total)}/{len(total)} scenarios passed "
          f"({sum(s['equal'] for s in total)}/{sum(s['prompts'] for s in total)} outputs equal)")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
