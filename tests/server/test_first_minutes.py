"""A new user's first minutes: the model's own generation defaults, the
``atom-anyio`` commands run as real processes (stdout for results, stderr for
logs; ``logs summary`` on a known log), limits answered with one code."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from support_servers import clean_env, serving_app

from atom_anyio import LLM
from atom_anyio.config import Config
from atom_anyio.generation_defaults import from_generation_config, from_gguf_metadata
from atom_anyio.models.loader import LoadedModel, load_model
from atom_anyio.sampling_params import SamplingParams
from atom_anyio.settings import ConfigError

T0 = datetime(2026, 1, 1, tzinfo=UTC).timestamp()
README = Path(__file__).resolve().parents[2] / "README.md"
# what a model maker writes in generation_config.json (Qwen3-style), plus a cap on the output
GENERATION_CONFIG = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 5,
}
MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The installed ``atom-anyio`` command in a subprocess."""
    script = Path(sys.executable).with_name("atom-anyio")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "atom_anyio.cli"]
    return subprocess.run([*cmd, *args], env=env or clean_env(), capture_output=True, text=True, timeout=300)


# atom-anyio logs summary


def log_line(t: float, event: str = "request.finished", **fields: Any) -> str:
    timestamp = datetime.fromtimestamp(T0 + t, UTC).isoformat().replace("+00:00", "Z")
    return json.dumps({"event": event, "level": "info", "timestamp": timestamp, **fields})


def finished(t: float, outcome: str, status: int, **fields: Any) -> str:
    return log_line(t, endpoint="chat", outcome=outcome, status=status, **fields)


