"""The API server's handle on the EngineCore process: spawns it, streams requests to it and
fans its outputs back out to one asyncio queue per request."""

from __future__ import annotations

import asyncio
import hmac
import logging
import multiprocessing
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from engine.config import EngineConfig
from engine.load.load_report import ReplicaLoad
from engine.ipc.core_launch import CoreLaunch
from engine.ipc.core_messages import (HELLO_MAX_BYTES, AbortRequests, AddRequest, CoreFailed,
                                      CoreOutputs, CoreReady, FirstOutputDelivered, LoadQuery,
                                      LoadReport, RequestRejected, ShutdownCore, StartCore,
                                      encode_config, frame, from_core_decoder, hello_decoder,
                                      read_frame)
from engine.processing.input_processor import InputProcessor, validate_prompt
from engine.processing.output_processor import OutputProcessor
from engine.outputs import RequestOutput, SchedulerStats
from engine.sampling_params import SamplingParams
from monitor.slo_preempt_signal import SLOPreemptSignal


class OutputObserver(Protocol):
    def on_stats(self, stats: SchedulerStats) -> None: ...

    def on_request_output(self, output: RequestOutput) -> None: ...


logger = logging.getLogger(__name__)


def new_error_id() -> str:
    """The id under which an error's details are logged; the client sees only the id."""
    return f"err-{uuid.uuid4().hex[:16]}"


class EngineDeadError(RuntimeError):
    """The EngineCore process failed or exited; no request can be served any more."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its sampling, its logits, its detokenization); the
    engine and the other requests go on. The message is one line, safe to show the client."""


@dataclass
class _Finished:
    """Queue sentinel for a request that can no longer make progress."""

    error: Exception


class _Closed:
    """Queue sentinel: the stream was closed while a reader waited on it."""


