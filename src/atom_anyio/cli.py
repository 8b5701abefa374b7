"""``atom-anyio``: serve, generate."""

from __future__ import annotations

import argparse
import sys


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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="atom-anyio", description="An anyio-native LLM inference server.")
    sub = ap.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts offline with the engine")
    gen.add_argument("--model", default=None, help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("-n", type=int, default=1)
    gen.set_defaults(func=_generate)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
