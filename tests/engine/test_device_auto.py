"""`--device auto`, the default everywhere: the GPU when torch sees one, else the CPU, decided
once where the configuration is built and logged with the reason; too few GPUs for the TP ranks
is a clear error before any worker starts. torch.cuda is monkeypatched: no GPU is needed."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.config import ModelConfig, build_engine_config
from engine.device import auto_device, resolve_device
from engine.entrypoints.cli import build_parser, main
from engine.runtime.launch import TorchrunLaunch, check_torchrun_gpus

H100 = "NVIDIA H100 80GB HBM3"


def _gpus(monkeypatch, count: int, name: str = H100) -> None:
    """torch sees `count` GPUs (0: none, on a CUDA build)."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_auto_picks_the_gpu_when_torch_sees_one_and_says_why(monkeypatch, caplog):
    _gpus(monkeypatch, 1)
    assert auto_device() == ("cuda", f"1 GPU visible ({H100})")
    _gpus(monkeypatch, 8)
    assert auto_device() == ("cuda", f"8 GPUs visible ({H100})")  # one name for eight alike
    with caplog.at_level("INFO", logger="engine.device"):
        assert resolve_device("auto") == "cuda"
    assert f"device auto -> cuda: 8 GPUs visible ({H100})" in caplog.text


def test_auto_falls_back_to_the_cpu_and_says_why(monkeypatch, caplog):
    _gpus(monkeypatch, 0)
    device, why = auto_device()
    assert device == "cpu"
    assert why.startswith("no GPU visible") and "CUDA 13.0" in why
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU-only build of torch
    assert auto_device() == ("cpu", f"torch {torch.__version__} has no CUDA")
    with caplog.at_level("INFO", logger="engine.device"):
        assert resolve_device("auto") == "cpu"
    assert "device auto -> cpu: torch" in caplog.text


def test_explicit_devices_are_kept_and_unknown_ones_refused(monkeypatch):
    _gpus(monkeypatch, 0)
    # An explicit choice is never second-guessed here (resolve() says when cuda cannot run).
    assert resolve_device("cuda") == "cuda"
    _gpus(monkeypatch, 1)
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device must be one of 'auto', 'cpu', 'cuda', "
                                         "got 'gpu'"):
        resolve_device("gpu")


def test_the_configuration_holds_a_concrete_device(monkeypatch, tiny_model):
    """What reaches EngineCore and the workers is 'cpu' or 'cuda', never 'auto'."""
    model = tiny_model("llama")
    for count, expected in ((1, "cuda"), (0, "cpu")):
        _gpus(monkeypatch, count)
        assert ModelConfig(model=model).device == expected
        assert build_engine_config(model).model.device == expected
        assert build_engine_config(model, device="auto").model.device == expected


def test_simulate_resolves_auto_to_the_cpu(monkeypatch, sim_model, caplog):
    _gpus(monkeypatch, 1)
    with caplog.at_level("INFO", logger="engine.device"):
        config = build_engine_config(sim_model, simulate="h100-llama-3.1-8b")
    assert config.model.device == "cpu"
    assert "device auto -> cpu: --simulate runs no model" in caplog.text
    with pytest.raises(ValueError, match="simulate runs no model on any device"):
        build_engine_config(sim_model, simulate="h100-llama-3.1-8b", device="cuda")


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["calibrate"]])
def test_cli_default_is_auto(command):
    assert build_parser().parse_args(command).device == "auto"
    assert build_parser().parse_args([*command, "--device", "cpu"]).device == "cpu"


def test_llm_defaults_to_auto(monkeypatch, tiny_model, caplog):
    """LLM() with no device goes through the same resolution (here: no GPU, so the CPU)."""
    import engine.device

    monkeypatch.setattr(engine.device, "auto_device", lambda: ("cpu", "probe: no GPU here"))
    with caplog.at_level("INFO", logger="engine.device"):
        llm = LLM(model=tiny_model("llama"), dtype="float32", startup_calibration=False)
    try:
        assert "device auto -> cpu: probe: no GPU here" in caplog.text
        assert llm.engine.model.device.type == "cpu"
    finally:
        llm.shutdown()


def test_auto_with_fewer_gpus_than_ranks_fails_before_any_worker(monkeypatch, tiny_model):
    _gpus(monkeypatch, 1)
    import engine.executor.multiproc

    def never(*args, **kwargs):
        raise AssertionError("a worker was spawned")

    monkeypatch.setattr(engine.executor.multiproc, "MultiprocExecutor", never)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 GPUs on this machine; "
                                         "1 is visible .*--device cpu"):
        LLM(model=tiny_model("llama"), tensor_parallel_size=2)


def test_torchrun_with_more_ranks_on_a_node_than_gpus_is_refused(monkeypatch):
    _gpus(monkeypatch, 2)
    launch = TorchrunLaunch(rank=5, world_size=8, local_world_size=4, local_rank=1)
    with pytest.raises(ValueError, match="torchrun starts 4 ranks on this node, each on the GPU "
                                         "of its LOCAL_RANK, but 2 GPUs are visible"):
        check_torchrun_gpus(launch, "cuda")
    check_torchrun_gpus(launch, "cpu")  # the CPU has room for any number of ranks
    check_torchrun_gpus(TorchrunLaunch(rank=5, world_size=8, local_world_size=2, local_rank=1),
                        "cuda")


@pytest.mark.parametrize("rank", [0, 1])
def test_every_torchrun_rank_resolves_auto_and_checks_its_gpus(monkeypatch, tiny_model, capsys,
                                                               rank):
    """From the command line, before rank 0 builds an engine or a follower loads weights."""
    _gpus(monkeypatch, 1)
    for name, value in (("RANK", rank), ("WORLD_SIZE", 2), ("LOCAL_WORLD_SIZE", 2),
                        ("LOCAL_RANK", rank)):
        monkeypatch.setenv(name, str(value))
    import engine.entrypoints.llm
    import engine.executor.external

    def never(*args, **kwargs):
        raise AssertionError("the run went past the GPU check")

    monkeypatch.setattr(engine.executor.external, "run_follower", never)
    monkeypatch.setattr(engine.entrypoints.llm, "LLM", never)
    assert main(["generate", "hi", "--model", tiny_model("llama")]) == 2
    err = capsys.readouterr().err
    assert "device auto -> cuda: 1 GPU visible" in err
    assert ("sloserve: error: device 'cuda': torchrun starts 2 ranks on this node, each on the "
            "GPU of its LOCAL_RANK, but 1 GPU is visible") in err
