"""The EngineCore process: the busy loop behind the API server.

It owns the scheduler and the executor (and through it the TP workers). A reader thread hands new
requests to the engine as they arrive, so the SLO monitor sees them during a step; between steps
the main loop applies aborts; while requests are in flight it never waits, and when idle it blocks
until a message arrives. The API server never waits on a step: it keeps serving
HTTP while this process is inside a long forward pass.
"""

from __future__ import annotations

import logging
import queue
import signal
import socket
import threading
import traceback
from types import FrameType

from engine.ipc.core_messages import (AbortRequests, AddRequest, CoreFailed, CoreHello, CoreOutputs,
                                      FirstOutputDelivered, LoadQuery, LoadReport,
                                      CoreReady, FrameSocket, RequestRejected, ShutdownCore,
                                      StartCore, config_decoder, start_decoder, to_core_decoder)
from engine.runtime.engine_core import EngineCore
from engine.log import configure_logging
from engine.model_folder import load_hf_config
from engine.core.request import Request, RequestStatus
from monitor.slo_preempt_signal import SLOPreemptSignal

logger = logging.getLogger(__name__)


class _Terminated(BaseException):
    """SIGTERM while the engine starts: unwinds EngineCore's constructor, whose clean-up stops
    whatever it had started. A BaseException, so that no `except Exception` on the way (the
    constructor's, run_core_process's own) turns it into a start-up failure."""


class _StopOnSigterm:
    """SIGTERM reaches this process alone (`kill` on its pid) or together with the API server
    (a signal to the process group: torchrun's kill of each rank, `timeout`, systemd's
    control-group kill). Either way it must end the way a ShutdownCore does, through
    EngineCore.shutdown() and the `finally`s, never by the default action: that exits at once,
    skips every finalizer and leaves the TP workers and the mapped segment to whoever notices.

    While the engine starts there is no loop to tell, so the handler raises; once it serves, the
    handler only queues a stop (SimpleQueue.put is safe in a signal handler) and the loop ends
    between two steps, never in the middle of one.

    It raises once: a signal to the process group reaches this process twice while it starts
    (the signal itself, then the API server's own terminate() of this process), and a second
    raise would land in the middle of the first one's unwinding (the constructor's clean-up,
    the `except _Terminated` handler) and cut it short."""

    def __init__(self) -> None:
        self.events: queue.SimpleQueue | None = None
        self.raised = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.events is not None:
            self.events.put(_TERMINATED)
        elif not self.raised:
            self.raised = True
            raise _Terminated()


def run_core_process(port: int, token: bytes, warm_model: str | None = None) -> None:
    """Connects to the API server's `port` with `token`, imports what an engine needs (for
    `warm_model`'s configuration) while the API server checks its side, then builds the engine
    that StartCore describes and serves it (engine.ipc.core_launch). The preempt signal's
    segment named there was created by the API server, which owns it (it unlinks it whatever
    becomes of this process); this process only maps it."""
    # The API server decides when to stop (it forwards SIGINT/SIGTERM as a ShutdownCore message);
    # a Ctrl-C delivered to the whole process group must not kill this loop mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    on_sigterm = _StopOnSigterm()
    signal.signal(signal.SIGTERM, on_sigterm)
    configure_logging()  # a spawned process starts with logging unconfigured
    channel: FrameSocket | None = None
    slo_preempt_signal: SLOPreemptSignal | None = None
    core: EngineCore | None = None
    try:
        try:
            channel = FrameSocket(socket.create_connection(("127.0.0.1", port)))
        except ConnectionRefusedError:
            return  # the API server stopped before it needed an engine
        channel.send(CoreHello(token=token))  # before anything else: how the server knows us
        _warm_up(warm_model)
        start = _wait_for_start(channel)
        if start is None:
            return  # the API server is gone: it never needed this engine
        if start.slo_preempt_signal_name is not None:
            slo_preempt_signal = SLOPreemptSignal.attach(start.slo_preempt_signal_name)
        try:
            core = EngineCore(config_decoder.decode(start.config),
                              slo_preempt_signal=slo_preempt_signal)
            # Before ready: a server's first agent turn must not wait 1-2 s for the vocabulary's
            # description, and building it while requests run would slow their steps (it holds
            # the GIL). A tokenizer xgrammar cannot read fails only constrained requests.
            if (unreadable := core.grammars.prepare().exception()) is not None:
                logger.warning("structured outputs are unavailable: xgrammar cannot describe "
                               "this tokenizer's vocabulary (%s: %s); each request that asks "
                               "for them will fail", type(unreadable).__name__, unreadable)
        except Exception as exc:
            channel.send(CoreFailed(error=f"{type(exc).__name__}: {exc}"
                                    if isinstance(exc, ValueError) else traceback.format_exc()))
            return
        channel.send(CoreReady(max_model_len=core.max_model_len, vocab_size=core.vocab_size,
                               num_blocks=core.model.num_blocks))
        if _serve(core, channel, on_sigterm) is _TERMINATED:
            logger.info("EngineCore: SIGTERM, shutting down")
    except _Terminated:
        # Stopped while starting: EngineCore's constructor stopped what it had started.
        logger.info("EngineCore: SIGTERM while starting, shutting down")
    except Exception:
        if channel is None:  # no API server to tell
            traceback.print_exc()
        else:
            try:
                channel.send(CoreFailed(error=traceback.format_exc()))
            except OSError:  # the API server is gone
                pass
    finally:
        # Nothing is left to unwind but this clean-up: from here SIGTERM has its default
        # action again (a second one means stop now), instead of queueing a stop no loop reads.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if core is not None:
            core.shutdown()
        if slo_preempt_signal is not None:
            slo_preempt_signal.close()  # unmaps it; the API server unlinks it


