"""Cost of the attention-op preemption vote (docs/design.md sections 4 and 7), on vs off in one run.

Per TP size, one process per rank drives a ModelRunner directly (no engine): (a) a prefill step
of one long prompt, marked preemptible, and (b) a decode step of N requests with a prefilled
context, marked preemptible=False as the scheduler marks every decode-only step. "On" installs an
SLOPreemptVote over a live SLOPreemptSignal that never targets the step, so it measures the
vote's cost, never a preemption. On and off repetitions alternate (and swap order each round)
because this 2-core machine is noisy; medians are printed as `key: value` lines.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time

import torch
import torch.multiprocessing as mp

from engine.ports import free_port
from workers.preemption.slo_preempt_vote import SLOPreemptVote

BLOCK_SIZE = 16
COUNTED_STEPS = 3


class _CountingVote(SLOPreemptVote):
    """Counts hook calls (TP=1 has no collective to count) and the time inside them: a cost far
    below the noise of whole-step medians. At TP>1 it includes waiting for a lagging peer, which a
    step without the vote spends at its next all_reduce instead: an upper bound."""

    calls, seconds = 0, 0.0

    def __call__(self, layer: int) -> None:
        started = time.perf_counter()
        self.calls += 1
        try:
            super().__call__(layer)
        finally:
            self.seconds += time.perf_counter() - started


def _requests(prompts: list[list[int]], start: int, blocks_per_req: int, params) -> list:
    from engine.core.scheduler_output import ScheduledRequest

    # Fixed block ids and start positions: every repetition rewrites the same KV slots, so all
    # repetitions of a step do identical work.
    return [ScheduledRequest(req_id=f"r{i}", token_ids=p, start_pos=start,
                             block_ids=list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),
                             sample=True, sampling_params=params)
            for i, p in enumerate(prompts)]


def _run_rank(rank: int, tp: int, port: int, model_dir: str, signal_name: str,
              args: argparse.Namespace, results) -> None:
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.runtime.model_setup import auto_dtype, load_hf_config
    from engine.sampling_params import SamplingParams
    from engine.core.scheduler_output import SchedulerOutput, StepStatus
    from engine.worker_messages import WorkerConfig
    from monitor.slo_preempt_signal import SLOPreemptSignal
    from workers.distributed import destroy, init_distributed
    from workers.model_runner import ModelRunner

    # The same 2 cores either way: TP=1 gets both, TP=2 one per rank (more would oversubscribe).
    torch.set_num_threads(max(1, args.cores // tp))
    device = _device(args.device, rank)
    groups = None
    if tp > 1:
        groups = init_distributed(rank, tp, f"tcp://127.0.0.1:{port}", device, 120)
    hf_config = load_hf_config(model_dir)
    ctx = args.decode_context
    blocks_prefill = -(-args.prefill_tokens // BLOCK_SIZE)
    blocks_decode = -(-(ctx + 1) // BLOCK_SIZE)
    num_blocks = max(blocks_prefill, args.decode_requests * blocks_decode)
    # The engine's configuration of this rank, its limits the bench's two steps.
    engine = EngineConfig(
        model=ModelConfig(model=model_dir, device=device.type, load_format=args.load_format),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max(args.prefill_tokens, ctx * args.decode_requests, 1),
            max_num_seqs=max(args.decode_requests, 1)),
        tensor_parallel_size=tp)
    config = WorkerConfig(engine=engine, num_blocks=num_blocks,
                          dtype=str(auto_dtype(device)[0]).removeprefix("torch."),
                          max_model_len=max(args.prefill_tokens, ctx + 1))
    runner = ModelRunner(config, device, rank=rank,
                         tp_group=groups.tensor_group if groups else None)
    # Every rank on this node reads the monitor's signal, as the workers do in the engine.
    signal = SLOPreemptSignal.attach(signal_name)
    cpu_group = groups.cpu_group if groups else None
    layers = runner.model.num_layers
    vote = SLOPreemptVote(signal, layers, 0.9, cpu_group)

    g = torch.Generator().manual_seed(0)
    vocab, greedy = hf_config.vocab_size, SamplingParams(temperature=0, max_tokens=1)
    prompt = torch.randint(100, vocab, (args.prefill_tokens,), generator=g).tolist()
    prefill = SchedulerOutput(step_id=1, preemptible=True,
                              requests=_requests([prompt], 0, blocks_prefill, greedy))
    contexts = torch.randint(100, vocab, (args.decode_requests, ctx + 1), generator=g).tolist()
    # The decode requests' context goes into the KV cache once; each decode step then computes
    # position `ctx` of every request again.
    runner.execute(SchedulerOutput(step_id=2, requests=_requests(
        [c[:ctx] for c in contexts], 0, blocks_decode, greedy)))
    decode = SchedulerOutput(step_id=3, preemptible=False, requests=_requests(
        [c[ctx:] for c in contexts], ctx, blocks_decode, greedy))

    def step(out: SchedulerOutput, with_vote: SLOPreemptVote | None) -> tuple[float, dict]:
        runner.install_vote(with_vote)
        if groups:  # start the ranks together, so rank 0 does not time a peer's lag
            torch.distributed.barrier(group=groups.cpu_group)
        started = time.perf_counter()
        result = runner.execute(out)
        elapsed = time.perf_counter() - started
        assert result.status == StepStatus.OK, result
        return elapsed, result.sampled_token_ids

    times: dict[str, list[float]] = {}
    collectives, calls, vote_ms = {}, {}, {}  # per kind: all timed on-steps / per step
    for name, out in (("prefill", prefill), ("decode", decode)):
        # Warm-up, and a check that the vote never changes what is sampled.
        assert step(out, None)[1] == step(out, vote)[1], f"{name}: the vote changed the output"
        before = vote.stats.collectives
        for r in range(args.repeats):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                times.setdefault(f"{name}_{'on' if on else 'off'}", []).append(
                    step(out, vote if on else None)[0])
        collectives[name] = vote.stats.collectives - before
        counting = _CountingVote(signal, layers, 0.9, cpu_group)
        for _ in range(COUNTED_STEPS):
            step(out, counting)
        calls[name] = counting.calls / COUNTED_STEPS
        vote_ms[name] = 1000 * counting.seconds / COUNTED_STEPS
    runner.install_vote(None)
    signal.close()
    if rank == 0:
        results.put({"times": times, "collectives": collectives, "calls": calls,
                     "vote_ms": vote_ms, "num_layers": layers, "threads": torch.get_num_threads()})
    if groups:
        destroy(groups)


def _device(kind: str, rank: int) -> torch.device:
    """TP rank r on GPU r (NCCL needs each rank's device current before it joins)."""
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


def bench_tp(tp: int, model_dir: str, signal_name: str, args: argparse.Namespace) -> dict:
    # Spawned even at TP=1: each size gets a fresh process with its own thread setting.
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_run_rank, args=(tp, free_port(), model_dir, signal_name, args, results),
             nprocs=tp, join=True)
    return results.get()


