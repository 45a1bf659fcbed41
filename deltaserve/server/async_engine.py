"""AsyncEngine: the synchronous LLMEngine driven by one background thread, fed from asyncio.

The engine thread owns the engine (LLMEngine is not thread-safe): it builds it, then loops
    take every queued add / abort  ->  step() if anything is unfinished  ->  hand each output to
    its request's sink  ->  snapshot stats()
and blocks on the command queue when idle. HTTP handlers (the event loop thread) only put
commands on the queue and read their own asyncio.Queue, which the engine thread fills through
loop.call_soon_threadsafe. So any number of clients stream at once, and a step never waits on a
slow client.

add_request() waits for the engine thread to accept the request, so an EngineInputError (bad
prompt, bad token ids) comes back to that caller alone as an exception; nothing else is disturbed.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import queue
import threading
import time
import traceback
from typing import Any, Callable

log = logging.getLogger("deltaserve.server")


class EngineNotReady(RuntimeError):
    """The engine is still loading (or failed to load)."""


class EngineStepError(RuntimeError):
    """The engine raised inside step(); the requests in flight were aborted."""


class RequestSink:
    """Outputs of one or more engine requests, delivered into one asyncio.Queue on the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:  # called from the engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed (server shutting down)
            pass


class AsyncEngine:
    def __init__(self, engine_config: Any, engine_factory: Callable[[Any], Any] | None = None,
                 freeze_heap: bool = False, on_loaded: Callable[[Any], None] | None = None):
        """freeze_heap: once the engine is loaded, collect and freeze the heap (gc.freeze), as vLLM does, so the
        collector's oldest-generation passes scan only what serving creates: on an unfrozen heap they took
        10-60 ms inside engine steps (measured on tiny). For a process that serves one engine for its whole
        life; frozen objects are never collected, so not for one that builds many.
        on_loaded(engine): called on the engine thread once the engine is built, before it serves (the KV events
        publisher attaches there); what it raises is a load error."""
        self.config = engine_config
        self._factory = engine_factory
        self._on_loaded = on_loaded
        self.freeze_heap = freeze_heap
        self._cmds: queue.Queue = queue.Queue()
        self._sinks: dict[str, RequestSink] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.ready = threading.Event()
        self.engine: Any = None
        self.tokenizer: Any = None
        self.load_error: str | None = None
        self.stats: Any = None  # the latest EngineStats snapshot (replaced whole, read lock-free)
        self.steps = 0
        self.step_errors = 0

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="deltaserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._cmds.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self._thread is not None and self._thread.is_alive() \
            and not self._stopping.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.ready.wait(timeout)

    # ---------------------------------------------------------------- API (event loop thread)
    async def add_request(self, request_id: str, prompt: Any, params: Any, sink: RequestSink,
                          cache_salt: str | None = None) -> None:
        """Queue a request; returns once the engine accepted it (the prompt's token ids as the engine runs them:
        image placeholders widened), raises what add_request raised."""
        if not self.is_ready:
            raise EngineNotReady(self.load_error or "the engine is not ready yet")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("add", (request_id, prompt, params, cache_salt, sink, fut, time.time())))
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored). Frees its pages and slot."""
        self._cmds.put(("abort", request_id))

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            if self._factory is not None:
                engine = self._factory(self.config)
            else:
                from ..engine.llm_engine import LLMEngine
                engine = LLMEngine.from_config(self.config)
            if self._on_loaded is not None:
                self._on_loaded(engine)
            self.engine = engine
            self.tokenizer = engine.tokenizer
            self._snapshot()
            if self.freeze_heap:
                gc.collect()
                gc.freeze()
        except BaseException as e:  # noqa: BLE001 - reported by /health and every request
            self.load_error = f"the engine failed to start: {type(e).__name__}: {e}"
            log.error("%s\n%s", self.load_error, traceback.format_exc())
            return
        self.ready.set()
        log.info("engine ready")
        while not self._stopping.is_set():
            try:
                busy = engine.has_unfinished_requests() or self._background(engine)
                self._drain(block=not busy)
                if self._stopping.is_set():
                    break
                if engine.has_unfinished_requests() or self._background(engine):
                    self._step()
                self._snapshot()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad command
                log.exception("engine loop error")
                time.sleep(0.01)
        # shutting down: tell whoever still waits
        for rid, sink in list(self._sinks.items()):
            sink.put(EngineStepError(self.load_error or "the server is shutting down"))
        self._sinks.clear()
        try:
            getattr(engine, "shutdown", lambda: None)()  # tensor-parallel workers, if any
        except Exception:  # noqa: BLE001 - shutting down anyway
            log.exception("engine.shutdown() failed")

    @staticmethod
    def _background(engine) -> bool:
        """The engine's own background work (an engine without any, such as a test's fake, has none)."""
        return bool(getattr(engine, "has_background_work", lambda: False)())

    def _snapshot(self) -> None:
        try:
            self.stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - metrics must never take the loop down
            log.exception("engine.stats() failed")

    def _drain(self, block: bool) -> None:
        first = True
        while True:
            try:
                if first and block:
                    cmd = self._cmds.get(timeout=0.25)
                else:
                    cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            first = False
            kind, payload = cmd
            if kind == "add":
                rid, prompt, params, salt, sink, fut, arrival = payload
                if not fut.set_running_or_notify_cancel():
                    continue  # the caller went away before the request was queued
                try:
                    ids = self.engine.add_request(rid, prompt, params, cache_salt=salt, arrival_time=arrival)
                except BaseException as e:  # noqa: BLE001 - goes back to that caller only
                    fut.set_exception(e)
                    continue
                self._sinks[rid] = sink
                fut.set_result(ids)
            elif kind == "abort":
                if self._sinks.pop(payload, None) is not None:
                    try:
                        self.engine.abort_request(payload)
                    except Exception:  # noqa: BLE001
                        log.exception("abort_request(%s) failed", payload)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - keep serving: abort what was in flight, report to those
            self.step_errors += 1
            if getattr(e, "fatal", False):  # the engine cannot go on (a tensor-parallel rank is gone): not ready
                self.load_error = f"the engine stopped: {type(e).__name__}: {e}"
                log.error("%s", self.load_error)
                for sink in self._sinks.values():
                    sink.put(EngineStepError(self.load_error))
                self._sinks.clear()
                self._stopping.set()
                return
            log.error("engine step failed; aborting the %d requests in flight\n%s", len(self._sinks),
                      traceback.format_exc())
            for rid, sink in list(self._sinks.items()):
                try:
                    self.engine.abort_request(rid)
                except Exception:  # noqa: BLE001
                    pass
                sink.put(EngineStepError(f"{type(e).__name__}: {e}"))
            self._sinks.clear()
            return
        self.steps += 1
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # aborted by its client meanwhile
            sink.put(out)
            if out.finished:
                del self._sinks[out.request_id]