@pytest.fixture
def served_log(tmp_path) -> Path:
    """90 requests one second apart that stopped (10 tokens each), 32 refused, 3 cancelled before
    their first token and 2 failed ones (none of these generated anything), then the server ran
    idle until its shutdown line at 100 s."""
    lines = [finished(i, "ok", 200, finish_reason="stop", generated_tokens=10, ttft_s=0.1) for i in range(90)]
    lines += [finished(10, "refused", 503)] * 32
    lines += [finished(20, "cancelled", 499, finish_reason=None, generated_tokens=0)] * 3
    lines += [finished(30, "error", 500)] * 2
    lines.append(log_line(100, "server.stopped"))
    path = tmp_path / "served.log"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_logs_summary_names_requests_that_generated_nothing_by_their_outcome(served_log):
    run = cli("logs", "summary", str(served_log), "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["finish_reasons"] == {"stop": 90, "refused": 32, "cancelled": 3, "error": 2}
    text = cli("logs", "summary", str(served_log)).stdout
    assert "finish_reasons: stop 90  refused 32  cancelled 3  error 2" in text and "None" not in text


ENGINE_PACKAGES = ("torch", "transformers", "xgrammar")


@pytest.mark.parametrize(
    ("args", "env", "code", "unloaded"),
    [
        # logs builds none of serve's setting flags: not even the settings' modules
        (["logs", "summary", "LOG", "--json"], {}, 0, (*ENGINE_PACKAGES, "atom_anyio.config")),
        (["serve", "--help"], {}, 0, ENGINE_PACKAGES),
        (["serve"], {"max_num_seqs": "abc"}, 2, ENGINE_PACKAGES),
        (["serve", "--dtype", "float64"], {}, 2, ENGINE_PACKAGES),
    ],
    ids=["logs summary", "serve --help", "a bad variable", "a bad flag"],
)
def test_the_command_line_answers_without_the_engines_packages(served_log, args, env, code, unloaded):
    """The log analysis, serve's help and a bad setting answer at once (0.05-0.4 s, where importing
    torch, transformers and xgrammar took 2.8-3.7 s): those are for serving, and for the kernels'
    ISA check, the settings' last."""
    script = (
        "import sys\nfrom atom_anyio.cli import main\ntry:\n    code = main(sys.argv[2:])\n"
        "except SystemExit as exc:\n    code = exc.code\n"
        "print(code, sorted(m for m in sys.argv[1].split(',') if m in sys.modules))"
    )
    argv = [str(served_log) if arg == "LOG" else arg for arg in args]
    run = subprocess.run(
        [sys.executable, "-c", script, ",".join(unloaded), *argv],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    *output, last = run.stdout.splitlines()
    assert last == f"{code} []", run.stderr
    if args[0] == "logs":  # and it still answers: the summary of the served log
        assert json.loads("\n".join(output))["num_requests"] == 127


def test_logs_summary_rates_the_last_window_over_the_time_the_log_covers(served_log):
    s = json.loads(cli("logs", "summary", str(served_log), "--json", "--window", "60").stdout)
    first, last = s["windows"]
    assert (first["duration_s"], first["requests"]) == (60, 60 + 32 + 3 + 2)
    assert first["generated_tok_per_s"] == pytest.approx(600 / 60)
    # the last window runs from 60 s to the shutdown line at 100 s: 40 s, not a full minute
    assert (last["start_s"], last["duration_s"], last["requests"]) == (60, 40, 30)
    assert last["requests_per_s"] == pytest.approx(30 / 40) and last["generated_tok_per_s"] == pytest.approx(300 / 40)
    assert s["span_s"] == 100 and s["requests_per_s"] == pytest.approx(127 / 100)


def test_logs_summary_gives_no_rate_for_a_window_that_lasted_no_time(tmp_path):
    log = tmp_path / "instant.log"
    log.write_text("\n".join([finished(0, "ok", 200, finish_reason="length", generated_tokens=8)] * 3) + "\n")
    s = json.loads(cli("logs", "summary", str(log), "--json").stdout)
    assert s["windows"][0]["duration_s"] == 0 and s["windows"][0]["requests_per_s"] is None
    text = cli("logs", "summary", str(log)).stdout
    row = text.split("window (times from the first finished request)")[1].splitlines()[2]
    assert row.split() == ["0", "3", "0", "-", "-", "-", "-"]


# atom-anyio generate


@pytest.fixture(scope="module")
def short_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with a 1024-token context: the command sizes its KV pool by it."""
    path = tmp_path_factory.mktemp("short") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    return path


def test_generate_prints_only_the_completions_on_stdout(short_model_dir):
    env = clean_env(attention_backend="torch")
    args = ["--model", str(short_model_dir), "--dtype", "float32", "--prompt", "Hi", "--max-tokens", "6"]
    run = cli("generate", *args, env=env)
    assert run.returncode == 0, run.stderr
    llm = LLM(str(short_model_dir), dtype="float32", attention_backend="torch")
    text = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0].text
    assert text and run.stdout == text + "\n"
    assert "engine.kv_pool" in run.stderr  # the logs went to stderr


# the model's generation defaults


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # Quart runs on asyncio


@pytest.fixture(scope="module")
def opinionated_model(tiny_model_dir, tmp_path_factory) -> LoadedModel:
    """The tiny model, shipped with sampling defaults of its own."""
    path = tmp_path_factory.mktemp("opinionated") / "model"
    shutil.copytree(tiny_model_dir, path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return load_model(str(path))


@contextmanager
def sampling_seen(engine: Any) -> Iterator[list[SamplingParams]]:
    """The SamplingParams of every request submitted to the engine (what its sampler is given for
    the request's rows); the engine runs them as usual."""
    submit_many, seen = engine.submit_many, []

    def record(requests):
        seen.extend(r.params for r in requests)
        return submit_many(requests)

    engine.submit_many = record
    try:
        yield seen
    finally:
        del engine.submit_many


def sampling_of(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in MODEL_DEFAULTS}


def test_the_loader_reads_the_sampling_defaults_a_model_ships(opinionated_model, tiny_model, tmp_path):
    assert opinionated_model.generation_defaults == {**MODEL_DEFAULTS, "max_tokens": 5}
    assert tiny_model.generation_defaults == {}  # its generation_config.json has token ids only
    metadata = {"general.sampling.temp": 0.7, "general.sampling.top_k": 40, "general.sampling.penalty_repeat": 1.2}
    assert from_gguf_metadata(metadata) == {"temperature": 0.7, "top_k": 40, "repetition_penalty": 1.2}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json are not usable: invalid temperature: -1"):
        from_generation_config(tmp_path)


@pytest.mark.anyio
async def test_a_request_that_leaves_sampling_out_gets_the_model_s_defaults(opinionated_model):
    async with serving_app(opinionated_model, kv_cache_gib=0.05, max_model_len=1024, served_model_name="m") as atom:
        client = atom.quart.test_client()
        messages = [{"role": "user", "content": "Hi"}]
        with sampling_seen(atom.runtime.engine) as seen:
            chat = await (
                await client.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True})
            ).get_json()
            anthropic = await client.post("/v1/messages", json={"model": "m", "max_tokens": 3, "messages": messages})
            resp = await (await client.post("/v1/responses", json={"input": "Hi"})).get_json()
            completion = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert anthropic.status_code == completion.status_code == 200
        assert len(seen) >= 4 and all(sampling_of(p) == MODEL_DEFAULTS for p in seen)
        assert chat["usage"]["completion_tokens"] == 5  # max_new_tokens: the default max_tokens
        assert resp["temperature"] == 0.6 and resp["top_p"] == 0.95  # the Response echoes what ran
        assert resp["usage"]["output_tokens"] <= 5


@pytest.mark.anyio
async def test_a_request_s_own_sampling_values_win_over_the_model_s(opinionated_model):
    async with serving_app(opinionated_model, kv_cache_gib=0.05, max_model_len=1024, served_model_name="m") as atom:
        client = atom.quart.test_client()
        body = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        explicit = {"temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0, "repetition_penalty": 1, "max_tokens": 7}
        with sampling_seen(atom.runtime.engine) as seen:
            chat = await (await client.post("/v1/chat/completions", json={**body, **explicit})).get_json()
        assert chat["usage"]["completion_tokens"] == 7
        greedy = {"temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0, "repetition_penalty": 1}
        assert seen and all(sampling_of(p) == greedy for p in seen)
        with sampling_seen(atom.runtime.engine) as seen:
            r = await client.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": body["messages"],
                                                        "temperature": 0.1, "top_k": 3})  # fmt: skip
        assert r.status_code == 200
        assert sampling_of(seen[0]) == {**MODEL_DEFAULTS, "temperature": 0.1, "top_k": 3}


@pytest.mark.anyio
async def test_override_generation_config_goes_over_the_model_s_defaults_and_under_a_request_s(opinionated_model):
    """vLLM's --override-generation-config: its keys replace the model's (``max_new_tokens`` the default
    max_tokens too, as an agent CLI that sends none needs), the model's other defaults stay, and a
    request's own values still win."""
    override = {"temperature": 0.2, "max_new_tokens": 3}
    settings = {"kv_cache_gib": 0.05, "max_model_len": 1024, "served_model_name": "m"}
    async with serving_app(opinionated_model, override_generation_config=override, **settings) as atom:
        client = atom.quart.test_client()
        body = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        with sampling_seen(atom.runtime.engine) as seen:
            chat = await (await client.post("/v1/chat/completions", json=body)).get_json()
            resp = await (await client.post("/v1/responses", json={"input": "Hi"})).get_json()
            own = await (
                await client.post("/v1/chat/completions", json={**body, "temperature": 0.9, "max_tokens": 4})
            ).get_json()
    assert chat["usage"]["completion_tokens"] == 3 and resp["usage"]["output_tokens"] <= 3
    assert sampling_of(seen[0]) == {**MODEL_DEFAULTS, "temperature": 0.2} and resp["temperature"] == 0.2
    assert own["usage"]["completion_tokens"] == 4 and seen[-1].temperature == 0.9


@pytest.mark.parametrize(
    "value,named",
    [
        ('{"max_new_token": 3}', "unknown key(s) max_new_token"),
        ('{"temperature": -1}', "its values are not usable: invalid temperature: -1"),
    ],
)
def test_a_bad_override_generation_config_is_one_line_naming_it(value, named):
    with pytest.raises(ConfigError, match=re.escape(f"override_generation_config: {named}")):
        Config.from_env({"ATOM_OVERRIDE_GENERATION_CONFIG": value})


def test_offline_generate_without_sampling_params_uses_the_model_s_defaults(opinionated_model):
    llm = LLM(opinionated_model, max_model_len=1024, kv_cache_gib=0.05)
    with sampling_seen(llm.engine) as seen:
        out = llm.generate("Hi", use_tqdm=False)[0].outputs[0]
    assert sampling_of(seen[0]) == MODEL_DEFAULTS and len(out.token_ids) <= 5
    with sampling_seen(llm.engine) as seen:
        llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)  # given params are used as they are
    assert sampling_of(seen[0]) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }


@pytest.mark.anyio
async def test_the_readme_chat_example_answers_sensibly_on_the_default_model(smollm2):
    """The README's curl body, sent as written, to the default model (it ships no defaults of its own)."""
    body = json.loads(re.search(r"/v1/chat/completions .*?-d '(.*?)'", README.read_text(), re.S)[1])
    assert "temperature" not in body and smollm2.generation_defaults == {"temperature": 0.0}
    async with serving_app(smollm2, kv_cache_gib=0.05, max_model_len=1024) as atom:
        r = await atom.quart.test_client().post("/v1/chat/completions", json=body)
        answer = (await r.get_json())["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
