"""--gpu-memory-utilization: on a GPU whose KV pool nothing else sizes, the pool gets what the
weights and a profiled step leave of that share of the GPU's memory (workers/startup/kv_memory.py); an
explicit --num-kv-blocks or --kv-cache-memory-gb wins; on a CPU the flag only logs that it has
no effect. The arithmetic and the profile steps are checked here without a GPU; the measurement
runs on a GPU where one is visible, and on the CPU with torch.cuda's memory accounting faked
(tests/utils/fake_gpu_memory.py)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from engine.config import build_engine_config
from engine.runtime.model_setup import resolve
from engine.worker_messages import KVPoolPlan
from engine.sampling_params import SamplingParams
from tests.utils.fake_gpu_memory import FakeGPUMemory, play_a_gpu
from workers.startup.kv_memory import (GPUMemory, describe, kv_pool_blocks, profile_steps,
                               scratch_blocks)

# On a GPU, bench/suite/gpu_suite.sh's tests-cuda step runs the tests marked gpu.
pytestmark = pytest.mark.gpu
GIB = 2**30


def _plan(utilization: float = 0.9, max_blocks: int = 10**9) -> KVPoolPlan:
    return KVPoolPlan(gpu_memory_utilization=utilization, max_num_batched_tokens=2048,
                      max_num_seqs=128, max_model_len=4096, max_blocks=max_blocks)


def test_the_pool_gets_what_the_share_leaves_after_weights_and_activations() -> None:
    # An 80 GiB GPU, 10 GiB in use once the weights are loaded, a 2 GiB activation peak.
    memory = GPUMemory(total_bytes=80 * GIB, used_bytes=10 * GIB,
                       activation_peak_bytes=2 * GIB)
    per_block = 2 * 2**20  # 2 MiB: Llama-8B's block of 16 tokens in bf16
    assert kv_pool_blocks(memory, 0.9, per_block, 10**9) == (72 - 12) * 512
    assert kv_pool_blocks(memory, 0.5, per_block, 10**9) == (40 - 12) * 512
    assert kv_pool_blocks(memory, 1.0, per_block, 10**9) == (80 - 12) * 512
    # A part of a block does not count.
    assert kv_pool_blocks(memory, 0.9, 3 * 2**20, 10**9) == (60 * GIB) // (3 * 2**20)
    # What other processes hold counts as used: nothing left is 0 blocks, never negative.
    crowded = GPUMemory(total_bytes=80 * GIB, used_bytes=75 * GIB, activation_peak_bytes=GIB)
    assert kv_pool_blocks(crowded, 0.9, per_block, 10**9) == 0
    # Never more than max_num_seqs full-length sequences can fill.
    assert kv_pool_blocks(memory, 0.9, per_block, 1000) == 1000


def test_the_log_line_says_how_the_memory_was_counted() -> None:
    memory = GPUMemory(total_bytes=80 * GIB, used_bytes=10 * GIB, activation_peak_bytes=GIB)
    text = describe(memory, _plan(), 1024, 2 * 2**20)
    assert text == ("0.9 x 80.00 GiB - 10.00 GiB in use after loading the weights - 1.00 GiB "
                    "for a step's activations -> 1024 blocks of 2097152 bytes (2.00 GiB)")
    assert describe(memory, _plan(max_blocks=1024), 1024, 2 * 2**20).endswith(
        "(capped: 128 sequences of max_model_len fill no more)")


@pytest.mark.parametrize("tokens,seqs,block_size,max_len,step_tokens,long_seqs", [
    (2048, 128, 16, 4096, 2048, 1), (100, 7, 16, 100, 100, 1), (5, 8, 4, 5, 5, 1),
    (64, 1, 16, 64, 64, 1),
    # max_model_len below the budget: the budget spread over more sequences, none longer.
    (2048, 128, 16, 256, 2048, 8), (2048, 128, 16, 300, 2048, 7), (256, 256, 16, 64, 256, 4),
    # ... and never more than max_num_seqs of them: the scheduler makes no larger step.
    (2048, 4, 16, 256, 1024, 4), (2048, 1, 16, 64, 64, 1)])
def test_profile_steps_fill_the_token_budget(tokens, seqs, block_size, max_len, step_tokens,
                                             long_seqs) -> None:
    long, wide = profile_steps(tokens, seqs, block_size, max_len)
    assert len(long.requests) == long_seqs
    assert len(wide.requests) == min(seqs, step_tokens)
    for step in (long, wide):
        assert step.num_scheduled_tokens == step_tokens
        assert all(r.sample and r.start_pos == 0 for r in step.requests)
        # No position at or past max_model_len (the rotary table's end on a GPU).
        assert max(r.start_pos + len(r.token_ids) for r in step.requests) <= max_len
        blocks = [b for r in step.requests for b in r.block_ids]
        assert len(blocks) == len(set(blocks))  # no two sequences share a block
        assert all(len(r.block_ids) * block_size >= len(r.token_ids) for r in step.requests)
    assert scratch_blocks([long, wide]) == max(
        len([b for r in s.requests for b in r.block_ids]) for s in (long, wide))


def test_the_profile_steps_run_on_the_model_runner(tiny_model) -> None:
    """The steps the GPU measurement runs are ones the runner accepts (here on the CPU)."""
    from tests.utils.runner_configs import runner_config
    from workers.model_runner import ModelRunner

    model = tiny_model("llama")
    runner = ModelRunner(runner_config(model, num_blocks=0, block_size=16), torch.device("cpu"))
    assert runner.num_kv_blocks == 0
    steps = profile_steps(96, 8, 16, 1024)
    runner.resize_kv_pool(scratch_blocks(steps))
    for step in steps:
        out = runner.execute(step)
        assert out.status.name == "OK" and not out.failed
        assert set(out.sampled_token_ids) == {r.req_id for r in step.requests}


# ---- the configuration -----------------------------------------------------------------------

def test_on_a_cpu_the_flag_only_logs(tiny_model, caplog) -> None:
    # device="cpu": on a GPU machine "auto" is the GPU (the H100's tests-cuda step, 2026-11-28).
    model = tiny_model("llama")
    default = resolve(build_engine_config(model, device="cpu", dtype="float32"))
    with caplog.at_level(logging.INFO, logger="engine.runtime.model_setup"):
        given = resolve(build_engine_config(model, device="cpu", dtype="float32",
                                            gpu_memory_utilization=0.5))
    assert given.num_blocks == default.num_blocks  # 1 GiB, as without the flag
    assert "gpu_memory_utilization 0.5 has no effect: on a CPU the KV pool is " \
           "kv_cache_memory_gb" in caplog.text
    assert resolve(build_engine_config(model, device="cpu", dtype="float32",
                                       kv_cache_memory_gb=0.5)).num_blocks == \
        default.num_blocks // 2


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, float("nan")])
def test_the_config_refuses_a_share_outside_0_1(value) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        build_engine_config("unused", gpu_memory_utilization=value)


def test_the_cli_passes_it_on() -> None:
    from engine.entrypoints.cli import build_parser
    from engine.entrypoints.engine_args import engine_kwargs

    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.7"])
    kwargs = engine_kwargs(args)
    assert kwargs["gpu_memory_utilization"] == 0.7 and kwargs["kv_cache_memory_gb"] is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--gpu-memory-utilization", "0"])


def test_a_gpu_config_leaves_the_pool_to_the_workers(tiny_model, monkeypatch) -> None:
    """Without a GPU: resolve() on 'cuda' (its checks faked) leaves the pool open, and the plan
    the workers get says how to measure it; an explicit size keeps it fixed."""
    import engine.runtime.model_setup as setup
    from engine.executor.worker_config import kv_pool_plan, worker_config

    monkeypatch.setattr(setup, "check_device", lambda *args: None)
    monkeypatch.setattr(setup, "resolve_backend_name", lambda *args: "triton")
    model = tiny_model("llama")
    config = build_engine_config(model, device="cuda", dtype="float32", max_model_len=100,
                                 max_num_seqs=4, gpu_memory_utilization=0.6)
    resolved = resolve(config)
    assert resolved.num_blocks is None
    plan = kv_pool_plan(config, resolved)
    assert plan == KVPoolPlan(gpu_memory_utilization=0.6, max_num_batched_tokens=2048,
                              max_num_seqs=4, max_model_len=100, max_blocks=4 * 7)
    assert worker_config(config, resolved).kv_pool_plan == plan
    default = build_engine_config(model, device="cuda", dtype="float32")
    assert kv_pool_plan(default, resolve(default)).gpu_memory_utilization == 0.9
    fixed = build_engine_config(model, device="cuda", dtype="float32", kv_cache_memory_gb=0.01,
                                gpu_memory_utilization=0.6)
    resolved = resolve(fixed)
    assert resolved.num_blocks == int(0.01 * GIB) // setup.kv_bytes_per_block(
        resolved.hf_config, 16, torch.float32)
    assert kv_pool_plan(fixed, resolved) is None


# ---- EngineCore on a measured pool (the measurement faked, on the CPU: device="cpu", which a
# GPU machine's "auto" would not be) ------------------------------------------------------------

@dataclasses.dataclass
class FakeMeasurement:
    blocks: int = 0  # what the measurement answers
    plans: list[KVPoolPlan] = dataclasses.field(default_factory=list)  # what it was asked


@pytest.fixture
def measured(monkeypatch) -> FakeMeasurement:
    """resolve() leaves the pool open, as on a GPU, and the workers' measurement is faked."""
    import engine.runtime.engine_core as engine_core
    import workers.startup.kv_memory as kv_memory

    real_resolve = engine_core.resolve
    monkeypatch.setattr(engine_core, "resolve", lambda config: dataclasses.replace(
        real_resolve(config), num_blocks=None))
    fake = FakeMeasurement()

    def measure(runner, plan: KVPoolPlan) -> int:
        fake.plans.append(plan)
        return fake.blocks

    monkeypatch.setattr(kv_memory, "measure_kv_pool", measure)
    return fake


