"""AsyncEngine: the event loop's handle on the engine thread (DESIGN.md, threading contract).

    loop (main thread)                          engine thread
    ------------------                          -------------
    generate(): validate, track, inbox.append   drain inbox -> EngineCore.add_request/abort
                wake.set()                      step() -> EngineCoreOutputs
    _on_step(): detokenise, stop strings,  <--  ONE loop.call_soon_threadsafe per step
                per-request asyncio.Queue

The inbox is a deque (append and popleft are atomic) plus a threading.Event that wakes
an idle engine; no lock is held across a step. The loop never blocks on the engine and
the engine never awaits the loop. A request the engine refuses, or a step that raises,
fails only the requests concerned; the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable, Optional, Union

from streamserve.config import Config
from streamserve.engine import structured_output as so
from streamserve.engine.core import EngineCore, StepFailed
from streamserve.engine.request import EngineCoreOutput
from streamserve.frontend.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence, check_step_output
from streamserve.frontend.input_processor import InputProcessor
from streamserve.frontend.output_processor import OutputProcessor
from streamserve.frontend.renderer import Renderer, load_tokenizer
from streamserve.heap import collector_paused, freeze_loaded
from streamserve.lora.adapter import LoRAAdapter
from streamserve.lora.registry import LoRARegistry
from streamserve.outputs import RequestOutput
from streamserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread could not start (loading failed) or has stopped."""


class EngineStepError(RuntimeError):
    """A step raised: each request in it fails with this (a server error, whatever the step's
    own exception was: it need not be any one request's fault); the others go on."""


