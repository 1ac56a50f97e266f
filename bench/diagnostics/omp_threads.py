"""A CPU step's time by torch thread count and OpenMP wait policy, on a quiet and a busy machine.

For every combination of threads (``OMP_NUM_THREADS``), wait policy and load, a fresh process
(libgomp reads its environment when torch loads it, so each configuration needs its own) builds
the engine on the model and times, with the engine's step observers, a prefill of
``--prompt-tokens`` tokens (one step) and decode steps at batch ``--batch``. The load is
``N`` pure-Python spin loops in child processes, started before the measuring process, bounded in
time and killed when it ends. Wait policies:

- ``active``: libgomp's default (``OMP_WAIT_POLICY`` unset): an idle thread spins about 300k
  iterations at each barrier before it sleeps;
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE``: it sleeps at once (a futex);
- ``spinN``: ``GOMP_SPINCOUNT=N``: it spins N iterations, then sleeps.

Prints one JSON object per configuration (stderr) as it goes, then a markdown table (stdout):
the median milliseconds, each one relative to 1 thread with the same policy and load, and
"other load": the mean number of runnable threads of processes other than the configuration's
own while it ran (each configuration first waits until the machine is quiet; a figure well above
0 means the machine was not).
engine/compute_threads.py decides the engine's threads and wait policy from these figures.

    python -m bench.diagnostics.omp_threads
    python -m bench.diagnostics.omp_threads --threads 1 2 --policies active passive \
        --busy 0 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

# Each spin loop ends on its own after this many seconds even if this process dies first.
SPIN_BOUND_S = 600.0
SPIN_LOOP = ("import time\nend = time.monotonic() + {bound}\n"
             "while time.monotonic() < end:\n    pass\n")
# Names of the environment variables a configuration sets (all others are inherited).
OMP_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def policy_env(policy: str) -> dict[str, str]:
    if policy == "active":
        return {}
    if policy == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    if policy.startswith("spin") and policy[4:].isdigit():
        return {"GOMP_SPINCOUNT": policy[4:]}
    raise ValueError(f"unknown wait policy {policy!r}: active, passive or spinN")


def foreign_runnable(ours: set[int]) -> int:
    """Threads of processes outside ``ours`` that are running or runnable now (/proc): other
    work on the machine, which would make a "quiet" figure a busy one."""
    count = 0
    for stat in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
        if int(stat.parts[2]) in ours:
            continue
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        count += state == "R"
    return count


def wait_until_quiet(limit_s: float) -> float:
    """Waits (at most ``limit_s``) until no other process has been runnable for 3 s in a row;
    returns the seconds waited."""
    started = time.monotonic()
    quiet_since = started
    while time.monotonic() - started < limit_s:
        if foreign_runnable({os.getpid()}):
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= 3.0:
            break
        time.sleep(0.25)
    return time.monotonic() - started


class LoadSampler:
    """The mean number of foreign runnable threads while a configuration runs."""

    def __init__(self, ours: set[int]) -> None:
        self.ours = ours
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.samples.append(foreign_runnable(self.ours))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(statistics.fmean(self.samples), 2) if self.samples else 0.0


def start_spinners(count: int) -> list[subprocess.Popen]:
    code = SPIN_LOOP.format(bound=SPIN_BOUND_S)
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    for proc in processes:
        proc.kill()
    for proc in processes:
        proc.wait()


def run_configuration(threads: int, policy: str, busy: int, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARIABLES}
    env.update(OMP_NUM_THREADS=str(threads), **policy_env(policy))
    command = [sys.executable, "-m", "bench.diagnostics.omp_threads", "--measure",
               "--prompt-tokens", str(args.prompt_tokens), "--batch", str(args.batch),
               "--repeats", str(args.repeats), "--decode-steps", str(args.decode_steps)]
    if args.model:
        command += ["--model", args.model]
    waited = wait_until_quiet(args.quiet_wait)
    spinners = start_spinners(busy)
    sampler = None
    try:
        measuring = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        sampler = LoadSampler({os.getpid(), measuring.pid, *(p.pid for p in spinners)})
        try:
            out, err = measuring.communicate(timeout=SPIN_BOUND_S)
        finally:
            if measuring.poll() is None:
                measuring.kill()
                measuring.wait()
    finally:
        foreign = sampler.stop() if sampler is not None else 0.0
        stop(spinners)
    if measuring.returncode != 0:
        raise RuntimeError(f"threads={threads} {policy} busy={busy} failed:\n{err}")
    figures = json.loads(out.strip().splitlines()[-1])
    return {"threads": threads, "policy": policy, "busy": busy, **figures,
            "foreign_runnable": foreign, "waited_for_quiet_s": round(waited, 1)}


def measure(args: argparse.Namespace) -> dict:
    """In the configured process: the engine's prefill and decode step times (seconds)."""
    import torch

    from engine import LLM, SamplingParams

    prefill: list[float] = []
    decode: list[float] = []
    # Steps as the engine's forward pass runs them, without the output handling around them.
    sink: list = []
    llm = LLM(model=args.model, device="cpu", dtype="float32", enable_prefix_caching=False,
              max_num_batched_tokens=args.prompt_tokens, max_model_len=args.prompt_tokens + 64,
              startup_calibration=False)
    llm.engine.step_observers.append(sink.append)
    try:
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.vocab_size
        once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        steps = SamplingParams(temperature=0, max_tokens=args.decode_steps + 1, ignore_eos=True)
        llm.generate([{"prompt_token_ids": torch.randint(100, vocab, (64,), generator=g)
                       .tolist()}], once)  # warm-up
        for _ in range(args.repeats):
            sink.clear()
            prompt = torch.randint(100, vocab, (args.prompt_tokens,), generator=g).tolist()
            llm.generate([{"prompt_token_ids": prompt}], once)
            prefill += [s.execute_seconds for s in sink
                        if sum(n for _, n in s.requests) == args.prompt_tokens]
            sink.clear()
            # Short enough that the batch prefills in one step and then decodes in step.
            length = min(128, args.prompt_tokens // args.batch)
            prompts = torch.randint(100, vocab, (args.batch, length), generator=g).tolist()
            llm.generate([{"prompt_token_ids": p} for p in prompts], steps)
            decode += [s.execute_seconds for s in sink
                       if len(s.requests) == args.batch and all(n == 1 for _, n in s.requests)]
    finally:
        llm.shutdown()
    return {"torch_threads": torch.get_num_threads(),
            "prefill_ms": round(statistics.median(prefill) * 1000, 1),
            "decode_ms": round(statistics.median(decode) * 1000, 2),
            "prefill_runs": len(prefill), "decode_steps": len(decode)}


def table(results: list[dict]) -> str:
    """Markdown: one row per configuration; ``x1`` columns are the time over 1 thread's with the
    same policy and load (below 1: faster)."""
    base = {(r["policy"], r["busy"]): r for r in results if r["threads"] == 1}
    lines = ["| load | policy | threads | prefill ms | x1 | decode ms | x1 | other load |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(results, key=lambda r: (r["busy"], r["policy"], r["threads"])):
        one = base.get((r["policy"], r["busy"]))
        ratio = (lambda key: f"{r[key] / one[key]:.2f}") if one else (lambda key: "-")
        load = "quiet" if r["busy"] == 0 else f"{r['busy']} busy"
        lines.append(f"| {load} | {r['policy']} | {r['threads']} | {r['prefill_ms']} | "
                     f"{ratio('prefill_ms')} | {r['decode_ms']} | {ratio('decode_ms')} | "
                     f"{r['foreign_runnable']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--policies", nargs="+", default=["active", "passive"])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 2],
                        help="spin-loop processes running beside the engine")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quiet-wait", type=float, default=600.0, metavar="SECONDS",
                        help="before each configuration, wait up to this long until no other "
                             "process has been runnable for 3 s")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args)))
        return
    for policy in args.policies:
        policy_env(policy)  # a bad name fails before anything runs
    results = []
    started = time.monotonic()
    for busy in args.busy:
        for policy in args.policies:
            for threads in args.threads:
                results.append(run_configuration(threads, policy, busy, args))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(f"cores: {len(os.sched_getaffinity(0))}, model: {args.model or 'default'}, "
          f"{args.prompt_tokens}-token prefill, decode at batch {args.batch}, medians of "
          f"{args.repeats} repeats; {time.monotonic() - started:.0f} s\n")
    print(table(results))


if __name__ == "__main__":
    main()