def test_the_scheduler_gets_the_pool_the_workers_measured(tiny_model, measured) -> None:
    from engine import LLM

    args = dict(model=tiny_model("llama"), device="cpu", dtype="float32", max_model_len=64,
                max_num_seqs=4)
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = ["The quick brown fox", "Paris is the capital of"]
    measured.blocks = 40
    llm = LLM(**args)
    try:
        assert llm.engine.model.num_blocks == llm.engine.executor.num_kv_blocks == 40
        assert llm.engine.executor.runner.kv_caches[0][0].shape[0] == 40
        assert llm.engine.scheduler.kv_cache_manager.pool.num_blocks == 40
        assert measured.plans == [KVPoolPlan(gpu_memory_utilization=0.9,
                                             max_num_batched_tokens=2048, max_num_seqs=4,
                                             max_model_len=64, max_blocks=4 * 4)]
        got = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    llm = LLM(**args, num_kv_blocks=40)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == got
    finally:
        llm.shutdown()


def test_a_measured_pool_too_small_for_max_model_len_is_a_clear_error(tiny_model,
                                                                      measured) -> None:
    from engine import LLM

    measured.blocks = 3
    with pytest.raises(ValueError, match=r"max_model_len 64 needs 4 KV blocks of 16 tokens but "
                                         r"the pool has 3; lower max_model_len, or raise "
                                         r"gpu_memory_utilization \(now 0.5\)"):
        LLM(model=tiny_model("llama"), device="cpu", dtype="float32", max_model_len=64,
            gpu_memory_utilization=0.5)


