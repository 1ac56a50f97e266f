"""Starting the EngineCore process ahead of the configuration it will serve.

Most of a server's start is Python importing: torch, then transformers' configuration class for
the model (2-3 s in transformers 5 on its own), in the API server to check the configuration and
again in EngineCore to build the engine. `sloserve serve` therefore launches EngineCore first
thing: while the API server checks the configuration and loads its tokenizer, EngineCore imports
what it will need, connects, and waits for StartCore (engine.ipc.core_messages). Until then it
has loaded no weights, mapped no segment and started no worker, so a launch that is called off
(a bad configuration) ends with a kill that leaves nothing behind.

This module is imported before anything heavy and imports nothing heavy itself: the process's
entry point loads engine.ipc.core_process (and torch) in the child only.
"""

from __future__ import annotations

import multiprocessing
import secrets
import signal
import socket
from multiprocessing.process import BaseProcess

from engine.compute_threads import bounded_spin_for_children

PROCESS_NAME = "sloserve-engine-core"


class CoreLaunch:
    """A started EngineCore process, the loopback port it connects to and the token it shows
    there. The API server's engine client adopts it (AsyncEngineClient); until then `abandon`
    ends it (as leaving a `with` block does)."""

    def __init__(self, listener: socket.socket, token: bytes,
                 process: BaseProcess | None = None) -> None:
        self.listener = listener
        self.token = token
        self.process = process
        self.adopted = False

    @classmethod
    def start(cls, warm_model: str | None = None) -> CoreLaunch:
        """Opens the port and spawns the process. ``warm_model``: the model folder whose
        configuration class it imports while it waits (a guess: a wrong or missing folder only
        costs that head start; StartCore's configuration is what counts)."""
        return cls.listen().spawn(warm_model)

    @classmethod
    def listen(cls) -> CoreLaunch:
        """The port and the token, no process yet (`spawn` starts it)."""
        # Any local process may connect to this port while it is open; only the peer that shows
        # this token first gets the channel (and so every prompt). The token travels in the
        # spawned process's arguments, through a pipe, never on a command line.
        return cls(socket.create_server(("127.0.0.1", 0)), secrets.token_bytes(32))

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def spawn(self, warm_model: str | None = None) -> CoreLaunch:
        try:
            # Not a daemon: EngineCore spawns the TP worker processes itself.
            self.process = multiprocessing.get_context("spawn").Process(
                target=run_launched_core, args=(self.port, self.token, warm_model),
                name=PROCESS_NAME)
            # libgomp reads its wait policy when the child imports torch: it must be in the
            # environment the child starts with (engine.compute_threads).
            with bounded_spin_for_children(api_server=True):
                self.process.start()
        except BaseException:
            self.listener.close()
            raise
        return self

    def __enter__(self) -> CoreLaunch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.abandon()

    def adopt(self) -> tuple[BaseProcess, socket.socket, bytes]:
        """Hands the process, the listening socket and the token to their owner for good."""
        assert self.process is not None, "adopted before it was spawned"
        self.adopted = True
        return self.process, self.listener, self.token

    def abandon(self) -> None:
        """Ends a launch nobody adopted (the server failed before it needed an engine); a no-op
        once adopted. A kill, not SIGTERM: the process holds nothing yet, and a kill keeps its
        start-up messages out of the error the user reads."""
        if self.adopted:
            return
        self.adopted = True  # once
        self.listener.close()
        if self.process is not None:
            if self.process.is_alive():
                self.process.kill()
            self.process.join()


def run_launched_core(port: int, token: bytes, warm_model: str | None) -> None:
    """The spawned process's entry point."""
    # The API server decides when to stop (it forwards SIGINT/SIGTERM as a ShutdownCore message,
    # or kills a launch it abandons): a Ctrl-C delivered to the whole process group must not
    # interrupt the imports below with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from engine.ipc.core_process import run_core_process

    run_core_process(port, token, warm_model)
