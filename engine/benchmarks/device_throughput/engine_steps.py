"""The engine side of benchmark.py: one engine in this process, each step kind timed.

Step kinds (each figure is a median over steady-state steps of that kind, a step timed from its
start to the next one's, so the output processing between steps counts):

- prefill: prompts of the whole token budget, one per step;
- decode at each batch: full-batch decode steps over random --context-token prompts;
- mixed: `mixed_decodes` running decodes plus one `mixed_chunk`-token chunk of a long prompt per
  step (`MixedWorkload`), the kind that the piecewise CUDA graphs replay; tokens/s counts
  the decodes and the chunk.

`bench_engine` runs every kind on the engine as configured (CUDA graphs on a GPU), and with
--profile then profiles each kind (engine_profile.py). `bench_eager` runs the decode
batches of the graphs comparison and the mixed kind again on an engine with
`enforce_eager=True`; benchmark.py starts it in this process before the graphs engine
and frees its memory first (`free_device_memory`).

Each figure is handed to a `record(kind, figures)` callback the moment it is measured (kinds
`startup`, `prefill`, `decode`, `mixed`, `graphs`), so that benchmark.py writes it
to its JSON-lines file before the next one starts: a run killed at its time limit keeps them.

An engine's startup (`startup`): wall seconds to build the `LLM` (load, warm-up compile, graph
capture), the bench's own warm-up requests after it, and the runner's `startup_report` (warm-up
and capture seconds, graph memory, counts: workers/startup/serving_startup.py) where the runner has one
and is in this process.

Why one process for both engines, not a subprocess: the fixed pool (`num_kv_blocks`) needs no
memory profile, so even an engine whose memory were not all given back leaves the next one
room (the 8B shape's weights and pool are about a third of an H100), and the second engine
reuses the process's CUDA context and compiled Triton kernels instead of paying for them again.
What the first engine left allocated is measured and reported (`memory_left_gb`).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from engine.benchmarks.measure.step_log import step_gaps
from engine.core.kv_groups import KVCacheGroup, pool_blocks_needed

# Tokens each warm-up prompt generates (the whole-budget one too: the context must hold them).
WARMUP_TOKENS = 4
BLOCK_SIZE = 16
# A model without sliding layers: one group of every layer (the layers do not matter here).
FULL_ATTENTION = (KVCacheGroup(layers=(0,)),)

# record(kind, figures): one figure as it is measured (benchmark.py writes it out).
Record = Callable[[str, dict[str, Any]], None]


def _no_record(kind: str, figures: dict[str, Any]) -> None:
    pass


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _decode_max_tokens(batch: int, context: int, budget: int, steps: int) -> int:
    """Enough tokens that every request is still decoding once the last prompt is prefilled:
    the first ones start decoding while later prompts take the budget's remaining tokens."""
    prefill_steps = math.ceil(batch * context / max(budget - batch, 1))
    return prefill_steps + steps + 2


# ---------------------------------------------------------------------------------------------
# The mixed kind


@dataclass(frozen=True)
class MixedWorkload:
    """`decodes` requests decoding while long prompts of `prompt_len` tokens are prefilled one
    after the other in `chunk`-token chunks: every steady step is the decodes plus one chunk.

    Two scheduler settings make the steps steady (`scheduler_settings`): the chunk cap
    (long_prefill_token_threshold) and one sequence slot beyond the decodes (max_num_seqs), so
    the next long prompt waits for the previous one instead of taking the budget's rest as a
    second chunk. Each prompt is a whole number of chunks, so no chunk is short once the decodes
    are all decoding (the first prompt's may be, beside their prefill: `is_mixed_step` leaves
    those steps out, and `for_sizes` adds a prompt for them)."""

    decodes: int
    context: int
    chunk: int
    prompt_len: int
    prompts: int
    decode_max_tokens: int

    @classmethod
    def for_sizes(cls, sizes: dict[str, Any], steps: int) -> MixedWorkload:
        """Enough long prompts for at least `steps` steady steps, one more for the first
        prompt's chunks that run beside the decodes' own prefill."""
        budget, chunk, decodes = sizes["prefill_len"], sizes["mixed_chunk"], sizes["mixed_decodes"]
        chunks_per_prompt = budget // chunk
        prompts = math.ceil(steps / chunks_per_prompt) + 1
        # The decodes' prefill shares each step with a chunk; they must outlast every chunk.
        own_prefill = math.ceil(decodes * sizes["context"] / max(budget - decodes - chunk, 1))
        return cls(decodes=decodes, context=sizes["context"], chunk=chunk,
                   prompt_len=chunks_per_prompt * chunk, prompts=prompts,
                   decode_max_tokens=own_prefill + prompts * chunks_per_prompt + 2)

    def is_mixed_step(self, step: dict) -> bool:
        """A steady step (from engine.benchmarks.measure.step_log's record_steps): every decode and one
        whole chunk."""
        sizes = [n for _, n in step["requests"]]
        return (len(sizes) == self.decodes + 1 and sizes.count(1) == self.decodes
                and self.chunk in sizes)

    def run(self, llm: Any, vocab: int, seed: int) -> None:
        from engine.benchmarks.inputs.random_prompts import random_prompts
        from engine import SamplingParams

        decodes = random_prompts(vocab, self.decodes, self.context, seed)
        long_prompts = random_prompts(vocab, self.prompts, self.prompt_len, seed + 1)
        # The long prompts come last: FCFS admits the decodes first.
        params = ([SamplingParams(temperature=0, ignore_eos=True,
                                  max_tokens=self.decode_max_tokens)] * self.decodes
                  + [SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)]
                  * self.prompts)
        with scheduler_settings(llm, long_prefill_token_threshold=self.chunk,
                                max_num_seqs=self.decodes + 1):
            llm.generate([{"prompt_token_ids": p} for p in decodes + long_prompts], params)


