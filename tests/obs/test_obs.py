"""Observability: /metrics scraped after real requests, the event-loop lag
monitor, the GC timer, JSON logs from a real hypercorn server, and
``atom-anyio logs`` on logs with known values."""

from __future__ import annotations

import ctypes
import gc
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support_servers import free_port, serving_app, wait_healthy, wait_until

from atom_anyio import LLM
from atom_anyio.api.app import AtomApp
from atom_anyio.cli import main as cli_main
from atom_anyio.cli import serve
from atom_anyio.config import Config
from atom_anyio.engine.stats import Buckets
from atom_anyio.obs.logging import configure_logging
from atom_anyio.obs.logs_cli import summarize
from atom_anyio.obs.metrics import Metrics

pytestmark = pytest.mark.anyio

HISTOGRAMS = {
    "atom_time_to_first_token_seconds": set(),
    "atom_inter_token_latency_seconds": set(),
    "atom_e2e_request_latency_seconds": set(),
    "atom_request_queue_time_seconds": set(),
    "atom_prepare_prompt_seconds": set(),
    "atom_request_prompt_tokens": set(),
    "atom_request_generation_tokens": set(),
    "atom_event_loop_lag_seconds": set(),
    "atom_gc_pause_seconds": {"generation"},
    "atom_engine_step_seconds": set(),
}
COUNTERS = {
    "atom_requests_total": {"endpoint", "outcome"},
    "atom_prompt_tokens_total": set(),
    "atom_generation_tokens_total": set(),
    "atom_prefix_cache_hit_tokens_total": set(),
    "atom_segment_cache_hit_tokens_total": set(),
    "atom_preemptions_total": set(),
}
GAUGES = {
    "atom_requests_running": set(),
    "atom_requests_waiting": set(),
    "atom_kv_cache_usage_ratio": set(),
    "atom_kv_cache_blocks_free": set(),
}
PER_REQUEST = "atom_request_context_tokens"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # Quart runs on asyncio only


def serving(tiny_model):
    return serving_app(tiny_model, max_model_len=2048, kv_cache_gib=0.05)


@pytest.fixture
async def atom(tiny_model):
    async with serving(tiny_model) as app:
        yield app


def chat(max_tokens: int = 4, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Tell me about rivers."}], "max_tokens": max_tokens, **fields}


async def scrape(client) -> str:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return (await r.get_data()).decode()


def samples(text: str) -> dict[str, list]:
    """Family name -> its samples, from the exposition text."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def value(text: str, name: str, **labels: str) -> float:
    """The one sample called ``name`` with exactly ``labels`` (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


# /metrics


async def test_metrics_have_the_documented_names_types_and_label_sets(atom):
    client = atom.quart.test_client()
    r1 = await (await client.post("/v1/chat/completions", json=chat(ignore_eos=True))).get_json()
    await client.post("/v1/chat/completions", json=chat(stream=True, ignore_eos=True))
    completion = {"prompt": "x", "max_tokens": 3, "ignore_eos": True}
    r3 = await (await client.post("/v1/completions", json=completion)).get_json()
    gc.collect()
    text = await scrape(client)
    types, by_family = families(text), samples(text)
    for expected, kind in ((HISTOGRAMS, "histogram"), (COUNTERS, "counter"), (GAUGES, "gauge")):
        for name, labels in expected.items():
            family = name.removesuffix("_total")
            assert types.get(family) == kind, (name, types.get(family))
            assert by_family[family], f"{name} has no samples"
            for s in by_family[family]:
                assert set(s.labels) - {"le"} == labels, (s.name, s.labels)
                if kind == "counter":
                    assert s.name == name
    assert all(name.startswith(("atom_", "vllm:")) for name in types)
    assert value(text, "atom_requests_total", endpoint="chat", outcome="ok") == 2
    assert value(text, "atom_requests_total", endpoint="completions", outcome="ok") == 1
    assert value(text, "atom_generation_tokens_total") == 4 + 4 + 3
    assert value(text, "atom_prompt_tokens_total") == 2 * r1["usage"]["prompt_tokens"] + r3["usage"]["prompt_tokens"]
    assert value(text, "atom_e2e_request_latency_seconds_count") == 3
    assert value(text, "atom_request_generation_tokens_bucket", le="1.0") == 0
    assert value(text, "atom_request_generation_tokens_bucket", le="8.0") == 3
    assert value(text, "atom_requests_running") == 0
    # one step at least per token of the one-at-a-time requests, each timed
    assert value(text, "atom_engine_step_seconds_count") >= 4 and value(text, "atom_engine_step_seconds_sum") > 0


def test_step_buckets_count_as_prometheus_le_buckets_at_a_fixed_size():
    steps = Buckets((0.01, 0.1))
    for seconds in (0.01, 0.05, 0.1, 0.2, 3.0):
        steps.observe(seconds)
    snapshot = steps.snapshot()
    assert snapshot.cumulative() == [("0.01", 1), ("0.1", 3), ("+Inf", 5)] and snapshot.sum == pytest.approx(3.36)
    assert len(steps.counts) == 3


VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]
VLLM_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]


