"""The command line: `python -m streamserve` / `streamserve`.

Engine flags are generated from the Config dataclasses (one flag per field, the
field's help text and default), so a flag and its setting cannot drift apart.
Without --prompt the command serves the OpenAI-compatible API over HTTP; with
--prompt it runs that one prompt through the engine and prints the completion.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import typing
from typing import Any, Optional

from streamserve.config import Config, ServerConfig


def _scalar_type(hint: Any) -> tuple[type, bool]:
    """int / float / str / bool out of a hint such as Optional[int], and whether it is a list of them."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    lists = [a for a in args if typing.get_origin(a) is list]
    if lists:  # list[str], or str | list[str]: one or more values
        return typing.get_args(lists[0])[0], True
    return (args[0] if args else hint), False


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Config field, grouped by part."""
    for part, fields in Config.part_fields().items():
        group = parser.add_argument_group(f"{part} settings")
        hints = typing.get_type_hints(Config.part_classes()[part])
        for f in fields:
            flag = "--" + f.name.replace("_", "-")
            kind, many = _scalar_type(hints[f.name])
            help_text = f.metadata.get("help", "")
            if kind is bool:
                if f.default:
                    group.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name,
                                       action="store_false", help=f"turn off: {help_text}")
                else:
                    group.add_argument(flag, dest=f.name, action="store_true", help=help_text)
                group.set_defaults(**{f.name: f.default})
            else:
                if "default:" not in help_text:
                    help_text += " (default: %(default)s)"
                short = [f.metadata["short"]] if "short" in f.metadata else []  # (vLLM's -q)
                group.add_argument(flag, *short, dest=f.name, type=_json_object if kind is dict else kind,
                                   default=f.default, help=help_text, nargs="+" if many else None)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The Config keyword arguments from parsed flags."""
    names = [f.name for fields in Config.part_fields().values() for f in fields]
    return {name: getattr(args, name) for name in names}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamserve",
        description="streamserve: an LLM inference server in one Python process. Serves the "
                    "OpenAI-compatible API on --host:--port; with --prompt, completes that "
                    "one prompt and prints it instead.")
    run = parser.add_argument_group("one-shot generation (instead of serving)")
    run.add_argument("--prompt", default=None, help="the text to complete")
    run.add_argument("--chat", action="store_true", help="send --prompt as a user message through "
                     "the model's chat template")
    run.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    run.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0 is greedy (default: %(default)s)")
    add_config_flags(parser)
    return parser


def serve(args: argparse.Namespace) -> int:
    """Listen at once; load (and on first use fetch and convert) the model behind it."""
    import asyncio
    import logging

    from streamserve.models.resolve import DEFAULT_MODEL
    from streamserve.lora.request import parse_module

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = config_kwargs(args)
    server_names = {f.name for f in Config.part_fields()["server"]}
    try:
        server = ServerConfig(**{k: v for k, v in kwargs.items() if k in server_names})
    except (ValueError, TypeError) as exc:
        print(f"streamserve: error: {exc}", file=sys.stderr)
        return 2
    model_names = server.served_model_name or [args.model or DEFAULT_MODEL]
    model_name = model_names[0]
    try:  # the adapters' names, before anything loads
        for spec in kwargs["lora_modules"] or []:
            if parse_module(spec)[0] in model_names:
                raise ValueError(f"lora_modules entry {spec!r} takes the served model's name: give the adapter another")
    except ValueError as exc:
        print(f"streamserve: error: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    try:
        rc, loading = asyncio.run(_serve(server, model_name, lambda: Config.from_kwargs(**kwargs)))
    except KeyboardInterrupt:  # a SIGINT that asyncio's own handler took (early in the start)
        rc, loading = 0, True
    if loading:  # stopped while the engine thread may load (in native code): the interpreter's
        # teardown would abort on that thread ("terminate called without an active exception")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


async def _serve(server: ServerConfig, model_name: str, make_config) -> tuple[int, bool]:
    """(exit status, whether the engine was still loading)."""
    import asyncio
    import logging
    import socket

    from aiohttp import web

    from streamserve.frontend.async_engine import AsyncEngine
    from streamserve.server.app import app_runner, drain

    log = logging.getLogger("streamserve")
    try:  # the port first: a busy one is reported at once, not after the model has loaded
        family = socket.AF_INET6 if ":" in server.host else socket.AF_INET
        sock = socket.create_server((server.host, server.port), family=family)
    except OSError as exc:
        print(f"streamserve: error: cannot listen on {server.host}:{server.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2, False
    engine = AsyncEngine(make_config, freeze_heap=True)  # this process serves it to the end
    runner = app_runner(engine, server, model_name)
    signals = _Signals(log)  # before the setup, which starts the loading thread
    await runner.setup()
    ready = asyncio.ensure_future(engine.wait_ready())
    stopped = asyncio.ensure_future(signals.stop.wait())
    try:
        site = web.SockSite(runner, sock)
        await site.start()
        log.info("listening on http://%s:%d (GET /health says when the model is ready)",
                 server.host, sock.getsockname()[1])
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            log.info("stopped while loading the model")
            return 0, True
        if ready.exception() is not None:
            exc = ready.exception()
            print(f"streamserve: error: {exc.__cause__ or exc}", file=sys.stderr)
            return 2, False
        await stopped  # serve until SIGTERM or SIGINT
        await site.stop()  # no new connections
        left = await drain(runner.app, server.shutdown_timeout, signals.cut)
        if left:
            log.warning("cutting off the %d requests still running", engine.abort_all("the server is shutting down"))
        return 0, False
    finally:
        ready.cancel()
        stopped.cancel()
        await runner.cleanup()


class _Signals:
    """SIGTERM and SIGINT: the first sets `stop` (the server then drains: no new connections or
    requests, the requests in flight finish), a second sets `cut` (they are cut off). A SIGINT
    that was ignored (a background job's) stays ignored."""

    def __init__(self, log) -> None:
        import asyncio
        import signal

        self.log, self.stop, self.cut = log, asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                loop.add_signal_handler(sig, self.on_signal, sig)

    def on_signal(self, sig) -> None:
        if self.stop.is_set():
            self.log.warning("%s again: cutting off the requests in flight", sig.name)
            self.cut.set()
            return
        self.log.info("%s: taking no new connections or requests; finishing the requests in flight "
                      "(up to --shutdown-timeout seconds; send it again to stop now)", sig.name)
        self.stop.set()


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prompt is None:
        return serve(args)
    gc.enable()  # __main__ turned it off for a server's start-up (heap.py); LLM pauses it for its load
    from streamserve import LLM, SamplingParams

    try:
        llm = LLM(**config_kwargs(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        if args.chat:
            outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except (ValueError, TypeError) as exc:
        print(f"streamserve: error: {exc}", file=sys.stderr)
        return 2
    print(outputs[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
