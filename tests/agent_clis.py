"""The real agent CLIs (Claude Code, Codex CLI, opencode, aider): installed once per machine into a
cache directory, and set up to talk to one local server only, in an isolated home, with their
telemetry, update checks and model-list downloads off. ``agent_cli(name, ...)`` gives the command
lines of a one-shot turn and of the turn that continues that session."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "atom_anyio" / "agent-clis"
INSTALL_TIMEOUT_S = 900
API_KEY = "agent-cli-key"
NPM_REGISTRY = "https://registry.npmjs.org/"
PYPI = os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple/"
# name: (npm package, version, command)
NPM_CLIS = {
    "claude-code": ("@anthropic-ai/claude-code", "2.1.332", "claude"),
    "codex": ("@openai/codex", "0.171.0", "codex"),
    "opencode": ("opencode-ai", "1.18.33", "opencode"),
}
AIDER = ("aider-chat", "0.86.2")
AIDER_PYTHONS = ((3, 10), (3, 11), (3, 12))  # aider-chat 0.86.2: Requires-Python >=3.10,<3.13


@dataclass(frozen=True)
class AgentCli:
    """One CLI set up against one server: ``first`` answers a prompt in a new session, ``second``
    continues that session; both run in ``cwd`` with ``env`` (its own home, config and key)."""

    name: str
    first: list[str]
    second: list[str]
    env: dict[str, str]
    cwd: Path

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )


def install(name: str) -> Path:
    """The CLI's executable, installed into ``CACHE`` on first use (pinned versions). Skips where
    node/npm (or a Python aider supports) is missing or the registry cannot be reached."""
    if name == "aider":
        return install_aider()
    package, version, command = NPM_CLIS[name]
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip(f"{name}: node and npm are not installed")
    root = CACHE / f"{name}-{version}"
    npm = ["npm", "install", "--prefix", str(root), "--no-audit", "--no-fund", f"{package}@{version}"]
    installed(root, name, [npm], NPM_REGISTRY)
    return root / "node_modules" / ".bin" / command


def install_aider() -> Path:
    package, version = AIDER
    python = next((p for v in AIDER_PYTHONS if (p := shutil.which(f"python{v[0]}.{v[1]}"))), None)
    if sys.version_info[:2] in AIDER_PYTHONS:
        python = sys.executable
    if python is None:
        pytest.skip(f"aider: {package} {version} needs Python 3.10-3.12, and none is on PATH")
    root = CACHE / f"aider-{version}"
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", f"{package}=={version}"]
    installed(root, "aider", [[python, "-m", "venv", str(root)], pip], PYPI)
    return root / "bin" / "aider"


def installed(root: Path, name: str, commands: list[list[str]], registry: str) -> None:
    """Run ``commands`` into ``root`` unless a finished install is there (its marker written last,
    so an interrupted one starts over)."""
    marker = root / ".installed"
    if marker.exists():
        return
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    for cmd in commands:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        if done.returncode != 0:
            shutil.rmtree(root, ignore_errors=True)
            if reason := unreachable(registry):
                pytest.skip(f"{name}: cannot install, {registry} is unreachable ({reason})")
            pytest.fail(f"{name}: {' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    marker.write_text(" ".join(commands[-1]))


def unreachable(url: str) -> str | None:
    try:
        httpx.head(url, timeout=10, follow_redirects=True)
    except httpx.TransportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def agent_cli(name: str, binary: Path, home: Path, base_url: str, model: str, max_model_len: int) -> AgentCli:
    """``name`` set up in ``home`` (a fresh directory) against the server at ``base_url``."""
    cwd = home / "work"
    cwd.mkdir(parents=True)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "TERM": "dumb",
        "NO_COLOR": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    setup = {"claude-code": claude_code, "codex": codex, "opencode": opencode, "aider": aider}[name]
    first, second, extra_env = setup(str(binary), home, base_url, model, max_model_len)
    return AgentCli(name, first, second, {**env, **extra_env}, cwd)


FIRST_PROMPT = "Say hello."
SECOND_PROMPT = "Now say goodbye."
# each reply's max_tokens, to keep a turn short on two cores (Claude Code asks three times more for a
# reply cut at max_tokens, then exits 1: the model has to end its reply within it)
MAX_OUTPUT_TOKENS = 64


def claude_code(binary: str, home: Path, base_url: str, model: str, max_model_len: int):
    env = {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": API_KEY,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS),
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(max_model_len),  # else it assumes 1M for a model it does not know
    }
    return [binary, "-p", FIRST_PROMPT, "--model", model], [binary, "-c", "-p", SECOND_PROMPT, "--model", model], env


def codex(binary: str, home: Path, base_url: str, model: str, max_model_len: int):
    codex_home = home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        f"""model = "{model}"
model_provider = "local"
model_context_window = {max_model_len}
check_for_update_on_startup = false

[model_providers.local]
name = "atom_anyio"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "LOCAL_API_KEY"

[analytics]
enabled = false
"""
    )
    exec_ = [binary, "exec", "--skip-git-repo-check"]
    env = {"CODEX_HOME": str(codex_home), "LOCAL_API_KEY": API_KEY}
    return [*exec_, FIRST_PROMPT], [*exec_, "resume", "--last", SECOND_PROMPT], env


def opencode(binary: str, home: Path, base_url: str, model: str, max_model_len: int):
    config = home / ".config" / "opencode"
    config.mkdir(parents=True)
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "atom_anyio",
        "options": {"baseURL": f"{base_url}/v1", "apiKey": API_KEY},
        "models": {model: {"name": model, "limit": {"context": max_model_len, "output": MAX_OUTPUT_TOKENS}}},
    }
    settings = {"autoupdate": False, "share": "disabled", "provider": {"local": provider}}
    (config / "opencode.json").write_text(json.dumps(settings, indent=2))
    env = {
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",  # models.dev
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        "OPENCODE_DISABLE_CLAUDE_CODE": "1",  # reading ~/.claude
    }
    run = [binary, "run", "-m", f"local/{model}"]
    return [*run, FIRST_PROMPT], [*run, "--continue", SECOND_PROMPT], env


def aider(binary: str, home: Path, base_url: str, model: str, max_model_len: int):
    # a fresh (empty) price list: aider downloads litellm's from GitHub when its copy is missing or a day old
    caches = home / ".aider" / "caches"
    caches.mkdir(parents=True)
    (caches / "model_prices_and_context_window.json").write_text("{}")
    # aider sends no max_tokens of its own
    settings = home / "model_settings.yml"  # YAML, written as JSON
    settings.write_text(json.dumps([{"name": f"openai/{model}", "extra_params": {"max_tokens": MAX_OUTPUT_TOKENS}}]))
    history = home / "work" / ".aider.chat.history.md"
    args = [
        binary,
        *("--model", f"openai/{model}", "--openai-api-base", f"{base_url}/v1", "--openai-api-key", API_KEY),
        *("--model-settings-file", str(settings), "--chat-history-file", str(history)),
        *("--no-git", "--yes", "--map-tokens", "0", "--no-pretty", "--no-fancy-input"),
        *("--analytics-disable", "--no-check-update", "--no-show-release-notes", "--no-show-model-warnings"),
    ]
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    return [*args, "--message", FIRST_PROMPT], [*args, "--restore-chat-history", "--message", SECOND_PROMPT], env
