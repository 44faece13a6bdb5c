"""`AsyncEngine`: the single-threaded `LLMEngine` behind an asyncio front.

One background thread owns the engine: it is the only caller of add_request / step /
abort_request. The event loop sends it commands (add a batch of requests, abort some) through a
queue; the thread applies them between steps, so a request that arrives while others decode
joins the running batch at the next step. Outputs go back to each HTTP request's `RequestStream`
(an asyncio.Queue) through `loop.call_soon_threadsafe`, one hop per step.

Validation errors of add_request travel back through a future, so the route can answer 400
before it starts streaming. Work that is not a request (embeddings) is a `call`, run on the
same thread between steps, its result or error sent back through a future. If `step` ever
raises, the engine state cannot be trusted: the thread fails every open stream and exits, and
`/health` turns 503."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.outputs import RequestOutput
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError
from kvslim.lora.request import LoRARequest
from kvslim.server.metrics import ServerMetrics

logger = logging.getLogger("kvslim.server")

Prompt = str | list[int]


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (crashed or shut down); no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine ended this request because of an internal fault in its own processing (the
    engine serves the others); the message is `RequestOutput.error`."""


class RequestStream:
    """Outputs of the engine requests of one HTTP request, as `(prompt_index, RequestOutput)`
    pairs in the order the engine produced them; ends when every request has finished."""

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self._queue: asyncio.Queue = asyncio.Queue()
        self._num_unfinished = len(request_ids)

    def put(self, item: tuple[int, RequestOutput] | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._num_unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            index, output = item
            if output.error is not None:
                raise RequestFailedError(output.error)
            if output.finished:
                self._num_unfinished -= 1
            yield index, output


@dataclass
class _Submit:
    prompts: list[Prompt]
    params: SamplingParams
    stream: RequestStream
    done: asyncio.Future
    lora_request: LoRARequest | None = None
    submitted: float = field(default_factory=time.monotonic)


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future


@dataclass
class _Abort:
    request_ids: list[str]


class _Stop:
    pass


@dataclass
class _Tracked:
    """What the engine thread keeps per live request: where its outputs go, and timing."""
    stream: RequestStream
    index: int
    submitted: float
    last_output: float | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics,
                 on_crash: Callable[[], None] | None = None):
        """`on_crash` runs on the event loop once the engine thread has died of an error (not
        on a normal stop): `kvslim serve` uses it to exit so that a supervisor restarts it."""
        self.engine = engine
        self.metrics = metrics
        self.on_crash = on_crash
        self._commands: queue.Queue = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}        # engine thread only
        self._lock = threading.Lock()                   # orders "is it dead?" against commands
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- event-loop side -----------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvslim-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def health(self) -> dict | None:
        """/health's body while alive: none (200 alone) for one engine; replicas say how many
        of them run (kvslim.scaleout)."""
        return None

    async def collect_metrics(self) -> None:
        """Nothing: the engine thread records into the metrics after every step (replicas are
        asked for theirs here, before /metrics renders)."""

    async def add(self, request_ids: list[str], prompts: list[Prompt],
                  params: SamplingParams, lora_request: LoRARequest | None = None
                  ) -> RequestStream:
        """Queue one engine request per prompt (all or none), each run with `lora_request`'s
        adapter if given; raises the engine's InvalidRequestError for bad input. The caller
        owns `request_ids` and must `abort` them if it stops listening."""
        stream = RequestStream(request_ids)
        done = asyncio.get_running_loop().create_future()
        self._send(_Submit(prompts, params, stream, done, lora_request))
        await done
        return stream

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """`fn(engine)`'s result, run on the engine thread between two steps (no step runs
        meanwhile). Its KvslimError (bad input) is raised here as is; any other error of it
        as RequestFailedError, since the engine goes on serving."""
        done = asyncio.get_running_loop().create_future()
        self._send(_Call(fn, done))
        return await done

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests and free their blocks (unknown or finished ids are ignored)."""
        if self.is_alive:
            self._commands.put(_Abort(list(request_ids)))

    async def stop(self, timeout: float = 30.0) -> None:
        """End the thread; requests still open are aborted (the HTTP server has already waited
        for in-flight responses before calling this)."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, timeout)

    def _send(self, command) -> None:
        with self._lock:
            if self._dead is not None or self._thread is None:
                raise EngineDeadError("the engine loop is not running")
            self._commands.put(command)

    def _call_in_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:                             # loop closed: nobody is listening
            pass

    # ---- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        self.metrics.engine_alive.set(1)
        self._observe()
        try:
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._dispatch(outputs)
                    self._observe(batch_size=self.engine.num_running + _num_finished(outputs))
            self._shut(EngineDeadError("the server is shutting down"))
        except BaseException as e:                       # noqa: BLE001 - logged, and /health
            logger.exception("engine loop crashed")
            self._shut(EngineDeadError(f"the engine loop crashed: {type(e).__name__}: {e}"))
            if self.on_crash is not None:
                self._call_in_loop(self.on_crash)
        finally:
            self.metrics.engine_alive.set(0)

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when idle). False on stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Submit):
                self._submit(command)
            elif isinstance(command, _Call):
                self._run_call(command)
            else:
                for request_id in command.request_ids:
                    if self.engine.abort_request(request_id):
                        self.metrics.aborted.inc()
                    self._tracked.pop(request_id, None)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._observe()                                  # aborts free blocks: show it now
        return True

    def _submit(self, command: _Submit) -> None:
        added = []
        try:
            for request_id, prompt in zip(command.stream.request_ids, command.prompts):
                self.engine.add_request(prompt, command.params, request_id,
                                        lora_request=command.lora_request)
                added.append(request_id)
        except Exception as e:                           # all or none: undo the ones added
            for request_id in added:
                self.engine.abort_request(request_id)
            self._call_in_loop(_resolve, command.done, e)
            return
        for index, request_id in enumerate(added):
            self._tracked[request_id] = _Tracked(command.stream, index, command.submitted)
        self._call_in_loop(_resolve, command.done, None)

    def _run_call(self, command: _Call) -> None:
        try:
            result = command.fn(self.engine)
        except KvslimError as e:
            self._call_in_loop(_resolve, command.done, e)
        except Exception as e:                           # noqa: BLE001 - that call's alone
            logger.exception("engine call failed")
            self._call_in_loop(_resolve, command.done,
                               RequestFailedError(f"{type(e).__name__}: {e}"))
        else:
            self._call_in_loop(_resolve, command.done, None, result)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        deliveries = []
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            self._record(tracked, output, now)
            deliveries.append((tracked.stream, (tracked.index, output)))
            if output.finished:
                del self._tracked[output.request_id]
        if deliveries:
            self._call_in_loop(_deliver, deliveries)

    def _record(self, tracked: _Tracked, output: RequestOutput, now: float) -> None:
        m = self.metrics
        num_new = sum(len(c.delta_token_ids) for c in output.outputs)
        if num_new:
            m.generation_tokens.inc(num_new)
            if tracked.last_output is None:
                m.prompt_tokens.inc(len(output.prompt_token_ids))
                m.ttft.observe(now - tracked.submitted)
            else:
                m.itl.observe(now - tracked.last_output)
            tracked.last_output = now
        if output.finished:
            m.e2e.observe(now - tracked.submitted)
            for completion in output.outputs:
                m.finished.labels(completion.finish_reason or "unknown").inc()

    def _observe(self, batch_size: int | None = None) -> None:
        e = self.engine
        self.metrics.observe_engine(e.num_running, e.num_waiting, e.kv_cache_stats(), batch_size)
        spec = e.spec_decode_stats()
        if spec is not None:
            self.metrics.observe_speculation(spec)
        offload = e.kv_offload_stats()
        if offload is not None:
            self.metrics.observe_offload(offload)

    def _shut(self, error: EngineDeadError) -> None:
        """Fail every open stream and every queued submit; later `add` calls fail at once.
        The waiting clients are answered before anything touches the engine, whose state may be
        what broke: aborting is only to free blocks, and each abort is on its own."""
        with self._lock:
            self._dead = error
        request_ids = list(self._tracked)
        streams = {id(t.stream): t.stream for t in self._tracked.values()}
        self._tracked.clear()
        self._call_in_loop(_deliver, [(s, error) for s in streams.values()])
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, (_Submit, _Call)):
                self._call_in_loop(_resolve, command.done, error)
        for request_id in request_ids:
            try:
                self.engine.abort_request(request_id)
            except Exception:                            # noqa: BLE001 - best effort only
                logger.exception("abort of %s failed while shutting down", request_id)
        try:
            self._observe()
        except Exception:                                # noqa: BLE001 - best effort only
            pass


def _resolve(future: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
    if future.done():                                    # the route was cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _num_finished(outputs: list[RequestOutput]) -> int:
    """Sequences that ended in this step (they ran in it, but are no longer `running`)."""
    return sum(1 for o in outputs for c in o.outputs if c.finished and c.delta_token_ids)


def _deliver(deliveries) -> None:
    for stream, item in deliveries:
        stream.put(item)