class RequestStream:
    """One engine request's outputs (AsyncEngineClient.generate): an async iterator that ends
    after the finished output, raises what ended the request otherwise, and aborts the
    request in the core when closed before its end, whether or not it was ever read."""

    def __init__(self, client: AsyncEngineClient, request_id: str,
                 queue: asyncio.Queue) -> None:
        self._client, self.request_id, self._queue = client, request_id, queue
        self._over = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._over:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, _Closed):
            raise StopAsyncIteration
        if isinstance(item, _Finished):
            self._end(abort=False)
            raise item.error
        if item.finished:
            self._end(abort=False)
        return item

    def close(self) -> None:
        """Ends the stream; a request not finished yet is aborted in the core. Idempotent."""
        if not self._over:
            self._end(abort=True)
            self._queue.put_nowait(_Closed())  # a reader waiting on it stops

    async def aclose(self) -> None:
        self.close()

    def _end(self, abort: bool) -> None:
        self._over = True
        self._client._forget(self.request_id, abort)


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0,
                 launch: CoreLaunch | None = None) -> None:
        """``launch``: an EngineCore process started ahead of this client (engine.ipc.core_launch),
        which start() adopts instead of spawning one."""
        self.config = config
        self._launch = launch
        self.inputs = InputProcessor.for_model(config.model)
        self.tokenizer = self.inputs.tokenizer
        self.startup_timeout_s = startup_timeout_s
        self.stats = SchedulerStats()
        self.max_model_len = 0
        self.vocab_size = 0
        self.num_blocks = 0
        self.dead: str | None = None
        # Sees every stats snapshot and every request update (the Prometheus metrics).
        self.observer: OutputObserver | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._processor = OutputProcessor(self.tokenizer)
        self._writer: asyncio.StreamWriter | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._reader_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # The preempt signal's shared-memory segment. This process creates and owns it, not the
        # EngineCore process that uses it: the owner unlinks it, and this process outlives an
        # EngineCore that dies without a word (SIGKILL, a crash in a kernel), which would leave
        # it to the resource tracker's "leaked shared_memory" clean-up at exit.
        self._slo_preempt_signal: SLOPreemptSignal | None = None
        self._starting = False
        self._stopping = False  # the server was told to stop (stop_soon)
        # The load query in flight (one at a time: concurrent askers share its answer).
        self._load_reply: asyncio.Future[ReplicaLoad] | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the EngineCore process and waits until it is ready. Told to stop meanwhile
        (stop_soon), it returns without an engine (`dead` says why) instead of failing: the
        server is stopping, not failing to start."""
        self._starting = True
        try:
            await self._start()
        except (EngineDeadError, asyncio.IncompleteReadError, ConnectionError):
            await self._reap()
            if not self._stopping:
                self._release_signal()
                raise
            logger.info("the server was told to stop while the engine started")
            self.dead = "the server is shutting down"
        except BaseException:
            await self._reap()
            self._release_signal()
            raise
        finally:
            self._starting = False

    async def _start(self) -> None:
        self.loop = asyncio.get_running_loop()
        # Launched early by `sloserve serve` (it has been importing meanwhile), else now.
        launch = self._launch or self._launch_core()
        self._launch = None
        self._process, listener, token = launch.adopt()
        if self._stopping:  # told to stop before this client had the process
            self._process.terminate()
        connected: asyncio.Future = self.loop.create_future()
        peers: set[asyncio.StreamWriter] = set()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # One task per connection: a silent peer holds only its own connection, never the
            # real EngineCore's.
            peers.add(writer)
            if await _shows_token(reader, token) and not connected.done():
                peers.discard(writer)
                connected.set_result((reader, writer))
                return
            logger.warning("dropped a connection to the EngineCore port from %s: it did not "
                           "present the start-up token", writer.get_extra_info("peername"))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=listener)
        try:
            reader, self._writer = await self._wait_for(connected)
            if self.config.slo_preemption.enabled:  # EngineCore's own condition for one
                self._slo_preempt_signal = SLOPreemptSignal.create()
            self._writer.write(frame(StartCore(
                config=encode_config(self.config),
                slo_preempt_signal_name=(self._slo_preempt_signal.name
                                         if self._slo_preempt_signal is not None else None))))
            ready = from_core_decoder.decode(await self._wait_for(read_frame(reader)))
        finally:
            server.close()
            for writer in peers:  # peers that never said anything: they get nothing either
                writer.close()
        if isinstance(ready, CoreFailed):
            await self._reap()
            raise EngineDeadError(f"EngineCore failed to start:\n{ready.error}")
        assert isinstance(ready, CoreReady)
        if self._slo_preempt_signal is not None:
            # EngineCore and every worker rank that reads the signal attached before EngineCore
            # said ready: the name can go, so that this process killed (a fleet replica's actor
            # by SIGKILL) leaves nothing in /dev/shm.
            self._slo_preempt_signal.unlink()
        self.max_model_len, self.vocab_size = ready.max_model_len, ready.vocab_size
        self.num_blocks = ready.num_blocks
        # Until the first engine message brings a snapshot: an idle engine, every block free.
        self.stats = SchedulerStats(num_free_blocks=ready.num_blocks)
        self._reader_task = asyncio.create_task(self._read_outputs(reader))

    def _launch_core(self) -> CoreLaunch:
        return CoreLaunch.start(self.config.model.model)

    async def _wait_for(self, awaitable):
        """Await, but give up if the EngineCore process dies or startup takes too long."""
        task = asyncio.ensure_future(awaitable)
        deadline = time.monotonic() + self.startup_timeout_s
        while not task.done():
            await asyncio.wait([task], timeout=0.2)
            if not task.done() and (not self._process.is_alive()
                                    or time.monotonic() > deadline):
                task.cancel()
                code = self._process.exitcode
                await self._reap()
                raise EngineDeadError(f"EngineCore exited during startup (exit code {code})"
                                      if code is not None else "EngineCore startup timed out")
        return task.result()

    def fail_all(self, reason: str) -> None:
        """End every in-flight request with an error (server shutdown)."""
        self._fail_all(EngineDeadError(reason))

    def stop_soon(self) -> None:
        """The server got SIGTERM or SIGINT and will shut down; safe to call from a signal
        handler. An EngineCore that is still starting (loading weights, capturing graphs: minutes
        for a large model) is told at once with SIGTERM, on which it stops what it started, so
        that start() returns early and the server does not wait out a load only to undo it. One
        that serves already is stopped by shutdown(), between two steps."""
        self._stopping = True
        if self._starting and self._process is not None:
            self._process.terminate()  # the core ignores SIGINT: the API server decides

    async def shutdown(self) -> None:
        """Stops the EngineCore process and waits for it, then removes the preempt signal's
        segment. Idempotent; also right after a failed start()."""
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self._writer is not None and not self._writer.is_closing():
            try:
                self._writer.write(frame(ShutdownCore()))
                await self._writer.drain()
            except (ConnectionError, RuntimeError):
                pass
        await self._reap()
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._release_signal()

    def _release_signal(self) -> None:
        # After the EngineCore process is gone: nothing maps the segment any more.
        if self._slo_preempt_signal is not None:
            self._slo_preempt_signal.close()
            self._slo_preempt_signal = None

    async def _reap(self) -> None:
        process = self._process
        if process is None:
            return
        await asyncio.to_thread(process.join, 30)
        if process.is_alive():
            process.terminate()
            await asyncio.to_thread(process.join, 10)
        if process.is_alive():
            process.kill()
            await asyncio.to_thread(process.join)

    def is_alive(self) -> bool:
        return self.dead is None and self._process is not None and self._process.is_alive()

    def is_serving(self) -> bool:
        """Started (not still loading) and alive: there can be requests in flight."""
        return not self._starting and self._reader_task is not None and self.is_alive()

    # ---- requests ---------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int]) -> None:
        validate_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)

    def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, *, arrival_time: float, priority: int = 0,
                 ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
                 prefill_after: str | None = None) -> RequestStream:
        """Hands the request to EngineCore now, and returns the stream of its cumulative
        output (after every new token, the last one finished). Closing the stream before
        its end (a client that went away, a response never sent) aborts the request in the
        core. ``prefill_after``: a parallel sample's leader (engine.core.sibling_gate).

        Sent here, not when the stream is first read: under a flood the response that reads
        it starts some tens of ms later (its headers, the merge's tasks, every hop one turn
        of a busy event loop), time an urgent turn's deadline runs on for nothing."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self.validate(prompt_token_ids)
        params, eos = self.inputs.with_eos(params)
        queue: asyncio.Queue = asyncio.Queue()
        self._processor.add_request(request_id, prompt, prompt_token_ids, params, arrival_time,
                                    ttft_slo_ms, tpot_slo_ms)
        try:
            self._send(AddRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                  sampling_params=params, arrival_time=arrival_time,
                                  priority=priority, ttft_slo_ms=ttft_slo_ms,
                                  tpot_slo_ms=tpot_slo_ms, eos_token_id=eos,
                                  prefill_after=prefill_after,
                                  reports_first_output=ttft_slo_ms is not None))
        except BaseException:
            self._processor.remove(request_id)
            raise
        self._queues[request_id] = queue
        return RequestStream(self, request_id, queue)

    def _forget(self, request_id: str, abort: bool) -> None:
        """A request's stream is over: drop its state here, and (`abort`) end it in the core."""
        self._queues.pop(request_id, None)
        if abort:
            self._processor.remove(request_id)
            self._send(AbortRequests(request_ids=[request_id]), quiet=True)

    def note_first_output(self, request_id: str, delivered_at: float) -> None:
        """The request's first visible output was written to its client: tell EngineCore,
        which keeps its TTFT deadline live until then (requests with a TTFT objective)."""
        self._send(FirstOutputDelivered(request_id=request_id, delivered_at=delivered_at),
                   quiet=True)

    async def load_report(self, timeout: float = 1.0) -> ReplicaLoad:
        """This replica's load (engine.load.load_report.ReplicaLoad), as EngineCore reports
        it now: answered by its reader thread, also while a long step runs. Concurrent callers
        share one query. Raises TimeoutError past `timeout` seconds (the next call asks
        afresh), EngineDeadError once the engine is gone."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        reply = self._load_reply
        if reply is None or reply.done():
            reply = self._load_reply = asyncio.get_running_loop().create_future()
            self._send(LoadQuery())
        try:
            # Shielded: one caller's timeout or cancellation must not cancel the others' answer.
            return await asyncio.wait_for(asyncio.shield(reply), timeout)
        except asyncio.TimeoutError:
            if self._load_reply is reply:
                self._load_reply = None  # a lost answer must not hold every later caller
            raise TimeoutError(f"EngineCore sent no load report within {timeout} s") from None

    def _send(self, message, quiet: bool = False) -> None:
        """Queue a frame to EngineCore; `quiet` for best-effort messages (aborts) that have
        nothing left to do once the core is gone."""
        if self._writer is None or self._writer.is_closing():
            if quiet:
                return
            raise EngineDeadError(self.dead or "the EngineCore connection is closed")
        self._writer.write(frame(message))

    # ---- outputs ----------------------------------------------------------------------------

    async def _read_outputs(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = from_core_decoder.decode(await read_frame(reader))
                if isinstance(message, CoreOutputs):
                    self._dispatch(message)
                elif isinstance(message, RequestRejected):
                    self._processor.remove(message.request_id)
                    if (queue := self._queues.get(message.request_id)) is not None:
                        queue.put_nowait(_Finished(ValueError(message.error)))
                elif isinstance(message, LoadReport):
                    reply = self._load_reply
                    if reply is not None and not reply.done():
                        reply.set_result(message.load)
                elif isinstance(message, CoreFailed):
                    # The core's text is a traceback: the log gets it, clients get the id.
                    error_id = new_error_id()
                    logger.error("EngineCore failed (%s):\n%s", error_id, message.error)
                    self.dead = f"EngineCore failed (id {error_id}; see the server log)"
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.dead = self.dead or "EngineCore exited unexpectedly"
        self._fail_all(EngineDeadError(self.dead or "EngineCore stopped"))

    def _dispatch(self, message: CoreOutputs) -> None:
        self.stats = message.stats
        processed = self._processor.process(message.outputs)
        if self.observer is not None:
            self.observer.on_stats(message.stats)
            for out in processed.outputs:
                self.observer.on_request_output(out)
        if processed.stopped:
            self._send(AbortRequests(request_ids=processed.stopped, reason="stop"), quiet=True)
        if processed.failed:  # failed here, not in the core: free their KV there
            self._send(AbortRequests(request_ids=processed.failed, reason="error"), quiet=True)
        for out in processed.outputs:
            if (queue := self._queues.get(out.request_id)) is not None:
                queue.put_nowait(_Finished(RequestFailedError(out.error or "the request failed"))
                                 if out.finish_reason == "error" else out)

    def _fail_all(self, error: Exception) -> None:
        reply, self._load_reply = self._load_reply, None
        if reply is not None and not reply.done():
            reply.set_exception(error)
            reply.exception()  # retrieved here: no caller may be waiting on it any more
        for request_id, queue in list(self._queues.items()):
            self._processor.remove(request_id)
            queue.put_nowait(_Finished(error))


async def _shows_token(reader: asyncio.StreamReader, token: bytes) -> bool:
    """Whether the peer's first frame is a CoreHello carrying `token` (constant-time compare).
    Reads at most one small frame: a peer cannot make the server buffer more."""
    try:
        hello = hello_decoder.decode(await read_frame(reader, HELLO_MAX_BYTES))
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):  # DecodeError included
        return False
    return hmac.compare_digest(hello.token, token)
