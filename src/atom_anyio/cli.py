"""``atom-anyio``: serve, generate, logs."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from atom_anyio.obs import logs_cli

STARTUP_TIMEOUT_S = 3600  # hypercorn's limit on the lifespan's startup (its default is 60 s)


def _generate(args: argparse.Namespace) -> int:
    import os

    from atom_anyio import LLM, SamplingParams
    from atom_anyio.settings import ConfigError

    if args.model is not None and not os.path.exists(args.model):
        raise ConfigError(f"model: no such file or directory: {args.model}")
    try:
        llm = LLM(args.model, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as exc:  # a model it cannot serve: one line
        raise ConfigError(f"model {args.model or '(default)'}: {exc}") from None
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed, n=args.n
    )
    prompts = args.prompt
    if args.chat:
        results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        results = llm.generate(prompts, params)
    for r in results:
        for o in r.outputs:
            print(o.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from atom_anyio.config import Config, all_settings
    from atom_anyio.obs.logging import configure_logging
    from atom_anyio.settings import setting_name

    config = Config.from_env(**{setting_name(f): getattr(args, setting_name(f)) for _, f in all_settings()})
    configure_logging(config.log_format, config.log_level)
    from atom_anyio.api.app import AtomApp

    return asyncio.run(serve(AtomApp(config)))


async def serve(app) -> int:
    """Run hypercorn until SIGINT/SIGTERM (exit 0) or an engine crash (exit 1)."""
    import logging
    import signal

    import anyio
    import structlog
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config as HypercornConfig

    from atom_anyio.obs.logging import ACCESS_LOG_FORMAT, ACCESS_LOGGER

    log = structlog.get_logger("atom_anyio.cli")
    crashed = anyio.Event()
    app.on_engine_crash = crashed.set
    config = app.config
    hc = HypercornConfig()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.graceful_timeout = config.drain_timeout_s
    # the lifespan loads the weights (and builds the CPU kernels on first use): minutes for a large model,
    # past hypercorn's 60 s default
    hc.startup_timeout = STARTUP_TIMEOUT_S
    # no read_timeout: hypercorn applies it to every socket read, so it would cut off any generation
    # longer than it; the keep-alive timer covers idle and half-sent heads, BODY_TIMEOUT slow bodies
    hc.keep_alive_timeout = config.keep_alive_timeout_s
    hc.accesslog = logging.getLogger(ACCESS_LOGGER)  # loggers, not "-": through the root handler's JSON
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.access_log_format = ACCESS_LOG_FORMAT

    async def shutdown_trigger() -> None:
        async def on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info("server.signal", signal=signal.Signals(signum).name)
                    break
            if app.is_serving:
                await app.runtime.drain()  # 503 to new requests while the listener stays open
            tg.cancel_scope.cancel()

        async def on_crash() -> None:
            await crashed.wait()
            log.error("server.engine_crashed")
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(on_signal)
            tg.start_soon(on_crash)

    await hypercorn_serve(app, hc, shutdown_trigger=shutdown_trigger)
    code = 1 if crashed.is_set() else 0
    log.info("server.exit", code=code)
    return code


def build_parser(settings: bool = True) -> argparse.ArgumentParser:
    """The command line; ``settings=False`` leaves out ``serve``'s setting flags, whose defaults and
    choices come from the packages that load torch, transformers and xgrammar (seconds): ``main``
    adds them only when the command is ``serve``, so that ``logs`` answers at once."""
    ap = argparse.ArgumentParser(prog="atom-anyio", description="An anyio-native LLM inference server.")
    sub = ap.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline with the engine")
    gen.add_argument("--model", default=None, help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy, repeatable")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("-n", type=int, default=1)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser(
        "serve",
        help="serve the OpenAI and Anthropic APIs",
        description="Serve the OpenAI and Anthropic APIs. Each flag overrides its ATOM_* variable.",
    )
    if settings:
        add_setting_flags(srv)
    srv.set_defaults(func=_serve)

    logs_cli.add_parser(sub)
    return ap


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, with its help, default and variable (``config.all_settings``). A
    boolean flag alone means true (``--async-scheduling``), or takes a value (``--cuda-graphs false``)."""
    import typing

    from atom_anyio.config import all_settings
    from atom_anyio.settings import parser_of, setting_name

    for owner, f in all_settings():
        name = setting_name(f)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = "" if name == "api_key" else f"; default {default!r}"
        hint = typing.get_type_hints(owner)[f.name]
        is_bool = hint is bool or [a for a in typing.get_args(hint) if a is not type(None)] == [bool]
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            type=parser_of(owner, f),
            default=None,
            **({"nargs": "?", "const": True} if is_bool else {}),
            metavar=name.upper(),
            help=f"{f.metadata['help']} (ATOM_{name.upper()}{shown})",
        )


def main(argv: list[str] | None = None) -> int:
    from atom_anyio.settings import ConfigError

    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(settings=command == "serve")
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        parser.exit(2, f"atom-anyio {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
