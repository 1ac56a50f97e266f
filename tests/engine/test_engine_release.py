"""An engine's runner, weights and KV pool are freed the moment the engine is shut down and
dropped, by reference counting alone: on a GPU the next engine in the process sizes its KV pool
from the memory left free, so nothing may wait for the garbage collector.

Every check runs with the collector off from before the engine exists until the probes are read,
so an object found gone was freed by reference counting, never by a collection that happened to
run. CUDA graphs are on through their CPU stand-in (workers.graphs.cuda_graphs.EagerReplayBackend, which
keeps each captured function: the captured steps must not refer back to the runner), and the
weights are left unpacked, as on a GPU (the CPU's oneDNN prepack replaces every linear weight,
and with it the loader each parameter carries)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from engine import LLM, SamplingParams
from workers.graphs.cuda_graphs import FAKE_GRAPHS_ENV
from workers.layers.cpu_prepack import PREPACK_ENV
from workers.preemption.layer_delay import LAYER_DELAY_ENV, layer_delay_of
from workers.runner_release import collector_off, outlived, runner_probes
from workers.worker import RELEASE_REPORT_ENV

ENGINE_ARGS = dict(dtype="float32", device="cpu", max_model_len=128,
                   max_num_batched_tokens=64, max_num_seqs=4, startup_calibration=False)
# A prompt longer than the step budget: chunked prefill steps (replayed as pieces), then decodes
# (replayed as whole graphs).
PROMPT = {"prompt_token_ids": list(range(5, 85))}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(name="collector_off")
def collector_off_fixture() -> Iterator[None]:
    with collector_off():
        yield


@pytest.fixture
def like_a_gpu(monkeypatch) -> None:
    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    monkeypatch.setenv(PREPACK_ENV, "0")


@pytest.mark.parametrize("enforce_eager, layer_delay", [(False, False), (True, False),
                                                      (False, True)],
                         ids=["graphs", "eager", "graphs-layer-delay"])
def test_engine_memory_is_freed_at_shutdown_without_a_collection(
        tiny_model, like_a_gpu, collector_off, monkeypatch, enforce_eager: bool,
        layer_delay: bool) -> None:
    """``layer_delay``: the tests' slow-layer hook wraps the model's attention op
    (workers.preemption.layer_delay.observe_attention_ops), a wrapper the model keeps."""
    if layer_delay:
        monkeypatch.setenv(LAYER_DELAY_ENV, "1")
    llm = LLM(model=tiny_model("llama", num_hidden_layers=2), enforce_eager=enforce_eager,
              **ENGINE_ARGS)
    runner = llm.engine.executor.runner
    # Probes: graphs captured (or not, with --enforce-eager), the vote installed, and the
    # weights still carrying their loaders (not replaced by the CPU's prepack).
    assert (runner.graphs is None) == (runner.piecewise is None) == enforce_eager
    assert runner.vote is not None
    assert (layer_delay_of(runner) is not None) == layer_delay
    assert hasattr(runner.model.model.layers[0].mlp.down_proj.weight, "weight_loader")
    probes = runner_probes(runner)

    outputs = llm.generate([PROMPT], GREEDY)

    assert len(outputs[0].token_ids) == GREEDY.max_tokens
    if not enforce_eager:
        assert runner.graphs.replays > 0 and runner.piecewise.replays > 0
    del runner
    llm.shutdown()
    del llm
    assert outlived(probes) == []


def test_driver_worker_frees_its_runner_at_shutdown(tiny_model, like_a_gpu,
                                                    collector_off) -> None:
    """The worker's shutdown drops its runner (torchrun's rank 0 lives on in EngineCore's
    process): gone when ``shutdown()`` returns, the worker itself still held."""
    from engine.config import build_engine_config
    from engine.executor.worker_config import worker_config
    from engine.ports import free_port
    from engine.runtime.model_setup import resolve
    from workers.worker import DriverWorker

    config = build_engine_config(tiny_model("llama", num_hidden_layers=2), **ENGINE_ARGS)
    worker = DriverWorker(worker_config(config, resolve(config),
                                        init_method=f"tcp://127.0.0.1:{free_port()}"), 0)
    try:
        worker.start()
        assert worker.runner.graphs is not None and worker.runner.piecewise is not None
        probes = runner_probes(worker.runner)
    finally:
        worker.shutdown()
    assert worker.runner is None
    assert outlived(probes) == []


def test_tp_workers_free_their_runners_at_shutdown(tiny_model, like_a_gpu, monkeypatch,
                                                   tmp_path) -> None:
    """Real TP workers (spawned processes): each rank reports, as it releases its runner at
    shutdown, what outlived the release (checked there with its collector off)."""
    monkeypatch.setenv(RELEASE_REPORT_ENV, str(tmp_path))
    llm = LLM(model=tiny_model("llama", num_hidden_layers=2), tensor_parallel_size=2,
              **ENGINE_ARGS)
    try:
        outputs = llm.generate([PROMPT], GREEDY)
    finally:
        llm.shutdown()
    assert len(outputs[0].token_ids) == GREEDY.max_tokens
    assert [p.exitcode for p in llm.engine.executor._procs] == [0, 0]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        # Probes: each rank's runner had captured graphs and replayed them, and held a KV pool.
        assert report["graphs_captured"] and report["replays"] > 0, report
        assert {"runner", "layer weight", "kv cache"} <= set(report["probed"]), report
        assert report["outlived"] == [], report
