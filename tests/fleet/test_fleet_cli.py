"""`sloserve serve --replicas N ...`: the flags make the fleet they name, bad ones fail before Ray
starts, and the single-engine server never imports Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.entrypoints.cli import build_parser, main
from engine.fleet.cli_args import fleet_options


def _options(*flags: str):
    return fleet_options(build_parser().parse_args(["serve", *flags]))


def test_flags_make_the_fleet_they_name():
    options = _options("--replicas", "4", "--router", "least-queue", "--on-doomed", "reject",
                       "--report-period-ms", "50", "--address", "auto")
    assert (options.replicas, options.router, options.on_doomed, options.address) == (
        4, "least-queue", "reject", "auto")
    assert options.report_period_s == 0.05 and options.autoscaling is None
    scaled = _options("--replicas", "2", "--autoscale", "--target-attainment", "0.9",
                      "--upscale-delay-s", "3")
    auto = scaled.autoscaling
    assert (auto.min_replicas, auto.max_replicas) == (1, 4)  # default: twice --replicas
    assert auto.target_attainment == 0.9 and auto.upscale_delay_s == 3


def test_bad_fleet_flags_fail_before_anything_starts(capsys):
    with pytest.raises(ValueError, match="--min-replicas 5 is above --max-replicas 3"):
        _options("--replicas", "2", "--autoscale", "--min-replicas", "5", "--max-replicas",
                 "3")
    assert main(["serve", "--replicas", "2", "--router", "nearest"]) == 2
    assert "invalid choice: 'nearest'" in capsys.readouterr().err
    assert main(["serve", "--replicas", "0"]) == 2


def test_the_single_engine_server_imports_no_ray():
    probe = ("import sys; from engine.entrypoints.cli import build_parser; "
             "from engine.serving.api_server import build_app; "
             "build_parser().parse_args(['serve', '--replicas', '2']); "
             "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_on_doomed_is_the_ingress_s_in_a_fleet_and_the_server_s_alone():
    """One flag for both: a fleet's ingress judges over every replica, and its replicas serve
    what it sends them (judged again by their own queue alone, they would refuse what the
    router sent them on purpose)."""
    from engine.fleet.launch import _replica_settings
    from engine.serving.api_server import ServerSettings

    args = build_parser().parse_args(["serve", "--replicas", "2", "--on-doomed", "reject"])
    assert fleet_options(args).on_doomed == "reject" and args.on_doomed == "reject"
    server = ServerSettings(served_model_name="m", on_doomed="reject")
    assert _replica_settings(server).on_doomed == "serve"
    assert build_parser().parse_args(["serve"]).on_doomed == "serve"


def test_a_fleet_on_a_port_in_use_is_refused_naming_it_before_ray_starts(tiny_model, capsys,
                                                                        monkeypatch):
    """The ingress binds the fleet's port itself: one that is taken is a clear error naming the
    address (no traceback), before Ray is started or anything deployed."""
    import socket

    import ray

    looked_at_ray = []
    monkeypatch.setattr(ray, "is_initialized", lambda: looked_at_ray.append(1) or True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", tiny_model(), "--device", "cpu", "--replicas", "2",
                     "--port", str(port)])
    assert code == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("sloserve: error: ")
    assert f"the fleet cannot serve on 127.0.0.1:{port}" in last
    assert "Traceback" not in err
    assert not looked_at_ray  # the probe: refused before Ray was even looked at


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::"])
def test_the_ingress_listener_binds_ipv4_and_ipv6_hosts(host):
    """`--host` may be IPv4 or IPv6; the listener binds either, and its port is then taken."""
    import socket

    from engine.fleet.ingress_http import bind_listener
    from engine.ports import free_port

    if ":" in host and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    port = free_port(host)
    listener = bind_listener(host, port)
    try:
        listener.listen()
        assert listener.getsockname()[1] == port
        with pytest.raises(OSError, match=f"cannot serve on {host}:{port}"):
            bind_listener(host, port)
    finally:
        listener.close()
