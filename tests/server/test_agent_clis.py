"""The real agent CLIs against the server (issue 40): Claude Code, Codex CLI, opencode and aider each
answer a prompt in a new session, then continue that session.

Claude Code, Codex and opencode run against a server in this process whose sampler's choice is
scripted (the reply, then EOS; ``support_fakes.scripted``). SmolLM2-135M never ends its reply to Claude Code's
prompt (greedy, it lists numbers or echoes the system prompt past 64, 256 and 512 tokens), and Claude
Code treats a reply cut at ``max_tokens`` three times in a row as an error. Codex's prompt holds its
working directory, so SmolLM2's greedy reply changes with the test's temporary path, and now and then
never ends; Codex sends no ``max_output_tokens`` and exits 1 on an incomplete response. opencode's
7.7k-token prompt took SmolLM2 30 s of prefill and replies a turn on two cores. With the replies
scripted the weights do not matter, so that server's model is a tiny random Llama with SmolLM2's
tokenizer and chat template over a 32k context (their own prompts are 12.4k, 9.3k and 7.7k tokens):
the rendering, the tokenizing, the prefill, the prefix cache, the API and real hypercorn stay real.
aider gets SmolLM2's own replies from a ``hypercorn atom_anyio:app`` process at the defaults.

Each turn exits 0 with the model's reply on stdout; every request the CLI sent is answered 2xx
(the server's ``request.finished`` lines); the continued session's prompt comes from the prefix
cache. The CLIs are installed once per machine (``agent_clis.CACHE``); without node/npm, or without
the registries, a CLI skips by name."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from agent_clis import MAX_OUTPUT_TOKENS, AgentCli, agent_cli, install
from structlog.testing import capture_logs
from support_fakes import scripted
from support_models import write_tiny_llama
from support_servers import Served, clean_env, free_port, running, served_over_http, serving_app

from atom_anyio.models.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow

TURN_TIMEOUT_S = 300  # a 12k-token prompt is 15 s of prefill on two idle cores, minutes on busy ones
IDLE_TIMEOUT_S = 30
CACHED_FRACTION = 0.8
# the CLIs whose replies are scripted, and the tokens of their own prompts (SmolLM2's tokenizer)
SCRIPTED = {"claude-code": 12_000, "codex": 9_000, "opencode": 7_000}
SCRIPTED_REPLY = "Hello! How can I help you today?"
# the CLIs served SmolLM2's own replies, at the defaults
SERVED = ["aider"]
# aider puts the restored history before its fixed "no files shared" exchange, so the second turn
# shares only the system prompt and the examples with the first (of 0.8k tokens)
SHARED_PREFIX_FRACTION = {"aider": 0.5}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> Iterator[Served]:
    """``hypercorn atom_anyio:app`` serving the default model (``smollm2_path``: skipped without it).
    A request that sets no limit gets the CLIs' (``override_generation_config``)."""
    port = free_port()
    cap = json.dumps({"max_new_tokens": MAX_OUTPUT_TOKENS})
    env = clean_env(log_format="json", kv_cache_gib="1", override_generation_config=cap)
    cmd = [sys.executable, "-m", "hypercorn", "atom_anyio:app", "--bind", f"127.0.0.1:{port}"]
    with running(cmd, env, port, tmp_path_factory.mktemp("agents") / "server.log") as served:
        yield served