class AsyncEngine:
    """`config` may be a function that builds the Config: then resolving the model (which
    may fetch and convert it) also happens on the engine thread, and a server in front of
    it listens at once. Everything model-dependent exists once `is_ready`. With `freeze_heap`
    (for a process that keeps this engine to its end, as the server does), the heap left by the
    load is collected once and frozen before the engine says it is ready, and the collector is
    on from then (heap.freeze_loaded; the server's __main__ turns it off at start); `shutdown`
    unfreezes the heap."""

    def __init__(self, config: Union[Config, Callable[[], Config]], freeze_heap: bool = False) -> None:
        self._make_config = config if callable(config) else (lambda: config)
        self._freeze_heap = freeze_heap
        self.config: Optional[Config] = None
        self.tokenizer = self.renderer = self.output_processor = None
        self.input_processor: Optional[InputProcessor] = None  # needs the vocabulary size
        self.engine_core: Optional[EngineCore] = None  # built on the engine thread
        self.load_error: Optional[BaseException] = None
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._ready: Optional[asyncio.Event] = None
        self._ids = itertools.count()
        self.num_steps = 0

    # -- life cycle (loop side) ----------------------------------------------------

    def start(self) -> None:
        """Start loading the model on the engine thread; returns at once."""
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._thread = threading.Thread(target=self._engine_main, name="streamserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        return self._ready is not None and self._ready.is_set() and self.load_error is None

    @property
    def loras(self) -> Optional[LoRARegistry]:
        """The LoRA adapters requests may name (None unless enable_lora); once ready."""
        return None if self.engine_core is None else self.engine_core.loras

    @property
    def num_in_flight(self) -> int:
        """Requests being streamed (added by generate and not yet finished or closed)."""
        return len(self._queues)

    async def wait_ready(self) -> None:
        assert self._ready is not None, "start() first"
        await self._ready.wait()
        if self.load_error is not None:
            raise EngineDeadError(f"the engine failed to load: {self.load_error}") from self.load_error

    async def shutdown(self) -> None:
        """Stop the engine thread; one still loading the model (converting a GGUF, reading
        weights) is not waited for: it is a daemon thread, and ends with the process."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None and self._ready.is_set():
            await asyncio.to_thread(self._thread.join)
            if self._freeze_heap and self.load_error is None:
                gc.unfreeze()  # what was frozen may now be cycles to collect

    # -- requests (loop side) ------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: Optional[str] = None, prompt: Optional[str] = None,
                       priority: int = 0, lora: Optional[LoRAAdapter] = None) -> AsyncIterator[RequestOutput]:
        """Stream one request: each item holds what is new (text, token ids) per sample.
        Closing the iterator early (a client went away) aborts the request. priority: under
        the priority policy, lower runs first. lora: the adapter it runs through (loras.get(name))."""
        if not self.is_ready:
            raise EngineDeadError("the engine is not ready")
        self.input_processor.validate(prompt_token_ids, params)
        self.input_processor.check_priority(priority)
        if params.structured_outputs is not None:  # its regexes' token tries, built off the engine thread
            wanted = so.regexes(params.structured_outputs.states)
            if wanted:
                await asyncio.to_thread(_prepare_masks, self.engine_core, wanted)
        taken = lambda rid: rid in self._queues or rid in self.output_processor.parents  # noqa: E731
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while taken(request_id):  # a caller named one of its own so
                request_id = f"req-{next(self._ids)}"
        elif taken(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        children = self.output_processor.add_request(request_id, prompt, prompt_token_ids, params,
                                                     stream=True)
        self._queues[request_id] = queue
        self._send("add", self.input_processor.process(children, prompt_token_ids, params,
                                                       time.monotonic(), priority, lora))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def beam_search(self, prompt_token_ids: list[int], params: BeamSearchParams, priority: int = 0,
                          lora: Optional[LoRAAdapter] = None) -> list[BeamSearchSequence]:
        """The params.beam_width best sequences from the prompt (frontend/beam_search.py): each
        step's beams go to the engine together, one token each; their text is their own."""
        search = BeamSearch(prompt_token_ids, params, self.input_processor.eos_token_ids)
        step = params.step_params()
        while not search.done:
            finals = await asyncio.gather(*(_last_logprobs(self.generate(p, step, priority=priority, lora=lora))
                                            for p in search.prompts()))
            search.advance(finals)
        return search.result(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))

    def abort_all(self, why: str) -> int:
        """Abort every request in flight, each of its streams failing with EngineDeadError(why);
        how many there were."""
        ids = list(self._queues)
        for request_id in ids:
            self.abort(request_id)
            self._queues[request_id].put_nowait(EngineDeadError(why))
        return len(ids)

    def abort(self, request_id: str) -> None:
        """Forget a request and tell the engine to free its blocks (within one step)."""
        children = self.output_processor.abort_request(request_id)
        if children:
            self._send("abort", children)

    def _send(self, kind: str, payload: object) -> None:
        self._inbox.append((kind, payload))
        self._wake.set()

    # -- the engine thread -----------------------------------------------------------

    def _engine_main(self) -> None:
        try:
            with collector_paused():
                self.config = config = self._make_config()
                self.tokenizer = load_tokenizer(config.model.tokenizer, config.model.chat_template)
                self.renderer = Renderer(self.tokenizer)
                self.output_processor = OutputProcessor(self.tokenizer)
                core = EngineCore(config, self.tokenizer)
            if self._freeze_heap:
                freeze_loaded()
        except BaseException as exc:  # a load failure must reach /health, not kill silently
            if not isinstance(exc, (ValueError, TypeError)):  # those already say what is wrong
                logger.exception("engine failed to load")
            self.load_error = exc
            self._signal_ready()
            return
        self.engine_core = core
        self.input_processor = InputProcessor(self.config, self.renderer, core.vocab_size)
        self._signal_ready()
        # Structured output's token texts (~1 s on a 49k vocabulary), read ahead while the server
        # idles, so that the first structured request does not stall every stream's step.
        threading.Thread(target=_read_ahead, args=(core,), name="streamserve-vocabulary", daemon=True).start()
        while not self._stopping:
            refused = self._drain_inbox(core)
            if not core.has_unfinished_requests():
                if refused:
                    self._loop.call_soon_threadsafe(self._on_step, [], refused)
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = core.step()
            except Exception as exc:  # fail the step's requests (all, where it broke elsewhere), keep going
                cause = exc.__cause__ if isinstance(exc, StepFailed) else exc
                logger.error("engine step failed", exc_info=cause)
                failed = exc.request_ids if isinstance(exc, StepFailed) else core.fail(list(core.scheduler.requests))
                error = EngineStepError(f"the engine step failed: {cause}")
                refused += [(rid, error) for rid in failed]
                outputs = []
            self.num_steps += 1
            self._loop.call_soon_threadsafe(self._on_step, outputs, refused)

    def _signal_ready(self) -> None:
        """Loaded (or failed to): tell the loop, unless it shut down meanwhile (and is gone)."""
        with contextlib.suppress(RuntimeError):  # the loop closed
            if not self._stopping:
                self._loop.call_soon_threadsafe(self._ready.set)

    def _drain_inbox(self, core: EngineCore) -> list[tuple[str, BaseException]]:
        refused: list[tuple[str, BaseException]] = []
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "abort":
                core.abort_requests(payload)
                continue
            for request in payload:
                try:
                    core.add_request(request)
                except Exception as exc:
                    refused.append((request.request_id, exc))
        return refused

    # -- back on the loop ------------------------------------------------------------

    def _on_step(self, outputs: list[EngineCoreOutput],
                 refused: list[tuple[str, BaseException]]) -> None:
        processed = self.output_processor.process_outputs(outputs)
        if processed.to_abort:
            self._send("abort", processed.to_abort)
        for delta in processed.deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
        for child_id, exc in refused:
            parent_id = self.output_processor.parent_of(child_id)
            if parent_id is not None:
                self.abort(parent_id)
                queue = self._queues.get(parent_id)
                if queue is not None:
                    queue.put_nowait(exc)


async def _last_logprobs(deltas: AsyncIterator[RequestOutput]) -> dict:
    """A one-token request's logprobs entry (its last delta's)."""
    entries = []
    async with contextlib.aclosing(deltas) as stream:
        async for delta in stream:
            entries += delta.outputs[0].logprobs or []
    return check_step_output(entries)


def _prepare_masks(core: EngineCore, wanted: set) -> None:
    try:
        core.scheduler.vocabulary().prepare(wanted)
    except Exception:  # the engine builds what it needs itself, and says what failed
        logger.warning("could not build structured output's token tries ahead", exc_info=True)


def _read_ahead(core: EngineCore) -> None:
    try:
        core.scheduler.vocabulary()
    except Exception:  # the first structured request will try again, and say what failed
        logger.warning("could not read structured output's token texts ahead", exc_info=True)
