"""The EngineCore process: the busy loop behind the API server.

It owns the scheduler and the executor (and through it the TP workers). Between steps it drains
the messages that arrived (new requests, aborts); while requests are in flight it never waits on
the socket, and when idle it blocks on it. The API server never waits on a step: it keeps serving
HTTP while this process is inside a long forward pass.
"""

from __future__ import annotations

import signal
import socket
import traceback

from engine.core_messages import (AbortRequests, AddRequest, CoreFailed, CoreOutputs, CoreReady,
                                  FrameSocket, RequestRejected, ShutdownCore, config_decoder,
                                  to_core_decoder)
from engine.engine_core import EngineCore
from engine.request import Request, RequestStatus


def run_core_process(config_bytes: bytes, port: int) -> None:
    # The API server decides when to stop (it forwards SIGINT/SIGTERM as a ShutdownCore message);
    # a Ctrl-C delivered to the whole process group must not kill this loop mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = FrameSocket(socket.create_connection(("127.0.0.1", port)))
    try:
        core = EngineCore(config_decoder.decode(config_bytes))
    except Exception as exc:
        channel.send(CoreFailed(error=f"{type(exc).__name__}: {exc}"
                                if isinstance(exc, ValueError) else traceback.format_exc()))
        return
    channel.send(CoreReady(max_model_len=core.max_model_len, vocab_size=core.vocab_size,
                           num_blocks=core.model.num_blocks))
    try:
        _serve(core, channel)
    except Exception:
        try:
            channel.send(CoreFailed(error=traceback.format_exc()))
        except OSError:
            pass
    finally:
        core.shutdown()


def _serve(core: EngineCore, channel: FrameSocket) -> None:
    while True:
        busy = core.has_unfinished_requests()
        frames = channel.receive(timeout=0 if busy else None)
        if frames is None:  # the API server is gone
            return
        changed = False
        for payload in frames:
            message = to_core_decoder.decode(payload)
            if isinstance(message, ShutdownCore):
                return
            if isinstance(message, AddRequest):
                try:
                    core.add_request(_to_request(message))
                except ValueError as exc:
                    channel.send(RequestRejected(request_id=message.request_id, error=str(exc)))
            elif isinstance(message, AbortRequests):
                status = (RequestStatus.FINISHED_STOPPED if message.reason == "stop"
                          else RequestStatus.FINISHED_ABORTED)
                core.abort_requests(message.request_ids, status)
            changed = True
        if core.has_unfinished_requests():
            channel.send(CoreOutputs(outputs=core.step(), stats=core.scheduler.stats()))
        elif changed:  # aborts emptied the engine: let the gauges know
            channel.send(CoreOutputs(outputs=[], stats=core.scheduler.stats()))


def _to_request(message: AddRequest) -> Request:
    return Request(request_id=message.request_id, prompt_token_ids=message.prompt_token_ids,
                   sampling_params=message.sampling_params, eos_token_id=message.eos_token_id,
                   arrival_time=message.arrival_time, priority=message.priority,
                   ttft_slo_ms=message.ttft_slo_ms)