def _verdict(pct: float) -> str:
    return f"{'met' if pct < 1 else 'MISSED'} at {pct:.2f}%"


def _report(tp: int, r: dict, repeats: int) -> None:
    t, coll, calls, vote_ms = r["times"], r["collectives"], r["calls"], r["vote_ms"]
    med = {k: 1000 * statistics.median(v) for k, v in t.items()}
    overhead = 100 * (med["prefill_on"] / med["prefill_off"] - 1)
    # Same-round on/off ratios cancel slow drift; the off spread shows the noise floor.
    paired = 100 * (statistics.median(a / b for a, b in zip(t["prefill_on"], t["prefill_off"])) - 1)
    spread = 100 * (max(t["prefill_off"]) / min(t["prefill_off"]) - 1)
    in_vote = 100 * vote_ms["prefill"] / med["prefill_off"]
    per_call_us = 1000 * vote_ms["prefill"] / max(calls["prefill"], 1)
    print(f"\n[tensor_parallel_size: {tp}]\n"
          f"threads_per_rank: {r['threads']} (TP={tp} x {r['threads']} = {tp * r['threads']})\n"
          f"num_layers: {r['num_layers']}\n"
          f"prefill_off_ms: {med['prefill_off']:.2f}\nprefill_on_ms: {med['prefill_on']:.2f}\n"
          f"prefill_overhead_pct: {overhead:.2f}\nprefill_overhead_pct_paired: {paired:.2f}\n"
          f"prefill_off_spread_pct: {spread:.2f}\n"
          f"decode_off_ms: {med['decode_off']:.2f}\ndecode_on_ms: {med['decode_on']:.2f}\n"
          f"decode_collectives: {coll['decode']}\n"
          f"prefill_collectives_per_step: {coll['prefill'] / repeats:g}\n"
          f"prefill_vote_calls_per_step: {calls['prefill']:g}\n"
          f"decode_vote_calls_per_step: {calls['decode']:g}\n"
          f"prefill_in_vote_ms_per_step: {vote_ms['prefill']:.2f}\n"
          f"prefill_in_vote_us_per_call: {per_call_us:.1f}\n"
          f"prefill_in_vote_pct_of_step: {in_vote:.2f}")
    # Both readings: whole-step medians are what a user sees but are noisy at 1%; the time inside
    # the vote is precise but an upper bound at TP>1.
    print(f"target: prefill overhead < 1% (whole-step medians: {_verdict(overhead)}; "
          f"inside the vote: {_verdict(in_vote)})")
    print(f"target: 0 collectives on decode ({'met' if coll['decode'] == 0 else 'MISSED'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--decode-requests", type=int, default=16)
    parser.add_argument("--decode-context", type=int, default=64,
                        help="tokens of each decode request already in the KV cache")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--cores", type=int, default=2, help="threads split over the ranks")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto (default): cuda when torch sees a GPU, else cpu; cuda: rank "
                             "r on GPU r, NCCL for the model's collectives")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights for a config-only folder of a real shape "
                             "(engine/benchmarks/inputs/model_shapes.py)")
    parser.add_argument("--random-heads", type=int, nargs=2, metavar=("HEADS", "KV_HEADS"),
                        help="use a random-weight copy with these head counts (default 8 2 when "
                             "the model's heads cannot be split over a requested TP size)")
    args = parser.parse_args()

    from engine.device import auto_device
    from engine.entrypoints.default_model import model_path_or_default
    from engine.runtime.model_setup import auto_dtype, check_tensor_parallel, load_hf_config
    from monitor.slo_preempt_signal import SLOPreemptSignal

    # Once, here: the spawned ranks are handed a concrete device.
    device_why = ""
    if args.device == "auto":
        args.device, device_why = auto_device()

    model_dir = model_path_or_default(args.model)
    heads, scratch = args.random_heads, None
    try:
        for tp in args.tensor_parallel_size:
            check_tensor_parallel(load_hf_config(model_dir), tp)
    except ValueError:
        heads = heads or [8, 2]  # e.g. SmolLM2's 9 heads cannot split over 2 ranks
    if heads:
        import tempfile

        from engine.benchmarks.inputs.random_checkpoints import random_with_heads

        # One model for every TP size, so the rows compare like with like.
        scratch = tempfile.mkdtemp(prefix="sloserve-bench-")
        model_dir = random_with_heads(scratch, model_dir, *heads)
    print(f"model: {model_dir}" + (f" (random weights, {heads[0]} heads / {heads[1]} KV heads)"
                                   if heads else ""))
    print(f"device: {args.device}" + (f" (auto: {device_why})" if device_why else "")
          + f"\ndtype: {auto_dtype(torch.device(args.device))[0]}\n"
          f"prefill_tokens: {args.prefill_tokens}\n"
          f"decode_requests: {args.decode_requests}\ndecode_context: {args.decode_context}\n"
          f"repeats: {args.repeats} per variant, on/off interleaved; figures are medians")
    # Created once and never published to: its target stays NO_TARGET, so no step is stopped.
    signal = SLOPreemptSignal.create()
    try:
        for tp in args.tensor_parallel_size:
            _report(tp, bench_tp(tp, model_dir, signal.name, args), args.repeats)
    finally:
        signal.close()
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
