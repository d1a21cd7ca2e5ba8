"""EngineCore: the busy loop's body. One step = schedule, run, update.

Under async scheduling (config.scheduler.async_scheduling) a step schedules and launches the
next batch first, then reads back the batch launched by the step before and updates from
it: the device runs one batch while the CPU schedules, lays out and launches the next, and a
decode reads the token its request sampled in the batch before on the device (the scheduler
counts that token as in flight: Request.num_pending). A batch with a request whose sampling
reads its tokens on the host is read back before the next is scheduled.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple, Optional

from streamserve.config import Config
from streamserve.engine.request import EngineCoreOutput, EngineCoreRequest, Request, validate_prompt
from streamserve.engine.scheduler import Scheduler
from streamserve.engine.structured_output import Vocabulary
from streamserve.lora.registry import LoRARegistry
from streamserve.sampling_params import ParamError
from streamserve.engine.scheduler_output import SchedulerOutput
from streamserve.worker.model_runner import LaunchedStep, ModelRunner

logger = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """A step raised (its cause is __cause__): its requests, `request_ids`, were aborted; the
    others, waiting or not scheduled in it, go on."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"a step of {len(request_ids)} requests failed")
        self.request_ids = request_ids


class InFlight(NamedTuple):
    """A batch launched and not yet read back (async scheduling)."""

    scheduler_output: SchedulerOutput
    launched: LaunchedStep


class EngineCore:
    def __init__(self, config: Config, tokenizer=None) -> None:
        """tokenizer: what structured output reads the tokens' texts from (without one, it is refused)."""
        self.config = config
        self.model_runner = ModelRunner(config)
        self.vocab_size = self.model_runner.model.arch.vocab_size
        self.scheduler = Scheduler(config, self.model_runner.num_blocks,
                                   None if tokenizer is None else lambda: self._vocabulary(tokenizer))
        speculative = config.scheduler.speculative
        if speculative is not None:
            logger.info("speculative decoding: up to %d tokens a step guessed by n-gram lookup (n from %d down to %d)",
                        speculative.num_speculative_tokens, speculative.prompt_lookup_max,
                        speculative.prompt_lookup_min)
        # the LoRA adapters requests may name (--enable-lora), those of --lora-modules read now
        self.loras: Optional[LoRARegistry] = None
        if config.lora.enable_lora:
            runner = self.model_runner
            self.loras = LoRARegistry(config.lora, runner.model, runner.dtype, runner.device)
            for adapter in self.loras.load_modules(config.lora.lora_modules or []):
                logger.info("LoRA adapter %r: rank %d, %d layers, %.1f MB, from %s", adapter.name, adapter.rank,
                            len(adapter.weights), adapter.nbytes / 1e6, adapter.path)
        self.in_flight: Optional[InFlight] = None  # (async scheduling) the batch the device runs
        if self.runs_ahead:
            logger.info("async scheduling: each step is scheduled and launched while the one before runs")

    def add_request(self, request: EngineCoreRequest) -> None:
        self.validate(request)
        self.scheduler.add_request(Request.from_engine_core_request(request, self.config.model.max_model_len))

    def validate(self, request: EngineCoreRequest) -> None:
        validate_prompt(request.prompt_token_ids, request.sampling_params,
                        self.config.model.max_model_len, self.vocab_size)
        params = request.sampling_params
        if request.lora is not None and self.loras is None:
            raise ParamError("this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)", "model")
        if params.structured_outputs is not None:
            if self.scheduler.make_vocabulary is None:
                raise ParamError("structured output needs the tokenizer, and this engine was built without one",
                                 "structured_outputs")
            if request.eos_token_id is None and not params.stop_token_set:
                raise ParamError("structured output ends with EOS once the output is whole, and this model has "
                                 "none: give stop_token_ids to end it with", "structured_outputs")

    def _vocabulary(self, tokenizer) -> Vocabulary:
        start = time.perf_counter()
        vocabulary = Vocabulary(tokenizer, self.vocab_size)
        logger.info("structured output: read %d token texts in %.2f s", self.vocab_size, time.perf_counter() - start)
        return vocabulary

    def fail(self, request_ids: list[str]) -> list[str]:
        """Abort (and return) the requests of a step that raised. Scheduling registered the step's
        full blocks for the prefix cache before their KV was written: none may be served, so
        every cached block is forgotten (a failed step is rare enough)."""
        self.abort_requests(request_ids)
        self.scheduler.kv_cache_manager.reset_prefix_cache()
        return request_ids

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.abort_request(request_id)
        self._forget_when_idle()

    def _forget_when_idle(self) -> None:
        """With no request left, the runner forgets the finished ones now rather than at the next
        step, which may be long in coming: their state (a LoRA adapter unloaded meanwhile, say)
        is not held that long."""
        scheduler = self.scheduler
        if scheduler.finished_req_ids and not scheduler.has_unfinished_requests():
            self.model_runner.forget(scheduler.finished_req_ids)
            scheduler.finished_req_ids = set()

    @property
    def runs_ahead(self) -> bool:
        """Whether each step is launched before the last one's tokens are read: the config's
        (SchedulerConfig.runs_ahead), which the scheduler and the runner read too."""
        return self.config.scheduler.runs_ahead

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        if self.runs_ahead:
            return self._step_ahead()
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = None
        try:
            scheduler_output = self.scheduler.schedule()
            runner_output = self.model_runner.execute_model(scheduler_output)
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
            self._forget_when_idle()
            return outputs
        except BaseException as exc:  # an error, or Ctrl-C in LLM.generate
            # The step's requests are half-run, with no consistent state to resume from
            # (all of them where scheduling itself failed).
            failed = self.fail(list(scheduler_output.num_scheduled_tokens if scheduler_output is not None
                                    else self.scheduler.requests))
            if isinstance(exc, Exception):
                raise StepFailed(failed) from exc
            raise

    def _step_ahead(self) -> list[EngineCoreOutput]:
        """Async scheduling's step: launch the next batch, then read back the one before (first,
        where one of its requests must be read before the next is scheduled) and return its outputs."""
        last, self.in_flight = self.in_flight, None
        scheduler, runner = self.scheduler, self.model_runner
        outputs: list[EngineCoreOutput] = []
        scheduled: Optional[SchedulerOutput] = None
        scheduling = False
        try:
            if last is not None and last.scheduler_output.waits_for_tokens:
                outputs, last = self._read_back(last), None
            if scheduler.has_unfinished_requests():
                scheduling = True
                scheduled = scheduler.schedule()
                scheduling = False
                self.in_flight = InFlight(scheduled, runner.launch(scheduled))
            if last is not None:
                outputs = self._read_back(last)
            return outputs
        except BaseException as exc:
            # The batches launched and not read back hold half-run requests (their tokens in
            # flight lost); every request where scheduling itself failed.
            runner.abandon()
            self.in_flight = None
            half_run = [s for s in (last.scheduler_output if last else None, scheduled) if s is not None]
            failed = self.fail(list(scheduler.requests) if scheduling else
                               list(dict.fromkeys(r for s in half_run for r in s.num_scheduled_tokens)))
            if isinstance(exc, Exception):
                raise StepFailed(failed) from exc
            raise

    def read_back_in_flight(self) -> list[EngineCoreOutput]:
        """Read back the batch in flight, if any (async scheduling), and return its outputs:
        after it no token is in flight, and steps may be switched to wait for theirs."""
        step, self.in_flight = self.in_flight, None
        return [] if step is None else self._read_back(step)

    def _read_back(self, step: InFlight) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(step.scheduler_output, self.model_runner.collect(step.launched))
        self._forget_when_idle()
        return outputs