def _warm_up(model_dir: str | None) -> None:
    """Imports what building the engine will import (transformers' configuration class for the
    model, xgrammar) while the API server has not yet said what to build. Side-effect free:
    a folder that cannot be read is the API server's to report, from its own check."""
    if model_dir is not None:
        try:
            load_hf_config(model_dir)
        except Exception:  # noqa: BLE001 - reported by the API server's check, not here
            pass
    try:
        import xgrammar  # noqa: F401 - the grammar compiler's, loaded before ready
    except ImportError:
        pass


def _wait_for_start(channel: FrameSocket) -> StartCore | None:
    """The API server's StartCore; None when it closed the connection first."""
    while True:
        try:
            frames = channel.receive(timeout=None)
        except OSError:
            return None
        if frames is None:
            return None
        if len(frames) > 1:  # nothing else is sent before this engine says it is ready
            raise RuntimeError(f"the API server sent {len(frames)} frames before StartCore's "
                               f"answer")
        if frames:
            return start_decoder.decode(frames[0])


_ABORT_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "error": RequestStatus.FINISHED_ERROR}

_CLOSED = object()  # the API server's side of the socket is gone
_TERMINATED = object()  # SIGTERM: stop as ShutdownCore does
_ARRIVED = object()  # a request was handed to the engine: wake the loop


def _read_messages(core: EngineCore, channel: FrameSocket, events: queue.SimpleQueue) -> None:
    """Reader thread: hands new requests to the engine (and so to the monitor) the moment they
    arrive, also while the main thread is inside a forward pass, and answers load queries at
    once from what the engine publishes (EngineCore.load_report); everything else is queued
    for the main thread, which is the only one that touches the scheduler."""
    while True:
        try:
            frames = channel.receive(timeout=None)
        except OSError:
            frames = None
        if frames is None:
            events.put(_CLOSED)
            return
        for payload in frames:
            message = to_core_decoder.decode(payload)
            if isinstance(message, AddRequest):
                try:
                    core.submit_request(_to_request(message))
                    events.put(_ARRIVED)
                except ValueError as exc:
                    events.put(RequestRejected(request_id=message.request_id, error=str(exc)))
            elif isinstance(message, FirstOutputDelivered):
                # Read by the next schedule(): the loop need not wake for it.
                core.note_first_output(message.request_id, message.delivered_at)
            elif isinstance(message, LoadQuery):
                _answer_load_query(core, channel)
            else:
                events.put(message)
            if isinstance(message, ShutdownCore):
                return


def _answer_load_query(core: EngineCore, channel: FrameSocket) -> None:
    try:
        report = core.load_report()
    except Exception:
        # A report is advice to a router: a failure to build one (a bug) must not end the
        # reader thread, and with it the engine. The asker times out and asks again.
        logger.exception("EngineCore: building a load report failed")
        return
    try:
        channel.send(LoadReport(load=report))
    except OSError:  # the API server is gone: this thread learns it from receive
        pass


def _serve(core: EngineCore, channel: FrameSocket, on_sigterm: _StopOnSigterm) -> object:
    """Runs until the API server or a signal says stop; returns what said so."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    on_sigterm.events = events
    # A request whose grammar compiled (or failed to) is handed over from the grammar thread.
    core.wake = lambda: events.put(_ARRIVED)
    threading.Thread(target=_read_messages, args=(core, channel, events),
                     name="sloserve-core-reader", daemon=True).start()
    while True:
        busy = core.has_unfinished_requests()
        changed = False
        try:
            event = events.get(block=not busy)
            while True:
                if event is _CLOSED or event is _TERMINATED or isinstance(event, ShutdownCore):
                    return event
                if isinstance(event, RequestRejected):
                    channel.send(event)
                elif isinstance(event, AbortRequests):
                    status = _ABORT_STATUS.get(event.reason, RequestStatus.FINISHED_ABORTED)
                    core.abort_requests(event.request_ids, status)
                changed = True
                event = events.get_nowait()
        except queue.Empty:
            pass
        if core.has_unfinished_requests():
            outputs = core.step()
            _send_rejected(core, channel)
            channel.send(CoreOutputs(outputs=outputs, stats=core.stats()))
        else:
            _send_rejected(core, channel)  # a grammar that failed to compile
            if changed:  # aborts emptied the engine: let the gauges know
                channel.send(CoreOutputs(outputs=[], stats=core.stats()))


def _send_rejected(core: EngineCore, channel: FrameSocket) -> None:
    for request_id, error in core.take_rejected():
        channel.send(RequestRejected(request_id=request_id, error=error))


def _to_request(message: AddRequest) -> Request:
    return Request(request_id=message.request_id, prompt_token_ids=message.prompt_token_ids,
                   sampling_params=message.sampling_params, eos_token_id=message.eos_token_id,
                   arrival_time=message.arrival_time, priority=message.priority,
                   ttft_slo_ms=message.ttft_slo_ms, tpot_slo_ms=message.tpot_slo_ms,
                   prefill_after=message.prefill_after,
                   reports_first_output=message.reports_first_output)