def test_a_worker_rank_allocates_the_pool_the_ranks_agree_on(tiny_model, monkeypatch) -> None:
    """The path of spawned and torchrun ranks: measure, agree (MIN over the ranks; one here),
    allocate, and report the size to EngineCore."""
    import workers.startup.kv_memory as kv_memory
    from engine.executor.worker_config import worker_config
    from engine.ports import free_port
    from workers.worker import DriverWorker

    monkeypatch.setattr(kv_memory, "measure_kv_pool", lambda runner, plan: 24)
    config = build_engine_config(tiny_model("llama"), device="cpu", dtype="float32",
                                 max_model_len=64, slo_preemption=False)
    resolved = dataclasses.replace(resolve(config), num_blocks=None)
    worker = DriverWorker(worker_config(config, resolved,
                                        init_method=f"tcp://127.0.0.1:{free_port()}"), 0)
    try:
        worker.start()
        assert worker.num_kv_blocks == 24
        assert worker.runner.kv_caches[0][0].shape[0] == 24
    finally:
        worker.shutdown()


# ---- on a GPU, and the same on the CPU with torch.cuda's memory accounting faked -----------------

@dataclasses.dataclass
class Device:
    name: str
    fake: FakeGPUMemory | None  # None on a real GPU


@pytest.fixture(params=["cpu", "cuda"])
def device(request, monkeypatch) -> Device:
    """A real GPU where one is visible; and the CPU with the pool left open (as resolve() does
    on a GPU) and the memory accounting faked, so that the real profile steps run on the CPU's
    model runner. The tiny model's rotary table ends at 1024 positions: a profiled sequence
    past it is an IndexError here, as it is a device-side assert on a GPU."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("measuring a GPU's memory needs one (torch.cuda.is_available() is False)")
        return Device("cuda", None)
    return Device("cpu", play_a_gpu(monkeypatch))


def test_the_pool_is_measured_on_the_gpu(tiny_model, device: Device) -> None:
    """max_model_len 256 under the default 2048-token budget: the profile spreads the budget
    over sequences of 256 (it once ran one 2048-token prompt and crashed)."""
    from engine import LLM

    llm = LLM(model=tiny_model("llama"), device=device.name, dtype="float32",
              max_model_len=256, max_num_seqs=8)
    try:
        blocks = llm.engine.model.num_blocks
        # A tiny model on any GPU: the cap binds (8 sequences of 256 tokens).
        assert blocks == 8 * 16
        assert llm.engine.executor.runner.kv_caches[0][0].shape[0] == blocks
        assert llm.engine.scheduler.kv_cache_manager.pool.num_blocks == blocks
        (out,) = llm.generate("The quick brown fox", SamplingParams(max_tokens=4,
                                                                   temperature=0))
        assert len(out.token_ids) == 4
    finally:
        llm.shutdown()
    if device.fake is not None:
        assert device.fake.profiles == 1  # probe: the pool was measured, not configured


def test_a_gpu_without_room_for_the_pool_is_a_clear_error(tiny_model, monkeypatch,
                                                          device: Device) -> None:
    """The default max_model_len (the tiny model's 1024) under the 2048-token budget: the
    profile runs (two sequences of 1024 at most) and the error is about the memory."""
    from engine import LLM

    if device.fake is None:
        total = torch.cuda.mem_get_info()[1]
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, total))
    else:
        device.fake.free = 0
    with pytest.raises(ValueError, match=r"the pool has 0; lower max_model_len, or raise "
                                         r"gpu_memory_utilization \(now 0.9\)"):
        LLM(model=tiny_model("llama"), device=device.name, dtype="float32")
    if device.fake is not None:
        assert device.fake.profiles == 1