def buckets(text: str, name: str) -> list[float]:
    return [float(s.labels["le"]) for s in samples(text)[name] if s.name == f"{name}_bucket"]


async def test_vllm_metrics_count_the_served_requests_under_vllms_names_and_labels(atom):
    client = atom.quart.test_client()
    labels = {"model_name": atom.runtime.model_name, "engine": "0"}

    def v(text: str, name: str, **extra: str) -> float:
        return value(text, name, **labels, **extra)

    before = await scrape(client)
    body = chat(6, ignore_eos=True, messages=[{"role": "user", "content": "Tell me about rivers. " * 20}])
    first = await (await client.post("/v1/chat/completions", json=body)).get_json()
    second = await (await client.post("/v1/chat/completions", json=body)).get_json()
    after = await scrape(client)
    usage = second["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16  # the resent prompt hit the prefix cache

    def increase(name: str) -> float:
        return v(after, name) - v(before, name)

    assert increase("vllm:prefix_cache_queries_total") == first["usage"]["prompt_tokens"] + usage["prompt_tokens"]
    assert increase("vllm:prefix_cache_hits_total") == usage["prompt_tokens_details"]["cached_tokens"]
    assert increase("vllm:generation_tokens_total") == 12
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_time_per_output_token_seconds"):
        assert increase(f"vllm:{name}_count") == 2
    assert increase("vllm:inter_token_latency_seconds_count") == 10
    assert buckets(after, "vllm:time_to_first_token_seconds")[: len(VLLM_TTFT_BUCKETS)] == VLLM_TTFT_BUCKETS
    assert buckets(after, "vllm:inter_token_latency_seconds")[: len(VLLM_ITL_BUCKETS)] == VLLM_ITL_BUCKETS
    assert v(after, "vllm:kv_cache_usage_perc") == value(after, "atom_kv_cache_usage_ratio")
    for family in text_string_to_metric_families(after):
        if family.name.startswith("vllm:") and family.name != "vllm:cache_config_info":  # an info gauge: below
            # speculation's accepted tokens per draft position add vLLM's `position` label (where drafts ran)
            per_position = family.name == "vllm:spec_decode_num_accepted_tokens_per_pos"
            expected = ("engine", "model_name", "position") if per_position else ("engine", "model_name")
            assert {tuple(sorted(set(s.labels) - {"le"})) for s in family.samples} == {expected}


def cache_config_info(text: str) -> dict[str, str]:
    """The labels of the one ``vllm:cache_config_info`` sample (an info gauge: its value is 1)."""
    [sample] = samples(text)["vllm:cache_config_info"]
    assert sample.name == "vllm:cache_config_info" and sample.value == 1
    return sample.labels


async def test_the_kv_caches_configuration_is_vllms_cache_config_info(atom):
    """What a KV-aware router reads for a replica's capacity (num_gpu_blocks x block_size tokens)."""
    client, engine = atom.quart.test_client(), atom.runtime.engine
    info = cache_config_info(await scrape(client))
    blocks = engine.block_manager.num_blocks
    assert blocks > 0 and info["num_gpu_blocks"] == str(blocks) and info["block_size"] == "16"
    assert info["kv_cache_size_tokens"] == str(blocks * 16) == str(engine.max_kv_tokens)
    assert info["kv_cache_max_concurrency"] == str(blocks * 16 / 2048)  # the test server's max_model_len
    assert int(info["kv_cache_memory_bytes"]) == blocks * engine.kv_bytes_per_block <= 0.05 * 2**30
    assert info["cache_dtype"] == "auto" and info["enable_prefix_caching"] == "True"
    assert info["kv_offloading_size"] == info["num_gpu_blocks_override"] == "None" and info["engine"] == "0"


def test_cache_config_info_names_an_fp8_pool_and_its_tier(tiny_model):
    llm = LLM(tiny_model, kv_cache_dtype="fp8", num_kv_blocks=40, kv_offloading_size=0.01)
    metrics = Metrics()
    metrics.bind_engine(llm.engine, "tiny")
    info = cache_config_info(metrics.render().decode())
    assert info["cache_dtype"] == "fp8" and info["num_gpu_blocks"] == info["num_gpu_blocks_override"] == "40"
    assert info["kv_offloading_size"] == "0.01" and info["kv_cache_size_tokens"] == "640"
    assert int(info["kv_cache_memory_bytes"]) == 40 * llm.engine.kv_bytes_per_block


async def test_vllm_request_gauges_show_a_running_and_a_waiting_request(tiny_model):
    async with serving_app(tiny_model, max_model_len=2048, kv_cache_gib=0.05, max_num_seqs=1) as atom:
        client, engine = atom.quart.test_client(), atom.runtime.engine
        labels = {"model_name": atom.runtime.model_name, "engine": "0"}

        async def stream() -> None:
            await client.post("/v1/chat/completions", json=chat(400, ignore_eos=True, stream=True))

        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(stream)
            await wait_until(lambda: engine.scheduler.running and engine.num_waiting_seqs == 1)
            during = await scrape(client)
            tg.cancel_scope.cancel()
        assert value(during, "vllm:num_requests_running", **labels) == 1
        assert value(during, "vllm:num_requests_waiting", **labels) == 1


async def test_no_series_is_labelled_per_request_without_the_opt_in(tiny_model):
    async with serving(tiny_model) as atom:
        client = atom.quart.test_client()
        r = await client.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "rid-not-a-label"})
        assert r.headers["x-request-id"] == "rid-not-a-label"
        text = await scrape(client)
        assert PER_REQUEST not in families(text)
        assert "rid-not-a-label" not in text


