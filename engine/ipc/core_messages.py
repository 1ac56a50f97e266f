"""Messages between the API server process and the EngineCore process.

Frames on a local TCP stream: a 4-byte big-endian length, then a msgpack body (msgspec; never
pickle). Each direction carries a tagged union, so a frame decodes to exactly one message type.
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct
import threading
from typing import Union

import msgspec

from engine.config import EngineConfig
from engine.load.load_report import ReplicaLoad
from engine.outputs import EngineCoreOutput, SchedulerStats
from engine.sampling_params import SamplingParams

_LENGTH = struct.Struct(">I")


# ---- API server -> EngineCore -------------------------------------------------------------------

class AddRequest(msgspec.Struct, tag="add", kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # time.monotonic(), comparable across processes on one machine
    priority: int = 0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    eos_token_id: int | None = None
    # A parallel sample: the sibling whose prefill it waits for (engine.core.sibling_gate).
    prefill_after: str | None = None
    # The API server will send FirstOutputDelivered for it (requests with a TTFT objective).
    reports_first_output: bool = False


class FirstOutputDelivered(msgspec.Struct, tag="delivered", kw_only=True):
    """The request's first visible output was written to its client at `delivered_at`
    (time.monotonic()): its TTFT objective is met or missed for good."""

    request_id: str
    delivered_at: float


class AbortRequests(msgspec.Struct, tag="abort", kw_only=True):
    request_ids: list[str]
    # "abort" (client gone), "stop" (the API server found a stop string) or "error" (handling
    # the request's output failed in the API server).
    reason: str = "abort"


class ShutdownCore(msgspec.Struct, tag="shutdown"):
    pass


class LoadQuery(msgspec.Struct, tag="load_query"):
    """Asks for a LoadReport: answered by EngineCore's reader thread at once, also while the
    engine is inside a step."""


ToCore = Union[AddRequest, FirstOutputDelivered, AbortRequests, ShutdownCore, LoadQuery]


# ---- EngineCore -> API server -------------------------------------------------------------------

class CoreReady(msgspec.Struct, tag="ready", kw_only=True):
    max_model_len: int
    vocab_size: int
    num_blocks: int


class CoreOutputs(msgspec.Struct, tag="outputs", kw_only=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


class RequestRejected(msgspec.Struct, tag="rejected", kw_only=True):
    request_id: str
    error: str


class CoreFailed(msgspec.Struct, tag="failed", kw_only=True):
    error: str


class LoadReport(msgspec.Struct, tag="load", kw_only=True):
    """The answer to a LoadQuery (engine.load.load_report)."""

    load: ReplicaLoad


FromCore = Union[CoreReady, CoreOutputs, RequestRejected, CoreFailed, LoadReport]


class CoreHello(msgspec.Struct, kw_only=True):
    """EngineCore's first frame on the channel: the token the API server gave it when spawning
    it. The API server's port is open to every local process during start-up; a peer that does
    not show the token first is dropped, so an impostor never receives a prompt."""

    token: bytes


# A hello frame is a few dozen bytes: a peer announcing more is not EngineCore.
HELLO_MAX_BYTES = 256


class StartCore(msgspec.Struct, kw_only=True):
    """The API server's first frame, once it has checked the configuration: what to build.
    Until it arrives the EngineCore process only imports (engine.ipc.core_launch), so a start
    that is called off leaves nothing behind."""

    config: bytes  # encode_config's: the EngineConfig
    # The preempt signal's segment, which the API server created and owns; None when the
    # configuration runs no monitor.
    slo_preempt_signal_name: str | None = None


_encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
config_decoder = msgspec.msgpack.Decoder(EngineConfig)
hello_decoder = msgspec.msgpack.Decoder(CoreHello)
start_decoder = msgspec.msgpack.Decoder(StartCore)


def frame(message: msgspec.Struct | EngineConfig) -> bytes:
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


def encode_config(config: EngineConfig) -> bytes:
    return _encoder.encode(config)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int | None = None) -> bytes:
    """One frame's body; ValueError when it announces more than `max_bytes` (an untrusted peer
    must not make us buffer what it likes)."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if max_bytes is not None and length > max_bytes:
        raise ValueError(f"frame of {length} bytes, more than the {max_bytes} allowed here")
    return await reader.readexactly(length)


class FrameSocket:
    """Blocking side (EngineCore): whole frames from a socket. Once part of a frame has arrived,
    the rest is read before returning, so a caller never sees half a message."""

    def __init__(self, sock: socket.socket) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Without it Nagle's algorithm holds a small frame (a step's outputs) until the peer
            # ACKs the previous one, and delayed ACKs made that ~200 ms: every first token
            # waited for it. asyncio sets this on the API server's side by itself.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._buffer = bytearray()
        # Two threads send: the engine loop (outputs) and the reader thread (load reports,
        # answered during a step). sendall may write a frame in several pieces: whole frames
        # must never interleave.
        self._send_lock = threading.Lock()

    def send(self, message: msgspec.Struct) -> None:
        data = frame(message)
        with self._send_lock:
            self.sock.sendall(data)

    def receive(self, timeout: float | None) -> list[bytes] | None:
        """Frames that arrive within `timeout` seconds (0: only what is there; None: wait).
        Returns None when the peer closed the connection."""
        readable, _, _ = select.select([self.sock], [], [], timeout)
        if readable and not self._fill():
            return None
        frames = []
        while True:
            if len(self._buffer) >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(self._buffer)
                end = _LENGTH.size + length
                if len(self._buffer) >= end:
                    frames.append(bytes(self._buffer[_LENGTH.size:end]))
                    del self._buffer[:end]
                    continue
            if not self._buffer:
                return frames
            if not self._fill():  # a partial frame: block for the rest
                return None

    def _fill(self) -> bool:
        chunk = self.sock.recv(1 << 20)
        self._buffer += chunk
        return bool(chunk)
