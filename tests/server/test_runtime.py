"""The server a new user meets: settings (flags, variables, one-line errors), the start-up and
shutdown log, the served model id, the KV pool's size, and the typed engine contract."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs
from support_servers import clean_env, free_port, running, serving_app

from atom_anyio.api.runtime import model_id
from atom_anyio.cli import build_parser
from atom_anyio.config import Config, all_settings
from atom_anyio.engine.core import Engine
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.request import EngineRequest
from atom_anyio.sampling_params import SamplingParams
from atom_anyio.settings import ConfigError, setting_name

SRC = Path(__file__).resolve().parents[2] / "src" / "atom_anyio"


def atom_anyio(*args: str, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "atom_anyio.cli", *args]
    return subprocess.run(cmd, env=clean_env(**env), capture_output=True, text=True, timeout=120)


# settings


def test_serve_help_gives_every_setting_a_line_with_its_variable_and_default():
    out = atom_anyio("serve", "--help").stdout
    flat = " ".join(out.split())
    for _, f in all_settings():
        name = setting_name(f)
        assert f"--{name.replace('_', '-')}" in out
        assert f"ATOM_{name.upper()}" in flat, name
    assert "ATOM_MAX_NUM_SEQS; default 64" in flat and "ATOM_BLOCK_SIZE; default 16" in flat


@pytest.mark.parametrize(
    ("name", "raw", "value"),
    [
        ("block_size", "32", 32),
        ("segment_cache_tokens", "5", 5),
        ("prepare_threads", "3", 3),
        ("responses_store_max_items", "9", 9),
        ("responses_store_ttl_s", "1.5", 1.5),
        ("enable_prefix_caching", "false", False),
    ],
)
def test_a_setting_is_the_same_as_a_variable_and_as_a_flag(name, raw, value):
    def read(config: Config):
        return getattr(config, name) if hasattr(config, name) else getattr(config.engine, name)

    args = build_parser().parse_args(["serve", f"--{name.replace('_', '-')}", raw])
    assert read(Config.from_env({f"ATOM_{name.upper()}": raw})) == value
    assert read(Config.from_env({}, **{name: getattr(args, name)})) == value
    other = {"block_size": "8"}.get(name, raw)
    assert read(Config.from_env({f"ATOM_{name.upper()}": other}, **{name: getattr(args, name)})) == value  # flag wins


def test_an_atom_variable_that_names_no_setting_gets_one_warning_naming_the_nearest():
    env = {"ATOM_MAX_NUM_SEQ": "4", "ATOM_GGUF_WEIGHTS": "packed", "ATOM_CACHE_DIR": "/tmp/x", "ATOMIC": "1"}
    with capture_logs() as logs:
        config = Config.from_env(env)
    assert config.gguf_weights == "packed" and config.engine.max_num_seqs == EngineConfig().max_num_seqs
    warnings = [e for e in logs if e["event"] == "config.unknown_variable"]
    assert warnings == [
        {
            "event": "config.unknown_variable",
            "variable": "ATOM_MAX_NUM_SEQ",
            "nearest": "ATOM_MAX_NUM_SEQS",
            "log_level": "warning",
        }
    ]


@pytest.mark.parametrize(
    ("env", "args", "named"),
    [
        ({"max_num_seqs": "abc"}, [], "ATOM_MAX_NUM_SEQS=abc: not an integer"),
        ({}, ["--tool-call-parser", "nope"], "tool_call_parser"),
        ({}, ["--model", "/no/such/model"], "model: no such file or directory: /no/such/model"),
        ({"dtype": "float64"}, [], "dtype='float64' is not one of"),
        ({"kernel_isa": "avx9"}, [], "ATOM_KERNEL_ISA=avx9: one of native, avx2, avx512, avx512_bf16"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it_and_a_non_zero_exit(env, args, named):
    result = atom_anyio("serve", *args, **env)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and named in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_model_it_cannot_serve_is_one_line_and_a_non_zero_exit(tiny_model_dir, tmp_path, command):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    args = ["--prompt", "hi"] if command == "generate" else [f"--port={free_port()}"]
    result = atom_anyio(command, "--model", str(tmp_path / "m"), *args, log_format="json")
    errors = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(errors) == 1 and "unsupported architecture 'FooForCausalLM'" in errors[0]


def test_a_bad_variable_under_bare_hypercorn_is_one_line_too():
    port = str(free_port())
    cmd = [sys.executable, "-m", "hypercorn", "atom_anyio:app", "-b", f"127.0.0.1:{port}"]
    result = subprocess.run(cmd, env=clean_env(max_num_seqs="abc"), capture_output=True, text=True, timeout=120)
    assert "ATOM_MAX_NUM_SEQS=abc: not an integer" in result.stderr and "Traceback" not in result.stderr


def test_config_refuses_an_unknown_setting_by_name():
    with pytest.raises(ConfigError, match="unknown setting.*max_num_seq\\b"):
        Config.of(max_num_seq=4)


# start-up, shutdown, model id


def test_serve_logs_each_start_up_phase_with_its_duration_and_the_shutdown(tiny_model_dir, tmp_path):
    port = free_port()
    env = clean_env(model=str(tiny_model_dir), max_model_len="512", max_num_seqs="4", log_format="json")
    cmd = [sys.executable, "-m", "atom_anyio.cli", "serve", f"--port={port}"]
    with running(cmd, env, port, tmp_path / "server.log") as served:
        pass  # SIGTERM, exit 0
    lines = [json.loads(line) for line in served.log().splitlines() if line.startswith("{")]
    events = {line["event"]: line for line in lines}
    for phase in ("model.loaded", "engine.built", "prompt.ready", "grammars.ready", "engine.warmed_up"):
        assert events[phase]["duration_s"] >= 0, phase
    assert events["engine.kv_pool"]["num_tokens"] == 4 * 512  # max_num_seqs x max_model_len, under the 2 GiB budget
    assert events["server.ready"]["startup_s"] > 0
    order = [line["event"] for line in lines]
    shutdown = ["server.signal", "server.draining", "server.drained", "server.exit"]
    assert [e for e in order if e in shutdown] == shutdown
    assert events["server.signal"]["signal"] == "SIGTERM" and events["server.exit"]["code"] == 0


def test_the_default_model_id_drops_the_gguf_quantization_suffix():
    assert model_id("SmolLM2-135M-Instruct.Q4_1") == "SmolLM2-135M-Instruct"
    assert model_id("Qwen3-8B-Q4_K_M") == "Qwen3-8B"
    assert model_id("tiny-llama") == "tiny-llama"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_unknown_model_is_a_404_naming_the_served_one(tiny_model):
    async with serving_app(tiny_model, kv_cache_gib=0.05) as atom:
        r = await atom.quart.test_client().post(
            "/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
        )
        error = (await r.get_json())["error"]
    assert r.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    assert f"serves `{atom.runtime.model_name}`" in error["message"]


# the engine contract


def test_the_kv_pool_is_sized_to_what_the_sequences_can_use(tiny_model):
    small = Engine(tiny_model, EngineConfig(max_model_len=256, max_num_seqs=2, block_size=16))
    assert small.block_manager.num_blocks == 2 * 256 // 16
    budgeted = Engine(tiny_model, EngineConfig(max_model_len=65536, max_num_seqs=64, kv_cache_gib=0.01))
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, float32
    assert budgeted.max_kv_tokens == int(0.01 * 2**30) // (per_token * 16) * 16


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_engine_honours_the_max_tokens_its_request_resolved(tiny_model):
    engine = Engine(tiny_model, EngineConfig(kv_cache_gib=0.05))
    ids = tiny_model.tokenizer("count")["input_ids"]
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0)  # "the rest": resolved upstream
    request = EngineRequest(ids, EngineRequest.of_tokens(ids, params, engine).block_hashes, params, max_tokens=3)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        async with engine.submit(request) as stream:
            deltas = [d async for d in stream]
        tg.cancel_scope.cancel()
    assert sum(len(d.token_ids) for d in deltas) == 3 and deltas[-1].finish_reason == "length"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_sampling_token_id_outside_the_vocabulary_is_a_400_naming_the_field(tiny_model):
    async with serving_app(tiny_model, kv_cache_gib=0.05) as atom:
        client = atom.quart.test_client()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop_token_ids": [10**6]}
        r = await client.post("/v1/chat/completions", json=body)
        error = (await r.get_json())["error"]
    vocabulary = f"[0, {tiny_model.config.vocab_size})"
    assert r.status_code == 400 and error["param"] == "stop_token_ids" and vocabulary in error["message"]


# structure


def module_imports(tree: ast.Module) -> set[str]:
    """The package modules a module imports at its top level (``if TYPE_CHECKING:`` blocks
    included; an import inside a function is a deliberate lazy one, e.g. of an optional backend)."""
    found: set[str] = set()
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If | ast.Try):
            nodes += [*node.body, *node.orelse, *getattr(node, "handlers", []), *getattr(node, "finalbody", [])]
        elif isinstance(node, ast.ExceptHandler):
            nodes += node.body
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("atom_anyio"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("atom_anyio"))
    return found


def test_no_import_cycle_in_the_package():
    """Module-level imports, TYPE_CHECKING ones included, form no cycle."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        if path.name == "__init__.py":
            continue  # package re-exports are lazy (__getattr__) or leaf imports
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        graph[module] = module_imports(ast.parse(path.read_text()))
    cycles = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        if node in stack:
            cycles.append(stack[stack.index(node) :] + [node])
            return
        if node in done:
            return
        for dep in graph.get(node, ()):
            visit(dep, [*stack, node], done)
        done.add(node)

    done: set[str] = set()
    for module in graph:
        visit(module, [], done)
    assert not cycles, cycles