async def test_opt_in_per_request_gauge_lives_exactly_as_long_as_its_request(tiny_model):
    async with serving_app(tiny_model, max_model_len=2048, kv_cache_gib=0.05, metrics_per_request=True) as atom:
        client = atom.quart.test_client()
        engine = atom.runtime.engine
        result: dict[str, Any] = {}

        async def long_stream() -> None:
            body = chat(200, stream=True, ignore_eos=True, stream_options={"include_usage": True})
            r = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": "long-1"})
            result["body"] = await r.get_data(as_text=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_stream)
            await wait_until(lambda: engine.scheduler.running and engine.scheduler.running[0].num_output_tokens > 0)
            during = await scrape(client)
        assert families(during)[PER_REQUEST] == "gauge"
        frames = result["body"].split("\n\n")
        assert frames[-2:] == ["data: [DONE]", ""]
        usage = json.loads(frames[-3].removeprefix("data: "))["usage"]
        assert [(s.labels, s.value) for s in samples(during)[PER_REQUEST]] == [
            ({"request_id": "long-1"}, usage["prompt_tokens"])
        ]
        after = await scrape(client)
        assert samples(after)[PER_REQUEST] == [] and "long-1" not in after
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"x-request-id": "short-2"})
        assert samples(await scrape(client))[PER_REQUEST] == []


