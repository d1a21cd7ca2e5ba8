"""EngineCore: the busy loop's body. One step = schedule, run, update."""

from __future__ import annotations

import logging

from streamserve.config import Config
from streamserve.engine.request import EngineCoreOutput, EngineCoreRequest, Request
from streamserve.engine.scheduler import Scheduler
from streamserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.model_runner = ModelRunner(config)
        self.scheduler = Scheduler(config, self.model_runner.num_blocks)
        self.vocab_size = self.model_runner.model.arch.vocab_size

    def add_request(self, request: EngineCoreRequest) -> None:
        self.validate(request)
        self.scheduler.add_request(Request.from_engine_core_request(request, self.config.model.max_model_len))

    def validate(self, request: EngineCoreRequest) -> None:
        """Refuse what the engine cannot run, with the numbers in the message."""
        ids = request.prompt_token_ids
        max_len = self.config.model.max_model_len
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(ids) >= max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is {max_len}: "
                             "there is no room to generate")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)
