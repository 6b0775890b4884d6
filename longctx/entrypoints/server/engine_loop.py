"""One engine, one thread: the bridge between the asyncio event loop and ``LLMEngine``.

Owns: the engine thread (the only caller of ``add_request`` / ``abort`` / ``step``), the
inbox that carries commands to it, the per-request asyncio queues that carry updates back,
the in-flight bound, stream text hold-back for stop strings, and the metrics the engine
thread reports. Never: HTTP, JSON or validation (requests arrive already checked).

    event loop                              engine thread
    ----------                              -------------
    submit()  --("add", ...)--> inbox -->   add_request
    close()   --("abort", id)-> inbox -->   abort (pages freed at once)
                                            step() (decodes first, then prefill chunks)
    handle.queue <-- call_soon_threadsafe --  StepUpdate per request with new tokens

The thread sleeps on a condition variable while there is no work; a command wakes it. Between
two steps it drains the whole inbox, so a request waits at most one step to join the batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from longctx.engine.llm_engine import LLMEngine
from longctx.engine.output_processor import StepUpdate
from longctx.sampling_params import SamplingParams
from longctx.entrypoints.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The server holds as many requests as it may; the client should retry later."""


class EngineUnavailableError(Exception):
    """The engine thread has failed or is shutting down; no request can be served."""


class RequestCancelledError(Exception):
    """The server shut down before this request finished."""


class RequestHandle:
    """The event loop's end of one request. ``next()`` returns its updates in order, the last
    with ``finished`` set; ``close()`` (always call it) aborts it if it has not finished."""

    def __init__(self, owner: EngineLoop, request_id: str, num_prompt_tokens: int) -> None:
        self.owner, self.request_id, self.num_prompt_tokens = owner, request_id, num_prompt_tokens
        self.queue: asyncio.Queue[StepUpdate | Exception] = asyncio.Queue()
        self.finished = False
        self.closed = False

    async def next(self) -> StepUpdate:
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.owner._release(self)