async def test_metrics_output_does_not_grow_with_requests_served(atom):
    client = atom.quart.test_client()

    async def serve_requests(n: int) -> None:
        async def one(i: int) -> None:
            rid = {"x-request-id": f"req-{i}"}
            if i % 3 == 0:
                await client.post("/v1/completions", json={"prompt": f"n{i}", "max_tokens": 2}, headers=rid)
            else:
                await client.post("/v1/chat/completions", json=chat(2, stream=i % 3 == 1), headers=rid)

        for start in range(0, n, 10):
            async with anyio.create_task_group() as tg:
                for i in range(start, min(start + 10, n)):
                    tg.start_soon(one, i)

    for generation in range(3):  # every generation label exists before the first count
        gc.collect(generation)
    await scrape(client)  # the scrapes' own series exist before the first count
    await serve_requests(10)
    after_10 = (await scrape(client)).splitlines()
    await serve_requests(190)
    after_200 = (await scrape(client)).splitlines()
    assert len(after_200) == len(after_10)
    generation_total = [
        line for line in after_200 if line.startswith("atom_requests_total") and 'endpoint="metrics"' not in line
    ]
    assert sum(float(line.split()[-1]) for line in generation_total) == 200


# event loop and GC


async def test_the_lag_monitor_records_a_blocked_event_loop(atom):
    client = atom.quart.test_client()
    bucket = "atom_event_loop_lag_seconds_bucket"
    before = await scrape(client)
    time.sleep(0.2)  # blocks the event loop on purpose: the behaviour under test
    await anyio.sleep(0.05)  # the monitor's next tick sees the delay
    after = await scrape(client)
    over_100ms = [
        value(text, "atom_event_loop_lag_seconds_count") - value(text, bucket, le="0.1") for text in (before, after)
    ]
    assert over_100ms[1] - over_100ms[0] >= 1


async def test_the_gc_timer_times_a_full_collection(atom):
    client = atom.quart.test_client()
    before = value(await scrape(client), "atom_gc_pause_seconds_count", generation="2")
    gc.collect()
    text = await scrape(client)
    assert value(text, "atom_gc_pause_seconds_count", generation="2") == before + 1
    assert value(text, "atom_gc_pause_seconds_sum", generation="2") > 0


async def test_serving_freezes_the_heap_until_it_ends(tiny_model):
    before = gc.get_threshold()
    async with serving(tiny_model):
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


# logs written by a real server


@pytest.fixture
def log_stream():
    stream = io.StringIO()
    configure_logging("json", "info", stream=stream)
    yield stream
    configure_logging("console", "info")


