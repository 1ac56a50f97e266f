"""engine.ipc.core_launch: `sloserve serve` starts EngineCore's process before it checks the
configuration, and that process builds nothing until the API server's StartCore. So a
configuration that fails its check leaves nothing behind, and neither does an API server that
goes away before it needed the engine."""

from __future__ import annotations

import signal
import socket
import struct

import engine.runtime.model_setup as model_setup
from engine.entrypoints.cli import main
from engine.ipc.core_launch import CoreLaunch
from engine.ipc.core_messages import hello_decoder
from tests.utils.server_helpers import children


def _read_frame(conn: socket.socket) -> bytes:
    header = conn.recv(4, socket.MSG_WAITALL)
    (length,) = struct.unpack(">I", header)
    return conn.recv(length, socket.MSG_WAITALL)


def test_a_launched_core_waits_for_its_start_and_leaves_quietly_when_the_server_goes(
        tiny_model, capfd) -> None:
    model = tiny_model("llama")
    capfd.readouterr()  # the model's making
    launch = CoreLaunch.start(model)
    try:
        launch.listener.settimeout(120)
        conn, _ = launch.listener.accept()
        conn.settimeout(120)
        assert hello_decoder.decode(_read_frame(conn)).token == launch.token
        assert launch.process.is_alive()
        assert children(launch.process.pid) == []  # no worker, no resource tracker
        conn.close()  # the API server went away without a word
        launch.process.join(60)
        assert launch.process.exitcode == 0
    finally:
        launch.abandon()
    # It built nothing: an engine's start logs its calibration; nothing at all was written.
    assert capfd.readouterr().err == ""


def test_a_configuration_that_fails_its_check_kills_the_launched_core(
        tiny_model, monkeypatch, capfd) -> None:
    launches: list[CoreLaunch] = []
    start = CoreLaunch.start

    def recording_start(warm_model: str | None = None) -> CoreLaunch:
        launches.append(start(warm_model))
        return launches[-1]

    alive_during_check: list[bool] = []
    resolve = model_setup.resolve

    def probing_resolve(config):
        # The probe that the launch is real: EngineCore's process runs while the API server
        # checks the configuration.
        alive_during_check.append(launches[0].process.is_alive())
        return resolve(config)

    monkeypatch.setattr(CoreLaunch, "start", staticmethod(recording_start))
    monkeypatch.setattr(model_setup, "resolve", probing_resolve)
    model = tiny_model("llama")
    capfd.readouterr()
    # The tiny model has 4 attention heads: 3 ranks cannot split them.
    code = main(["serve", "--model", model, "--dtype", "float32",
                 "--tensor-parallel-size", "3"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert "tensor_parallel_size 3 does not divide the model's 4 attention heads" in err
    assert "Traceback" not in err
    assert alive_during_check == [True]
    (launch,) = launches
    assert launch.process.exitcode == -signal.SIGKILL  # abandoned: killed, holding nothing
    assert launch.listener.fileno() == -1  # its port is closed