@contextmanager
def scheduler_settings(llm: Any, **settings: Any) -> Iterator[None]:
    """The engine's scheduler settings changed for the steps run inside, then put back. The
    scheduler and its admission read these fields of their config at every step (the startup
    calibration's scratch scheduler relies on the same), so one engine measures kinds that need
    different settings, and the other kinds keep the engine's own."""
    config = llm.engine.scheduler.config
    unknown = [name for name in settings if not hasattr(config, name)]
    if unknown:
        raise AttributeError(f"the scheduler config has no {', '.join(unknown)}")
    saved = {name: getattr(config, name) for name in settings}
    for name, value in settings.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


# ---------------------------------------------------------------------------------------------
# One engine


def engine_limits(sizes: dict[str, Any],
                  kv_groups: Sequence[KVCacheGroup] = FULL_ATTENTION) -> dict[str, int]:
    """Sequence slots, context and a KV pool for every kind: the biggest decode batch plus two
    prefills, or the mixed kind's decodes plus one long prompt. --num-kv-blocks sizes the pool
    without the GPU memory profile, and no figure here depends on a pool bigger than that. The
    pool is shared by the model's KV cache groups (`kv_groups_of`): a request holds blocks in
    each, so a model with sliding layers needs a pool several times one group's blocks."""
    budget, context, steps = sizes["prefill_len"], sizes["context"], sizes["decode_steps"]
    biggest = max(sizes["batches"])
    decode_len = context + _decode_max_tokens(biggest, context, budget, steps)
    mixed = MixedWorkload.for_sizes(sizes, steps + 1)
    mixed_len = context + mixed.decode_max_tokens

    def blocks_for(tokens: int) -> int:
        return pool_blocks_needed(kv_groups, tokens + 1, BLOCK_SIZE, max_chunk=budget)

    return {
        "max_num_seqs": max(biggest, mixed.decodes + 1),
        "max_model_len": max(budget + WARMUP_TOKENS, decode_len, mixed_len,
                             mixed.prompt_len + 1) + 1,
        "num_kv_blocks": max(biggest * blocks_for(decode_len)
                             + 2 * blocks_for(budget + WARMUP_TOKENS),
                             mixed.decodes * blocks_for(mixed_len) + blocks_for(mixed.prompt_len))
        + 16}