async def test_every_server_log_line_is_json_with_the_documented_keys(tiny_model, log_stream, tmp_path):
    port = free_port()
    atom = AtomApp(Config.of(kv_cache_gib=0.05, port=port), loaded=tiny_model)
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, atom)
        await wait_healthy(f"http://127.0.0.1:{port}")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            mine = await http.post("/v1/chat/completions", json=chat(3), headers={"x-request-id": "client-id-1"})
            streamed = await http.post("/v1/chat/completions", json=chat(3, stream=True, ignore_eos=True))
            refused = await http.post("/v1/chat/completions", json={"messages": "not a list"})
            time.sleep(0.15)  # a blocked loop: the lag warning is a log line too
            await anyio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)  # serve's own shutdown path
    assert mine.headers["x-request-id"] == "client-id-1"
    generated_id = streamed.headers["x-request-id"]
    assert generated_id and refused.status_code == 400

    lines = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    assert all({"event", "level", "timestamp", "logger"} <= set(line) for line in lines), lines
    by_event: dict[str, list[dict]] = {}
    for line in lines:
        by_event.setdefault(line["event"], []).append(line)
    finished = {line["request_id"]: line for line in by_event["request.finished"] if line["endpoint"] == "chat"}
    assert set(finished) == {"client-id-1", generated_id, refused.headers["x-request-id"]}
    one = finished["client-id-1"]
    assert one["endpoint"] == "chat" and one["outcome"] == "ok" and one["status"] == 200
    assert one["finish_reason"] in ("stop", "length") and one["generated_tokens"] <= 3
    for key in ("prompt_tokens", "cached_tokens", "queue_time_s", "prepare_s", "ttft_s", "e2e_s"):
        assert isinstance(one[key], int | float), key
    assert finished[generated_id]["finish_reason"] == "length" and finished[generated_id]["generated_tokens"] == 3
    access = {line["request_id"]: line for line in by_event["http.access"] if line["path"] != "/health"}
    assert access["client-id-1"]["method"] == "POST" and access["client-id-1"]["status"] == 200
    assert access[refused.headers["x-request-id"]]["status"] == 400
    assert all(isinstance(line["duration_s"], float) for line in access.values())
    assert any(line["logger"] == "hypercorn.error" for line in lines)
    assert [w["level"] for w in by_event["event_loop.lag"]][:1] == ["warning"]

    log_file = tmp_path / "server.log"
    log_file.write_text(log_stream.getvalue())
    summary = summarize(log_file)
    num_health = len(by_event["request.finished"]) - 3
    assert summary["endpoints"] == {"chat": 3, "health": num_health}
    assert summary["outcomes"] == {"ok": 2 + num_health, "refused": 1}
    assert summary["errors"] == {"request chat refused 400": 1}


async def test_every_request_writes_one_finished_line_with_a_bounded_endpoint_label(tiny_model, log_stream):
    config = Config.of(max_model_len=2048, kv_cache_gib=0.05, api_key="k", max_body_bytes=65536)
    auth = {"Authorization": "Bearer k"}
    as_json = {"Content-Type": "application/json"}
    long_chat = {"messages": [{"role": "user", "content": "river " * 3000}], "max_tokens": 2}
    atom = AtomApp(config, loaded=tiny_model)
    async with atom.serving():
        client = atom.quart.test_client()

        async def call(rid: str, method: str, path: str, headers: dict | None = None, **kw: Any) -> int:
            r = await client.open(path, method=method, headers={"x-request-id": rid, **auth, **(headers or {})}, **kw)
            await r.get_data()
            return r.status_code

        statuses = {
            "ok": await call("ok", "POST", "/v1/chat/completions", json=chat(2)),
            "streamed": await call("streamed", "POST", "/v1/chat/completions", json=chat(2, stream=True)),
            "bad-json": await call("bad-json", "POST", "/v1/chat/completions", data=b"{not json", headers=as_json),
            "no-key": await call(
                "no-key", "POST", "/v1/completions", json={"prompt": "x"}, headers={"Authorization": ""}
            ),
            "too-long": await call("too-long", "POST", "/v1/chat/completions", json=long_chat),
            "too-large": await call("too-large", "POST", "/v1/completions", data=b"x" * 70000, headers=as_json),
            "unknown-path": await call("unknown-path", "GET", "/v1/secret-client-chosen-path"),
            "wrong-method": await call("wrong-method", "GET", "/v1/chat/completions"),
            "models": await call("models", "GET", "/v1/models"),
        }
        metrics_text = await scrape(client)
    assert statuses == {
        "ok": 200, "streamed": 200, "bad-json": 400, "no-key": 401, "too-long": 400, "too-large": 413,
        "unknown-path": 404, "wrong-method": 405, "models": 200,
    }  # fmt: skip
    lines = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    finished = [line for line in lines if line["event"] == "request.finished"]
    by_id = {line["request_id"]: line for line in finished if line["request_id"] in statuses}
    assert sorted(line["request_id"] for line in finished if line["request_id"] in statuses) == sorted(statuses)
    assert {rid: (line["endpoint"], line["status"], line["outcome"]) for rid, line in by_id.items()} == {
        "ok": ("chat", 200, "ok"),
        "streamed": ("chat", 200, "ok"),
        "bad-json": ("chat", 400, "refused"),
        "no-key": ("completions", 401, "refused"),
        "too-long": ("chat", 400, "refused"),
        "too-large": ("completions", 413, "refused"),
        "unknown-path": ("other", 404, "refused"),
        "wrong-method": ("other", 405, "refused"),
        "models": ("models", 200, "ok"),
    }
    assert by_id["ok"]["generated_tokens"] <= 2 and "e2e_s" in by_id["ok"]
    assert value(metrics_text, "atom_requests_total", endpoint="chat", outcome="refused") == 2
    assert value(metrics_text, "atom_requests_total", endpoint="other", outcome="refused") == 2
    assert value(metrics_text, "atom_requests_total", endpoint="chat", outcome="ok") == 2
    assert "secret-client-chosen-path" not in metrics_text
    labels = {s.labels["endpoint"] for s in samples(metrics_text)["atom_requests"]}
    assert labels == {"chat", "completions", "other", "models"}


