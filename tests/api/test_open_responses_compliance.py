"""The Open Responses compliance suite against this server on real hypercorn.

It runs when ``OPEN_RESPONSES_DIR`` points at a checkout of github.com/openresponses/openresponses
with its dependencies installed (``npm install`` there; the suite runs under bun, from the
checkout's ``node_modules`` or the PATH), and is skipped, saying why, otherwise. Nothing of the
checkout is copied here: the suite is run as its own program and its JSON report read.

The server is the tiny model whose every answer is a short scripted text (``ScriptedSampler``,
at the model boundary): the suite checks shapes, statuses, streaming and WebSocket behaviour,
compaction and errors, not what a model says, and a scripted answer ends on time and on EOS.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import anyio
import pytest
from support_fakes import FakeSampler, scripted
from support_servers import served_over_http

from atom_anyio.api.app import AtomApp
from atom_anyio.config import Config

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

ANSWER = "Hello there."
# the suite's tests this server cannot pass, and why; every other test it reports must pass
EXPECTED_FAILURES = {
    "tool-calling": "the model must decide on its own to call the tool; a scripted answer is plain text",
    "image-input": "it sends an image; the models served here read text only (a 400 naming the part)",
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def suite() -> tuple[Path, str]:
    """The checkout and its bun."""
    root = os.environ.get("OPEN_RESPONSES_DIR")
    if not root:
        pytest.skip("OPEN_RESPONSES_DIR is not set: no Open Responses checkout to run its compliance suite from")
    checkout = Path(root)
    if not (checkout / "bin" / "compliance-test.ts").is_file():
        pytest.skip(f"OPEN_RESPONSES_DIR={root} has no bin/compliance-test.ts")
    local = checkout / "node_modules" / "bun" / "bin" / "bun.exe"
    bun = str(local) if local.is_file() else shutil.which("bun")
    if bun is None:
        pytest.skip(f"bun is not installed in {root}/node_modules or on the PATH (npm install bun zod there)")
    return checkout, bun


async def test_the_open_responses_compliance_suite_passes(suite, tiny_model):
    checkout, bun = suite
    atom = AtomApp(Config.of(max_model_len=2048, kv_cache_gib=0.05), loaded=tiny_model, sampler=FakeSampler())
    async with served_over_http(atom) as base_url:
        args = ["--base-url", f"{base_url}/v1", "--api-key", "unused", "--model", atom.runtime.model_name, "--json"]
        with scripted(atom, ANSWER):
            run = await anyio.run_process([bun, "run", "bin/compliance-test.ts", *args], cwd=checkout, check=False)
    report = json.loads(run.stdout)
    results = {result["id"]: result for result in report["results"]}
    assert len(results) >= 17, report["summary"]
    failed = {key: result.get("errors") for key, result in results.items() if result["status"] != "passed"}
    unexpected = {key: errors for key, errors in failed.items() if key not in EXPECTED_FAILURES}
    assert not unexpected, json.dumps(unexpected, indent=2)