def start_engine(model_dir: str, device: torch.device, dtype: torch.dtype, sizes: dict[str, Any],
                 seed: int, enforce_eager: bool,
                 async_scheduling: bool = False) -> tuple[Any, list[dict], dict[str, Any]]:
    """(the LLM, its step log, what it started with), warmed up: a whole-budget prefill and a
    few decodes ran, so first-use kernel compiles are not timed. What it started with carries
    its `startup` (`startup_figures`)."""
    from engine.benchmarks.inputs.random_prompts import random_prompts
    from engine.benchmarks.measure.step_log import record_steps
    from engine import LLM, SamplingParams

    limits = engine_limits(sizes, kv_groups_of(model_dir))
    budget = sizes["prefill_len"]
    started = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", device=device.type,
              dtype=str(dtype).removeprefix("torch."), enable_prefix_caching=False,
              max_num_batched_tokens=budget, max_num_seqs=limits["max_num_seqs"],
              max_model_len=limits["max_model_len"], block_size=BLOCK_SIZE,
              num_kv_blocks=limits["num_kv_blocks"], startup_calibration=False, seed=seed,
              enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    build_s = time.perf_counter() - started
    info = {"startup_s": build_s, "kv_blocks": limits["num_kv_blocks"],
            "enforce_eager": llm.engine.config.model.enforce_eager}
    steps_log = record_steps(llm)
    try:
        warm = random_prompts(_vocab(model_dir), 2, budget, seed=seed + 10_000)
        lengths = (budget, sizes["context"])
        warmed = time.perf_counter()
        llm.generate([{"prompt_token_ids": p[:n]} for p, n in zip(warm, lengths)],
                     SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True))
        info["startup"] = startup_figures(llm, build_s, time.perf_counter() - warmed)
    except BaseException:
        release_engine(llm)
        raise
    return llm, steps_log, info


def startup_figures(llm: Any, build_s: float, bench_warmup_s: float) -> dict[str, Any]:
    """How the engine started: `build_s`, the wall seconds of `LLM(...)` (weights, the
    engine's kernel warm-up, CUDA graph capture); `bench_warmup_s`, this bench's own warm-up
    requests after it (any first-use compile the engine's warm-up missed); `report`, the
    runner's `startup_report` as a dict (None where the runner has none, or is in another
    process); `async_scheduling`, whether the loop scheduled ahead."""
    report = getattr(runner_of(llm), "startup_report", None)
    if report is not None:
        report = (dataclasses.asdict(report) if dataclasses.is_dataclass(report)
                  else dict(vars(report)))
    return {"build_s": build_s, "bench_warmup_s": bench_warmup_s,
            "enforce_eager": llm.engine.config.model.enforce_eager,
            "async_scheduling": llm.engine.schedules_ahead, "report": report}


def runner_of(llm: Any) -> Any:
    """The model runner where it is in this process (the in-process executor's), else None."""
    return getattr(getattr(llm.engine, "executor", None), "runner", None)


def release_engine(llm: Any) -> None:
    """Shut the engine down. Its step log is kept by a step observer that holds the log alone
    (engine.benchmarks.measure.step_log), never the engine, so dropping the last reference to the LLM
    frees it and its device memory at once, with no garbage collection. A profile window
    (engine_profile.StepWindow) wraps `step` itself; whatever it left on the engine is taken
    off, since a wrapper over the engine's bound method ties it into a reference cycle."""
    try:
        llm.shutdown()
    finally:
        vars(llm.engine).pop("step", None)


def graph_probe(llm: Any) -> dict[str, Any]:
    """What the engine replayed: its captured decode graph sizes and replays so far (none on
    the CPU or under enforce_eager; None where the runner is in another process)."""
    runner = runner_of(llm)
    if runner is None:
        return {"decode_graph_sizes": None, "decode_graph_replays": None,
                "piecewise_step_sizes": None, "piecewise_replays": None}
    graphs = getattr(runner, "graphs", None)
    pieces = getattr(runner, "piecewise", None)
    return {"decode_graph_sizes": sorted(graphs.graphs) if graphs is not None else [],
            "decode_graph_replays": graphs.replays if graphs is not None else 0,
            "piecewise_step_sizes": sorted(pieces.graphs) if pieces is not None else [],
            "piecewise_replays": pieces.replays if pieces is not None else 0}


def _drop_frames(exc: BaseException) -> None:
    """The finished frames of a failed measurement (a `measure_*` call's) hold the LLM as an
    argument for as long as the exception lives: their locals are cleared, so the engine is
    freed when this bench lets go of it, not when the caller drops the exception."""
    import traceback

    traceback.clear_frames(exc.__traceback__)