# atom-anyio logs


T0 = datetime(2026, 1, 1, tzinfo=UTC).timestamp()


def finished_line(i: int, t: float, outcome: str = "ok", **fields: Any) -> str:
    event = {
        "event": "request.finished",
        "level": "info",
        "timestamp": datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z"),
        "request_id": f"r{i}",
        "endpoint": "chat",
        "outcome": outcome,
        "status": {"ok": 200, "error": 500, "cancelled": 499, "refused": 400}[outcome],
        "finish_reason": "length",
        **fields,
    }
    return json.dumps(event)


@pytest.fixture
def known_log(tmp_path):
    """100 ok requests one second apart (ttft i/100 s, e2e i/10 s, i*10 prompt
    tokens, 64 generated), 3 engine errors, 2 cancellations, 4 refused
    requests (each with its access-log line too), one error event and lines
    that are not JSON objects."""
    lines = []
    for i in range(1, 101):
        lines.append(
            finished_line(
                i, T0 + i - 1, ttft_s=i / 100, e2e_s=i / 10, queue_time_s=0.001, prepare_s=i / 1000,
                prompt_tokens=i * 10, cached_tokens=0, generated_tokens=64,
            )
        )  # fmt: skip
        if i % 25 == 0:
            lines += ["Traceback (most recent call last):", "", "[1, 2]", '{"truncated": ']
    for i in range(101, 104):
        lines.append(finished_line(i, T0 + 100, "error", e2e_s=0.5, generated_tokens=1))
    for i in range(104, 106):
        lines.append(finished_line(i, T0 + 101, "cancelled", e2e_s=0.2, generated_tokens=2))
    access = {"event": "http.access", "level": "info", "method": "POST", "path": "/v1/chat/completions"}
    lines += [json.dumps({**access, "status": 400, "timestamp": "2026-01-01T00:00:00Z"})] * 4
    lines += [finished_line(i, T0, "refused") for i in range(106, 110)]
    lines.append(json.dumps({"event": "engine.step_failed", "level": "error", "timestamp": "2026-01-01T00:00:00Z"}))
    path = tmp_path / "known.log"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_logs_summary_counts_errors_and_gives_exact_percentiles(known_log):
    s = summarize(known_log, window_s=60, num_slowest=3)
    assert s["num_skipped"] == 16
    assert s["num_requests"] == 109
    assert s["outcomes"] == {"ok": 100, "error": 3, "cancelled": 2, "refused": 4}
    assert s["errors"] == {
        "request chat refused 400": 4,  # once each: the access-log lines are not counted again
        "request chat error 500": 3,
        "request chat cancelled 499": 2,
        "event engine.step_failed": 1,
    }
    for name, values in {
        "ttft_s": [i / 100 for i in range(1, 101)],
        "e2e_s": [i / 10 for i in range(1, 101)],
        "prepare_s": [i / 1000 for i in range(1, 101)],
        "prompt_tokens": [i * 10 for i in range(1, 101)],
    }.items():
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        got = s["percentiles"][name]
        assert got["count"] == 100
        assert (got["p50"], got["p90"], got["p99"]) == pytest.approx((cuts[49], cuts[89], cuts[98])), name
        assert got["max"] == pytest.approx(max(values))
    assert s["percentiles"]["generated_tokens"]["p99"] == 64
    assert [(w["start_s"], w["requests"], w["errors"]) for w in s["windows"]] == [(0, 64, 4), (60, 45, 5)]
    assert s["windows"][0]["requests_per_s"] == pytest.approx(64 / 60)
    assert s["windows"][0]["generated_tok_per_s"] == pytest.approx(64.0)
    first_minute_ttft = statistics.quantiles([i / 100 for i in range(1, 61)], n=100, method="inclusive")
    assert s["windows"][0]["ttft_p50_s"] == pytest.approx(first_minute_ttft[49])
    assert [r["request_id"] for r in s["slowest"]] == ["r100", "r99", "r98"]


