"""Renderer: text and chat messages -> token IDs (the tokenizer and its chat template)."""

from __future__ import annotations

import functools
import inspect
import json
import os
from typing import Any, Optional

from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from streamserve.sampling_params import ParamError

Message = dict[str, Any]


def load_tokenizer(path: str, chat_template: Optional[str] = None) -> PreTrainedTokenizerBase:
    """The tokenizer at `path`, with `chat_template` (a template's text) in place of its own."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, config=tokenizer_choice_config(path))
    except Exception as exc:  # transformers raises many kinds here; say what and where
        raise ValueError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def tokenizer_choice_config(path: str) -> Optional[PretrainedConfig]:
    """What AutoTokenizer reads of a model's config to choose the tokenizer's class (model_type,
    name, tokenizer_class), without AutoConfig, which in transformers 5 imports the model type's
    configuration module and with it transformers' model-loading code and
    torch.distributed.tensor: 2.4-2.7 s of a 5 s load of the default model here. Only where
    tokenizer_config.json names its class and neither file brings code of its own (auto_map):
    AutoTokenizer then chooses from these fields and that name alone. Else None, and
    AutoTokenizer loads the config itself."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            declared = json.load(f)
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            model = json.load(f)
    except (OSError, ValueError):  # a hub ID, or no such files: AutoTokenizer's own way
        return None
    if not (isinstance(declared, dict) and isinstance(model, dict) and declared.get("tokenizer_class")
            and isinstance(model.get("model_type"), str) and "auto_map" not in declared and "auto_map" not in model):
        return None
    config = _config_class(model["model_type"])(tokenizer_class=model.get("tokenizer_class"))
    config.name_or_path = path
    return config


@functools.lru_cache(maxsize=None)
def _config_class(model_type: str) -> type:
    return type(f"TokenizerChoiceConfig[{model_type}]", (PretrainedConfig,), {"model_type": model_type})


class Renderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    chat_template_kwargs: Optional[dict] = None, continue_final_message: bool = False,
                    tools: Optional[list[dict]] = None) -> str:
        """The conversation as the prompt text the model was trained on; with
        continue_final_message, open at the end of the last message (an assistant's reply
        begun, usually), for the model to go on with it. `tools`: the functions the model
        may call, for templates that describe them."""
        if not messages:
            raise ValueError("messages is empty: give at least one message")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; use a plain prompt, or start with "
                             "--chat-template (LLM(chat_template=...))")
        if continue_final_message and add_generation_prompt:
            raise ParamError("continue_final_message goes on with the last message: it cannot also "
                             "add a generation prompt (set add_generation_prompt to false)",
                             "continue_final_message")
        reserved = sorted(set(chat_template_kwargs or ()) & _TEMPLATE_PARAMETERS)
        if reserved:
            raise ParamError(f"chat_template_kwargs cannot set {', '.join(reserved)}: those are the "
                             "renderer's own settings, not the template's variables", "chat_template_kwargs")
        from jinja2 import TemplateError

        messages = [_for_template(m) for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, **(chat_template_kwargs or {}))
        except TemplateError as exc:  # the template's own raise_exception(...), e.g. roles out of turn
            raise ValueError(f"the chat template refused these messages: {exc}") from None
        except TypeError as exc:  # a chat_template_kwargs value of a kind the template cannot use
            raise ValueError(f"the chat template failed on these messages and settings: {exc}") from None
        except RecursionError:
            raise ValueError("the messages or tools nest too deep for the chat template") from None

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    chat_template_kwargs: Optional[dict] = None, continue_final_message: bool = False,
                    tools: Optional[list[dict]] = None) -> list[int]:
        # The template already holds any BOS it wants: do not add special tokens twice.
        text = self.render_chat(messages, add_generation_prompt, chat_template_kwargs, continue_final_message,
                                tools)
        return self.tokenizer.encode(text, add_special_tokens=False)


def _for_template(message: Message) -> Message:
    """A message as chat templates read it: an assistant's tool calls with their arguments as
    objects where they are a JSON object's text (vLLM's way: templates write them with tojson)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    read = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        read.append(call)
    return {**message, "tool_calls": read}


# apply_chat_template's own parameters (tokenize, chat_template, ...) and what it gives the
# template itself (messages, raise_exception, strftime_now): not the client's to set
_TEMPLATE_PARAMETERS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self", "kwargs"} | {"messages", "raise_exception", "strftime_now"}