def free_device_memory(device: torch.device, baseline_bytes: int) -> float | None:
    """After an engine's shutdown: collect it and return the cached blocks; GB still allocated
    beyond `baseline_bytes` (None on the CPU, which has no allocator to ask)."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return (torch.cuda.memory_allocated(device) - baseline_bytes) / 1e9


def kv_groups_of(model_dir: str) -> list[KVCacheGroup]:
    """The KV cache groups the engine will give the model in ``model_dir``."""
    from engine.executor.model_support import kv_cache_groups_of
    from engine.runtime.model_setup import load_hf_config

    return kv_cache_groups_of(load_hf_config(model_dir))


def _vocab(model_dir: str) -> int:
    from engine.runtime.model_setup import load_hf_config

    return load_hf_config(model_dir).vocab_size


# ---------------------------------------------------------------------------------------------
# Each kind, timed


def measure_prefill(llm: Any, steps_log: list[dict], vocab: int, sizes: dict[str, Any],
                    seed: int) -> dict[str, Any]:
    from engine.benchmarks.inputs.random_prompts import random_prompts
    from engine import SamplingParams

    budget = sizes["prefill_len"]
    prompts = random_prompts(vocab, sizes["prefill_prompts"] + 1, budget, seed)[1:]
    steps_log.clear()
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    elapsed = time.perf_counter() - started
    figures = {"prompt_len": budget, "prompts": len(prompts), "steps": len(steps_log),
               "tokens_per_s": budget * len(prompts) / elapsed,
               "step_ms": 1000 * statistics.median(s["end"] - s["start"] for s in steps_log)}
    _progress(f"engine prefill {budget}: {figures['tokens_per_s']:.0f} tok/s")
    return figures


def measure_decode(llm: Any, steps_log: list[dict], vocab: int, sizes: dict[str, Any],
                   batch: int, seed: int) -> dict[str, Any]:
    from engine.benchmarks.inputs.random_prompts import random_prompts
    from engine.benchmarks.measure.step_log import decode_seconds_per_step
    from engine import SamplingParams

    context = sizes["context"]
    prompts = random_prompts(vocab, batch, context, seed + batch)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=_decode_max_tokens(
        batch, context, sizes["prefill_len"], sizes["decode_steps"]))
    steps_log.clear()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    step_s, contexts, measured = decode_seconds_per_step(steps_log, batch)
    if measured == 0:
        raise RuntimeError(f"decode batch {batch}: no step decoded the whole batch "
                           f"(the scheduler never ran all {batch} requests together)")
    full = [s for s in steps_log if len(s["requests"]) == batch
            and all(n == 1 for _, n in s["requests"])]
    figures = {"batch": batch, "context": context, "mean_context": contexts[0],
               "steps_measured": measured, "tokens_per_s": batch / step_s,
               "tpot_ms": 1000 * step_s,
               "step_ms_max": 1000 * max(s["end"] - s["start"] for s in full)}
    _progress(f"engine decode {batch} x {context}: {batch / step_s:.1f} tok/s, "
              f"TPOT {1000 * step_s:.2f} ms")
    return figures


def measure_mixed(llm: Any, steps_log: list[dict], vocab: int, sizes: dict[str, Any],
                  seed: int) -> dict[str, Any]:
    """The mixed kind: median step (= the decodes' TPOT) and tokens/s, decodes and chunk."""
    workload = MixedWorkload.for_sizes(sizes, sizes["decode_steps"] + 1)
    steps_log.clear()
    workload.run(llm, vocab, seed + 30_000)
    mixed = [i for i, s in enumerate(steps_log) if workload.is_mixed_step(s)]
    if not mixed:
        raise RuntimeError(f"mixed: no step ran {workload.decodes} decodes and one "
                           f"{workload.chunk}-token chunk together")
    step_s = statistics.median(step_gaps(steps_log, mixed))
    contexts = [p + 1 for i in mixed for p, n in steps_log[i]["requests"] if n == 1]
    chunk_starts = [p for i in mixed for p, n in steps_log[i]["requests"] if n != 1]
    tokens = workload.decodes + workload.chunk
    preemption = llm.engine.config.slo_preemption
    figures = {"batch": workload.decodes, "chunk": workload.chunk, "context": workload.context,
               "prompt_len": workload.prompt_len, "long_prompts": workload.prompts,
               "mean_context": sum(contexts) / len(contexts),
               "mean_chunk_start": sum(chunk_starts) / len(chunk_starts),
               "steps_measured": len(mixed), "tokens_per_step": tokens,
               "step_ms": 1000 * step_s, "tpot_ms": 1000 * step_s,
               "tokens_per_s": tokens / step_s, "decode_tokens_per_s": workload.decodes / step_s,
               # The scheduler marks a step preemptible (its workers vote at each attention
               # op) from this many prefill tokens: the piecewise graphs' kind of step.
               "preemptible": (preemption.enabled
                               and workload.chunk >= preemption.min_tokens)}
    _progress(f"engine mixed {workload.decodes} decodes + {workload.chunk}-token chunk: "
              f"{tokens / step_s:.0f} tok/s, step {1000 * step_s:.2f} ms")
    return figures


# ---------------------------------------------------------------------------------------------
# The two engines


def bench_engine(model_dir: str, device: torch.device, dtype: torch.dtype,
                 sizes: dict[str, Any], seed: int, profile_steps: int = 0,
                 profile_deadline: float | None = None,
                 record: Record = _no_record, enforce_eager: bool = False,
                 async_scheduling: bool = False) -> dict[str, Any]:
    """Every kind on the engine as configured (CUDA graphs on a GPU), each handed to `record`
    as it is measured; with profile_steps, then a torch.profiler summary of that many steps of
    each kind under "profile" (engine_profile.py), started only before `profile_deadline` (a
    perf_counter time). `enforce_eager`: as the GPU suite runs it after a failed capture.
    `async_scheduling`: the engine's (its startup says whether the loop really ran ahead)."""

    def measure(llm: Any, steps_log: list[dict], vocab: int, result: dict[str, Any]) -> None:
        result["prefill"] = measure_prefill(llm, steps_log, vocab, sizes, seed)
        record("prefill", result["prefill"])
        _measure_decode_and_mixed(llm, steps_log, vocab, sizes, sizes["batches"], seed, record,
                                  result)
        if profile_steps:
            # After every timed figure: profiling slows the steps it records.
            result["profile"] = profile_engine(llm, steps_log, device, vocab, sizes, seed,
                                               result, profile_steps, profile_deadline)

    return _on_an_engine(model_dir, device, dtype, sizes, seed, record, enforce_eager, measure,
                         async_scheduling)


def _on_an_engine(model_dir: str, device: torch.device, dtype: torch.dtype,
                  sizes: dict[str, Any], seed: int, record: Record, enforce_eager: bool,
                  measure: Callable[[Any, list[dict], int, dict[str, Any]], None],
                  async_scheduling: bool = False) -> dict[str, Any]:
    """Start an engine, record its startup, run `measure(llm, steps_log, vocab, result)`, and
    release the engine whatever happened: the caller's next engine must not find this one's
    memory still taken."""
    llm, steps_log, result = start_engine(model_dir, device, dtype, sizes, seed,
                                          enforce_eager=enforce_eager,
                                          async_scheduling=async_scheduling)
    record("startup", result["startup"])
    vocab = _vocab(model_dir)
    try:
        measure(llm, steps_log, vocab, result)
    except BaseException as exc:
        _drop_frames(exc)
        raise
    finally:
        release_engine(llm)
        del llm
    return result


def _measure_decode_and_mixed(llm: Any, steps_log: list[dict], vocab: int, sizes: dict[str, Any],
                              batches: list[int], seed: int, record: Record,
                              result: dict[str, Any]) -> None:
    """Decode at each of `batches`, the mixed kind and the graphs probe, into `result`, each
    handed to `record` as it is measured: what the graphs engine and the eager one both time."""
    result["decode"] = {}
    for batch in batches:
        result["decode"][str(batch)] = measure_decode(llm, steps_log, vocab, sizes, batch, seed)
        record("decode", result["decode"][str(batch)])
    result["mixed"] = measure_mixed(llm, steps_log, vocab, sizes, seed)
    record("mixed", result["mixed"])
    result["graphs"] = graph_probe(llm)
    record("graphs", result["graphs"])


def bench_eager(model_dir: str, device: torch.device, dtype: torch.dtype,
                sizes: dict[str, Any], seed: int, record: Record = _no_record) -> dict[str, Any]:
    """The graphs comparison's decode batches (`eager_batches`) and the mixed kind on an engine
    with enforce_eager=True, same sizes and prompts as `bench_engine`'s, each handed to
    `record` as it is measured. The engine's memory is given back before this returns, failed
    or not: the graphs engine starts next."""
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        result = _eager_figures(model_dir, device, dtype, sizes, seed, record)
    finally:
        left = free_device_memory(device, baseline)
    result["memory_left_gb"] = left
    return result


def _eager_figures(model_dir: str, device: torch.device, dtype: torch.dtype,
                   sizes: dict[str, Any], seed: int, record: Record) -> dict[str, Any]:
    def measure(llm: Any, steps_log: list[dict], vocab: int, result: dict[str, Any]) -> None:
        _measure_decode_and_mixed(llm, steps_log, vocab, sizes, sizes["eager_batches"], seed,
                                  record, result)

    return _on_an_engine(model_dir, device, dtype, sizes, seed, record, True, measure)


# ---------------------------------------------------------------------------------------------
# --profile


@dataclass(frozen=True)
class ProfileKind:
    """One step kind to profile: its label and JSON fields, a `generate` that runs enough steps
    of it, the step-log test that picks them, and the timed figure it is set beside."""

    label: str
    info: dict[str, Any]
    generate: Callable[[], Any]
    wanted: Callable[[dict], bool]
    timed_step_ms: float


def profile_kinds(llm: Any, vocab: int, sizes: dict[str, Any], seed: int,
                  timed: dict[str, Any], steps: int) -> list[ProfileKind]:
    """Prefill, then mixed, then decode at each batch: the mixed kind before the decode batches,
    so that a --profile-until-s deadline leaves out the biggest batch (the slowest to set up)
    first. Fresh prompts (no prefix caching either way); the window needs steps + 3 of a kind:
    one unprofiled, the profiler's warm-up step, the measured ones and one that ends the last."""
    from engine.benchmarks.inputs.random_prompts import random_prompts
    from engine import SamplingParams

    budget, context = sizes["prefill_len"], sizes["context"]
    needed = steps + 3
    prefill_prompts = random_prompts(vocab, needed, budget, seed + 20_000)
    kinds = [ProfileKind(
        f"prefill {budget}", {"phase": "prefill", "batch": 1, "tokens": budget},
        lambda: llm.generate([{"prompt_token_ids": p} for p in prefill_prompts],
                             SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
        lambda s: len(s["requests"]) == 1 and s["requests"][0][1] == budget,
        timed["prefill"]["step_ms"])]
    mixed = MixedWorkload.for_sizes(sizes, needed)
    kinds.append(ProfileKind(
        f"mixed {mixed.decodes} + {mixed.chunk}",
        {"phase": "mixed", "batch": mixed.decodes + 1, "tokens": mixed.decodes + mixed.chunk},
        lambda: mixed.run(llm, vocab, seed + 40_000), mixed.is_mixed_step,
        timed["mixed"]["step_ms"]))
    for batch in sizes["batches"]:
        def run(batch: int = batch) -> None:
            prompts = random_prompts(vocab, batch, context, seed + 20_000 + batch)
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, ignore_eos=True, max_tokens=(
                             _decode_max_tokens(batch, context, budget, needed))))

        kinds.append(ProfileKind(
            f"decode {batch}", {"phase": "decode", "batch": batch, "tokens": batch}, run,
            lambda s, batch=batch: len(s["requests"]) == batch
            and all(n == 1 for _, n in s["requests"]),
            timed["decode"][str(batch)]["tpot_ms"]))
    return kinds


