"""Tensor-parallel engine: TP>1 outputs equal TP=1 token for token, through every launch mode
(spawned processes, torchrun, a two-"node" torchrun), and failures end cleanly."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.ports import free_port
from engine.runtime.engine_core import EngineStepError
from tests.utils.tp import GREEDY, PROMPT_LENGTHS, CRAMPED, _run


# gemma3: sliding layers beside a full one, a KV cache group (a block table) each; gpt_oss:
# its experts sharded along their intermediate dimension, its sinks by head, the down
# projection's bias added once.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "gpt_oss"])
def test_tp2_equals_tp1_with_chunking_and_preemption(tiny_model, arch):
    model = tiny_model(arch)
    want = _run(model, tp=1)
    got = _run(model, tp=2)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # Probes: KV preemption happened in the TP=2 run; the budget forced chunked prefills.
    assert sum(o.metrics.num_kv_preemptions for o in got) > 0
    assert max(PROMPT_LENGTHS) > CRAMPED["max_num_batched_tokens"]
    assert not multiprocessing.active_children()


def test_tp2_logprobs_penalties_and_samples_equal_tp1(tiny_model):
    """The step's token histories, prompt-logprob targets and logprobs cross the TP process
    boundary; chunked prefills and KV-pressure recomputes (prompt scored again) included."""
    model = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1, repetition_penalty=0.5, presence_penalty=-1.0,
                            n=2)
    want = _run(model, tp=1, params=params)
    got = _run(model, tp=2, params=params)
    assert sum(o.metrics.num_kv_preemptions for out in got for o in out.outputs) > 0  # probe
    for g, w in zip(got, want):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)
        scores = [p[t].logprob for p, t in zip(g.prompt_logprobs[1:], g.prompt_token_ids[1:])]
        ref = [p[t].logprob for p, t in zip(w.prompt_logprobs[1:], w.prompt_token_ids[1:])]
        assert len(scores) == len(g.prompt_token_ids) - 1
        assert scores == pytest.approx(ref, abs=1e-3)


@pytest.mark.parametrize("kv_heads", [3, 1], ids=["kv-heads-split", "kv-heads-replicated"])
def test_tp3(tiny_model, kv_heads):
    # Shaped like the default model: 9 query heads. 3 KV heads split one per rank; 1 KV head is
    # replicated on all three ranks.
    model = tiny_model("llama", hidden_size=72, num_attention_heads=9,
                       num_key_value_heads=kv_heads, intermediate_size=144)
    want = _run(model, tp=1)
    got = _run(model, tp=3)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_tp_size_must_divide_heads(tiny_model):
    model = tiny_model("llama", hidden_size=72, num_attention_heads=9, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 .* 9 attention heads"):
        LLM(model=model, tensor_parallel_size=2)
    assert not multiprocessing.active_children()  # refused before any worker started
    with pytest.raises(ValueError, match=r"intermediate_size 129"):
        LLM(model=tiny_model("llama", intermediate_size=129), tensor_parallel_size=2)
    assert not multiprocessing.active_children()


def test_unreachable_rendezvous_is_a_clear_error():
    import torch

    from workers.distributed import init_distributed

    port = free_port()  # closed again: nobody listens there
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 of 2: .*127\.0\.0\.1:{port}"):
        init_distributed(1, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s=3)
    assert time.monotonic() - started < 30


def test_killed_worker_fails_generate_cleanly(tiny_model):
    llm = LLM(model=tiny_model("llama"), dtype="float32", tensor_parallel_size=2,
              max_num_batched_tokens=64)
    procs = llm.engine.executor._procs
    errors: list[BaseException] = []
    long_run = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)

    def generate():
        try:
            llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4, long_run)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(2.0)  # mid-run
    assert thread.is_alive(), "generation should still be running when the worker is killed"
    killed_at = time.monotonic()
    os.kill(procs[1].pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "generate did not fail within 60 s of the worker's death"
    assert time.monotonic() - killed_at < 60
    assert len(errors) == 1 and isinstance(errors[0], EngineStepError)
    assert "rank 1" in str(errors[0]) and "-9" in str(errors[0])
    assert all(not p.is_alive() for p in procs)
    assert not multiprocessing.active_children()
    with pytest.raises(EngineStepError):  # the engine refuses further work instead of hanging
        llm.generate({"prompt_token_ids": [1, 2]}, GREEDY)


# ---- torchrun ----------------------------------------------------------------------------------

def _cli_args(model: str) -> list[str]:
    return ["generate", "The quick brown fox", "--model", model, "--dtype", "float32",
            "--no-chat", "--max-tokens", "12"]


def _in_process_text(model: str) -> str:
    result = subprocess.run([sys.executable, "-m", "engine", *_cli_args(model)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _torchrun(*args: str, timeout: float = 300) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _assert_quiet_exit(stderr: str) -> None:
    """No rank printed a traceback on its way out (each rank's attached preempt
    signal once printed `BufferError: cannot close exported pointers exist` at exit)."""
    for noise in ("Traceback", "BufferError", "Exception ignored", "leaked shared_memory"):
        assert noise not in stderr, stderr


def test_torchrun_two_ranks_matches_in_process(tiny_model):
    model = tiny_model("llama")
    expected = _in_process_text(model)
    proc = _torchrun("--nproc-per-node", "2", "--master-port", str(free_port()),
                     "-m", "engine", *_cli_args(model))
    stdout, stderr = proc.communicate(timeout=300)
    # The run went all the way through the engine's shutdown: every rank exited 0 after the
    # completion was printed (and both ranks attached the signal: mid-forward preemption is on).
    assert proc.returncode == 0, stderr
    assert stdout == expected
    assert "finish_reason=length" in stderr
    _assert_quiet_exit(stderr)


def test_torchrun_two_nodes_matches_in_process(tiny_model):
    model = tiny_model("llama")
    expected = _in_process_text(model)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [_torchrun("--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "t2n",
                       "-m", "engine", *_cli_args(model)) for rank in (0, 1)]
    results = [node.communicate(timeout=300) for node in nodes]
    for node, (_, stderr) in zip(nodes, results):
        assert node.returncode == 0, stderr
        _assert_quiet_exit(stderr)
    # Which node hosts global rank 0 (and so prints) is the rendezvous' choice.
    printed = [stdout for stdout, _ in results if stdout]
    assert printed == [expected]


def test_torchrun_world_smaller_than_tp_is_refused(tiny_model):
    proc = _torchrun("--nproc-per-node", "2", "--master-port", str(free_port()),
                     "-m", "engine", *_cli_args(tiny_model("llama")),
                     "--tensor-parallel-size", "4")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "tensor_parallel_size 4 needs 4 ranks but the torchrun world has 2" in stderr


def test_worker_that_raises_at_startup_reports_its_error(tiny_model, tmp_path):
    import json
    import shutil

    from engine.executor.multiproc import WorkerStartupError

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model("llama"), broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] += 1  # the checkpoint has no weights for the extra layer
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(WorkerStartupError, match=r"layers\.3"):
        LLM(model=str(broken), dtype="float32", tensor_parallel_size=2)
    assert not multiprocessing.active_children()
