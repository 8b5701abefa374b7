"""``atom-anyio``: serve, generate, logs."""

from __future__ import annotations

import argparse
import json
import sys

from atom_anyio.obs import logs_cli


def _generate(args: argparse.Namespace) -> int:
    from atom_anyio import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
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


SERVE_FLAGS = {
    "model": str,
    "dtype": str,
    "device": str,
    "attention_backend": str,
    "served_model_name": str,
    "max_model_len": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "kv_cache_gib": float,
    "num_threads": int,
    "api_key": str,
    "host": str,
    "port": int,
    "chat_template": str,
    "default_chat_template_kwargs": json.loads,
    "context_overflow": str,
    "reasoning_parser": str,
    "tool_call_parser": str,
    "log_format": str,
    "log_level": str,
    "max_body_bytes": int,
    "drain_timeout_s": float,
    "grammar_compile_timeout_s": float,
    "max_waiting_seqs": int,
    "max_waiting_tokens": int,
    "retry_after_s": int,
    "max_pending_deltas": int,
    "cors_allow_origins": str,
    "body_timeout_s": float,
    "keep_alive_timeout_s": float,
    "malloc_arena_max": int,
}


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from atom_anyio.api.app import AtomApp
    from atom_anyio.config import Config
    from atom_anyio.obs.logging import configure_logging

    config = Config.from_env(**{name: getattr(args, name) for name in SERVE_FLAGS})
    configure_logging(config.log_format, config.log_level)
    return asyncio.run(serve(AtomApp(config)))


async def serve(app) -> int:
    """Run hypercorn until SIGINT/SIGTERM (exit 0) or an engine crash (exit 1)."""
    import logging
    import signal

    import anyio
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config as HypercornConfig

    from atom_anyio.obs.logging import ACCESS_LOG_FORMAT, ACCESS_LOGGER

    cfg = app.server.config
    hc = HypercornConfig()
    hc.bind = [f"{cfg.host}:{cfg.port}"]
    hc.graceful_timeout = cfg.drain_timeout_s
    # no read_timeout: hypercorn applies it to every socket read, so it would cut off any generation
    # longer than it; the keep-alive timer covers idle and half-sent heads, BODY_TIMEOUT slow bodies
    hc.keep_alive_timeout = cfg.keep_alive_timeout_s
    hc.accesslog = logging.getLogger(ACCESS_LOGGER)  # loggers, not "-": through the root handler's JSON
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.access_log_format = ACCESS_LOG_FORMAT
    crashed = False

    async def shutdown_trigger() -> None:
        async def on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    break
            await app.server.drain()  # 503 to new requests while the listener stays open
            tg.cancel_scope.cancel()

        async def on_crash() -> None:
            nonlocal crashed
            await app.server.stop_on_crash()
            crashed = True
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(on_signal)
            tg.start_soon(on_crash)

    await hypercorn_serve(app, hc, shutdown_trigger=shutdown_trigger)
    return 1 if crashed else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="atom-anyio", description="An anyio-native LLM inference server.")
    sub = ap.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline with the engine")
    gen.add_argument("--model", default=None, help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("-n", type=int, default=1)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI API (flags override ATOM_* variables)")
    for name, kind in SERVE_FLAGS.items():
        srv.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    srv.set_defaults(func=_serve)

    logs_cli.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