@pytest.fixture(scope="module")
def smollm2_prompts_32k(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template over a 32k context: the
    scripted CLIs' replies do not come from the weights, their prompts are rendered and tokenized
    as SmolLM2's, and a 12k-token prefill takes a second instead of SmolLM2's fifteen."""
    return load_model(str(write_tiny_llama(tmp_path_factory.mktemp("smollm2-prompts"), tokenizer=smollm2.tokenizer)))


def finished_lines(log: str) -> list[dict[str, Any]]:
    """The ``request.finished`` lines of a JSON log."""
    lines = []
    for text in log.splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("event") == "request.finished":
            lines.append(line)
    return lines


def wait_idle(served: Served) -> None:
    """Until no generation request is in flight (its line is written as it stops counting)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
        if "\natom_requests_in_flight 0.0" in metrics:
            return
        time.sleep(0.1)  # poll interval
    pytest.fail(f"requests still in flight {IDLE_TIMEOUT_S} s after the CLI exited")


def take_turn(cli: AgentCli, argv: list[str], served: Served) -> list[dict[str, Any]]:
    """Run one turn; the server's lines for the generation requests it sent."""
    start = len(served.log())
    try:
        done = cli.run(argv, TURN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{cli.name} {argv[1:]}: {exc}\nserver lines: {finished_lines(served.log()[start:])}")
    wait_idle(served)
    lines = [line for line in finished_lines(served.log()[start:]) if line.get("endpoint") != "metrics"]
    return checked_turn(cli, argv, done, lines)


def checked_turn(
    cli: AgentCli, argv: list[str], done: subprocess.CompletedProcess, lines: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The turn exited 0 with a reply, and every request it sent was answered 2xx; its generations' lines."""
    shown = f"{cli.name} {argv[1:]} exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, f"{shown}\nserver lines: {lines}"
    assert done.stdout.strip(), shown
    refused = [line for line in lines if not 200 <= line["status"] < 300]
    assert not refused, f"{cli.name} {argv[1:]}: requests not answered 2xx: {refused}"
    generations = [line for line in lines if "prompt_tokens" in line]
    assert generations and all(line["generated_tokens"] > 0 for line in generations), f"{shown}\n{lines}"
    return generations


@pytest.mark.parametrize("name", SERVED)
def test_agent_cli_answers_then_continues_its_session_from_the_prefix_cache(
    name: str, server: Served, tmp_path: Path
) -> None:
    binary = install(name)
    (model_card,) = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    cli = agent_cli(name, binary, tmp_path, server.url, model_card["id"], model_card["max_model_len"])
    take_turn(cli, cli.first, server)
    generations = take_turn(cli, cli.second, server)
    main = max(generations, key=lambda line: line["prompt_tokens"])
    fraction = CACHED_FRACTION * SHARED_PREFIX_FRACTION.get(name, 1.0)
    assert main["cached_tokens"] >= fraction * main["prompt_tokens"], main


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # Quart


@pytest.mark.anyio
@pytest.mark.parametrize("name", SCRIPTED)
async def test_scripted_agent_cli_answers_then_continues_its_session_from_the_prefix_cache(
    name: str, smollm2_prompts_32k: LoadedModel, tmp_path: Path
) -> None:
    binary = install(name)
    async with (
        serving_app(smollm2_prompts_32k, max_model_len=32768, kv_cache_gib=1) as atom,
        served_over_http(atom) as url,
    ):
        cli = agent_cli(name, binary, tmp_path, url, atom.runtime.model_name, 32768)

        async def turn(argv: list[str]) -> list[dict[str, Any]]:
            with capture_logs() as logs, anyio.fail_after(TURN_TIMEOUT_S):
                done = await anyio.run_process(argv, env=cli.env, cwd=cli.cwd, stdin=subprocess.DEVNULL, check=False)
                await atom.runtime.tracker.wait_idle(IDLE_TIMEOUT_S)
            lines = [line for line in logs if line.get("event") == "request.finished"]
            text = subprocess.CompletedProcess(argv, done.returncode, done.stdout.decode(), done.stderr.decode())
            return checked_turn(cli, argv, text, lines)

        with scripted(atom, SCRIPTED_REPLY):
            await turn(cli.first)
            generations = await turn(cli.second)
    # the agent's own request (opencode's first turn also asks for a title): the longest prompt
    main = max(generations, key=lambda line: line["prompt_tokens"])
    assert main["prompt_tokens"] > SCRIPTED[name]  # the CLI's own prompt, on the stretched context
    assert main["cached_tokens"] >= CACHED_FRACTION * main["prompt_tokens"], main