def profile_engine(llm: Any, steps_log: list[dict], device: torch.device, vocab: int,
                   sizes: dict[str, Any], seed: int, timed: dict[str, Any], steps: int,
                   deadline: float | None) -> dict[str, Any]:
    """Each kind of `profile_kinds`, profiled over `steps` steady-state steps. A kind not
    started by the deadline is left out (and named), so a time-limited run still ends in
    time."""
    from engine.benchmarks.device_throughput.engine_profile import StepWindow

    window = StepWindow(llm, steps_log, device)
    out: dict[str, Any] = {"device": device.type, "steps": steps, "kinds": {}}
    skipped = []
    try:
        for kind in profile_kinds(llm, vocab, sizes, seed, timed, steps):
            if deadline is not None and time.perf_counter() > deadline:
                skipped.append(kind.label)
                continue
            out["kinds"][kind.label] = _profile_one(window, kind, steps)
    finally:
        window.restore()
    if skipped:
        out["skipped"] = (f"{', '.join(skipped)} (the run had reached its --profile-until-s "
                          f"before they started)")
    return out


def _profile_one(window: Any, kind: ProfileKind, steps: int) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        summary = window.run(kind.generate, kind.wanted, steps, kind.timed_step_ms)
    except Exception as exc:  # noqa: BLE001 - one kind failing keeps the others
        _progress(f"profile {kind.label}: {type(exc).__name__}: {exc}")
        return {**kind.info, "error": f"{type(exc).__name__}: {exc}"}
    busy = summary["busy_pct"]
    _progress(f"profile {kind.label}: {summary['ops_per_step']} ops/step"
              + ("" if busy is None else f", GPU busy {busy:.0f}% of the step")
              + f" ({time.perf_counter() - started:.1f} s)")
    return {**kind.info, **summary, "profile_s": time.perf_counter() - started}
