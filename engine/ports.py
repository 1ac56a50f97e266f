"""A free TCP port: what the engine's workers rendezvous on, and the benchmarks' and tests'
servers bind."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` (an IPv4 or IPv6 address, or a name) as this returns. Another
    process may take it before the caller binds it: callers that can retry should."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.bind(address)
        return probe.getsockname()[1]