def test_logs_summary_command_prints_tables_or_json(known_log, capsys):
    assert cli_main(["logs", "summary", str(known_log), "--window", "60", "--slowest", "2"]) == 0
    text = capsys.readouterr().out
    assert "109 requests" in text and "r100" in text and "r99" in text and "r98" not in text
    assert cli_main(["logs", "summary", str(known_log), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["num_requests"] == 109 and len(s["slowest"]) == 10


def test_logs_plot_writes_a_png(known_log, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    assert cli_main(["logs", "plot", str(known_log), "--out", str(out), "--window", "30"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


ARENA_PROBE = """
import ctypes, sys, tempfile, threading
from atom_anyio.obs.loop_health import limit_malloc_arenas
limited = limit_malloc_arenas(int(sys.argv[1]))
start = threading.Barrier(8)

def allocate():
    start.wait()
    keep = [bytearray(4096) for _ in range(2000)]
    done.wait()

done = threading.Event()
threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads:
    t.start()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(fp))
    libc.fclose(ctypes.c_void_p(fp))
    print(limited, open(f.name).read().count("<heap nr="))
done.set()
"""


def arenas_used(max_arenas: int) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", ARENA_PROBE, str(max_arenas)], capture_output=True, text=True, check=True
    )
    limited, heaps = out.stdout.split()
    return limited == "True", int(heaps)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"), reason="glibc only")
def test_the_malloc_arena_limit_keeps_threads_in_few_arenas():
    limited, heaps = arenas_used(2)
    assert limited and heaps <= 2
    unlimited, heaps_default = arenas_used(0)  # glibc's default: threads get arenas of their own
    assert not unlimited and heaps_default > 2


TRIM_PROBE = """
import ctypes, sys
from atom_anyio.obs.loop_health import anonymous_rss_bytes, release_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.free(libc.malloc(16 << 20))  # a large buffer freed, as loading frees its staging: glibc's thresholds rise
blocks = [libc.malloc(1 << 20) for _ in range(100)]  # now from the heap
for b in blocks:
    libc.memset(b, 1, 1 << 20)
for b in blocks[:-1]:  # the last one kept: the rest is free below it, not at the heap's top
    libc.free(b)
before = anonymous_rss_bytes()
ran = release_freed_memory() if sys.argv[1] == "release" else False
print(ran, before, anonymous_rss_bytes())
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"), reason="glibc only")
def test_memory_freed_below_the_heaps_top_goes_back_to_the_system():
    """What a model's load frees stays resident under glibc's raised thresholds until it is
    released (malloc_trim): 99 MiB freed below a kept block."""
    for how in ("release", "keep"):
        out = subprocess.run([sys.executable, "-c", TRIM_PROBE, how], capture_output=True, text=True, check=True)
        ran, before, after = out.stdout.split()
        assert ran == str(how == "release")
        released = int(before) - int(after)
        if how == "release":
            assert released > 80 << 20
        else:
            assert abs(released) < 8 << 20