@dataclass
class _Active:
    """Engine-thread bookkeeping of one request."""

    handle: RequestHandle
    arrival: float
    saw_first_token: bool = False


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_queued_requests: int) -> None:
        self.engine = engine
        self.metrics = metrics
        # A request runs when one of max_num_seqs slots is free and waits otherwise; waiting is
        # bounded by max_queued_requests, so this many may be in flight at once.
        self.capacity = engine.max_num_seqs + max_queued_requests
        self.num_in_flight = 0  # event loop only
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._closed = False  # guarded by _cond: the thread no longer reads the inbox
        self._active: dict[str, _Active] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="longctx-engine", daemon=True)

    # ------------------------------------------------------------------ event loop side

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the updates."""
        self._loop = asyncio.get_running_loop()
        self._publish_state()
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is still in flight and end the thread (blocks: run it off the loop)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self._problem() is None

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               arrival: float) -> RequestHandle:
        """Queue a validated request for the engine; raises ``QueueFullError`` when full."""
        if self.num_in_flight >= self.capacity:
            raise QueueFullError(f"the server is at capacity ({self.num_in_flight} requests in "
                                 f"flight, {self.capacity} allowed); retry later")
        handle = RequestHandle(self, request_id, len(prompt_ids))
        with self._cond:
            if self.error is not None or self._closed or self._stopping:
                raise EngineUnavailableError(self.unavailable_reason())
            self._inbox.append(("add", handle, prompt_ids, params, arrival))
            self._cond.notify()
        self.num_in_flight += 1
        return handle

    def cancel_all(self) -> None:
        """Abort every request in flight; each client hears that the server is shutting down."""
        with self._cond:
            self._inbox.append(("cancel_all",))
            self._cond.notify()

    def _release(self, handle: RequestHandle) -> None:
        self.num_in_flight -= 1
        if not handle.finished:
            with self._cond:
                self._inbox.append(("abort", handle.request_id))
                self._cond.notify()

    def unavailable_reason(self) -> str:
        return self._problem() or "the server is shutting down"

    def _problem(self) -> str | None:
        """Why the server cannot serve (what /health says), or None. A sequence-parallel rank
        that died or stopped answering counts at once, before a step finds out."""
        if self.error is not None:
            return f"the engine failed ({type(self.error).__name__}: {self.error}); restart the server"
        if not self._thread.is_alive():
            return "the server is shutting down"
        rank = self.engine.rank_health()
        return None if rank is None else f"{rank}; restart the server"

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while True:
                commands, stopping = self._take_commands()
                for command in commands:
                    self._apply(command)
                if stopping:
                    break
                if self.engine.has_unfinished():
                    self._step()  # (publishes the gauges itself, before delivering)
                else:
                    self._publish_state()
        except Exception as err:  # noqa: BLE001 - reported to every waiting client and /health
            log.exception("the engine thread failed; the server cannot serve requests any more")
            self.error = err
        finally:
            self._shut_down()

    def _take_commands(self) -> tuple[list[tuple], bool]:
        with self._cond:
            while not (self._inbox or self._stopping or self.engine.has_unfinished()):
                self._cond.wait()
            commands, self._inbox = self._inbox, []
            return commands, self._stopping

    def _apply(self, command: tuple) -> None:
        if command[0] == "cancel_all":
            self._cancel_active()
            return
        if command[0] == "abort":
            active = self._active.pop(command[1], None)
            if active is not None:
                self.engine.abort(command[1])
                self.metrics.requests_finished.labels(finish_reason="abort").inc()
            return
        _, handle, prompt_ids, params, arrival = command
        if handle.closed:  # the client left before its request reached the engine
            return
        try:
            self.engine.add_request(prompt_ids, params, request_id=handle.request_id)
        except ValueError as err:  # validated up front, so not expected; the client hears why
            self._deliver([(handle, err)])
            return
        self._active[handle.request_id] = _Active(handle, arrival)
        self.metrics.prompt_tokens.inc(len(prompt_ids))

    def _step(self) -> None:
        updates = self.engine.step()
        now = time.perf_counter()
        out: list[tuple[RequestHandle, StepUpdate | Exception]] = []
        for update in updates:
            active = self._active.get(update.request_id)
            if active is None or not update.new_token_ids:  # prefill progress: nothing to say
                continue
            out.append((active.handle, self._stream_update(active, update, now)))
        self._publish_state()  # first, so a client that saw its last token sees fresh gauges
        self._deliver(out)

    def _stream_update(self, active: _Active, update: StepUpdate, now: float) -> StepUpdate:
        """Record metrics; a finished request is released from the engine. The engine already
        holds back text that could still become a stop string."""
        self.metrics.generation_tokens.inc(len(update.new_token_ids))
        if not active.saw_first_token:
            active.saw_first_token = True
            self.metrics.time_to_first_token.observe(now - active.arrival)
        if update.finished:
            final = self.engine.release(update.request_id)
            del self._active[update.request_id]
            self.metrics.observe_finished(update.finish_reason or "stop", now - active.arrival,
                                          final.metrics.inter_token_latencies)
        return update

    def _publish_state(self) -> None:
        look = self.engine.lookahead
        stats = self.engine.stats()
        self.metrics.set_engine_state(stats["running"], stats["waiting"], self.engine.kv_usage(), self.engine.cache_stats(),
                                      look.stats.overall if look is not None else None, self.engine.disk_state())

    def _deliver(self, items: list[tuple[RequestHandle, StepUpdate | Exception]]) -> None:
        if not items or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def _shut_down(self) -> None:
        """Abort everything left, tell its clients why, and stop reading the inbox."""
        with self._cond:
            self._closed = True
            leftover, self._inbox = self._inbox, []
        for command in leftover:
            if command[0] == "add":
                self._deliver([(command[1], self._cancellation())])
        self._cancel_active()
        try:
            self._publish_state()
        except Exception:  # noqa: BLE001
            log.exception("could not publish the final engine state")

    def _cancel_active(self) -> None:
        for request_id, active in list(self._active.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine may be broken; the clients still hear
                log.exception("could not abort %s", request_id)
            self.metrics.requests_finished.labels(finish_reason="abort").inc()
            self._deliver([(active.handle, self._cancellation())])
        self._active.clear()

    def _cancellation(self) -> Exception:
        if self.error is not None:
            return EngineUnavailableError(self.unavailable_reason())
        return RequestCancelledError("the server shut down before this request finished")


def _put_all(items: list[tuple[RequestHandle, StepUpdate | Exception]]) -> None:
    for handle, item in items:
        if not handle.closed:
            handle.queue.put_nowait(item)
