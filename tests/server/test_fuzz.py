"""Fuzzing the server as a real process: schemathesis generates requests from
the server's own /openapi.json (valid and invalid, every operation), and
hand-written hypothesis strategies send the malformed bodies a schema cannot
describe. Whatever comes in: never a 5xx, every error in the route's own
shape, an ``x-request-id`` on every response.

``ATOM_FUZZ_EXAMPLES`` sets the examples per operation and strategy (default
a quick run); ``ATOM_FUZZ_COVERAGE=1`` adds schemathesis's coverage phase;
``ATOM_FUZZ_REPORT`` names a file for the run's JSON summary.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import jsonschema
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from support_servers import Served, clean_env, free_port, running

from atom_anyio.api.openapi import POSTS, openapi_document

API_KEY = "fuzz-key"
NUM_EXAMPLES = int(os.environ.get("ATOM_FUZZ_EXAMPLES", "20"))
# schemathesis's coverage phase (boundary and type-violating values of every field, about 2,000 requests
# and four minutes here) runs when asked for; the default run keeps the suite's time
COVERAGE_PHASE = os.environ.get("ATOM_FUZZ_COVERAGE", "0") == "1"
MAX_TOKENS = 4  # what is fuzzed is the API, not generation: keep every generation short
MAX_N = 2
TOKEN_CAPS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
OPEN_PATHS = ("/health", "/version", "/metrics", "/openapi.json")
BUILTIN_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
GENERATING = {"/v1/chat/completions": "max_tokens", "/v1/responses": "max_output_tokens"}

# the run's tally, reported at the end of the module
STATUSES: Counter[int] = Counter()
BY_OPERATION: Counter[str] = Counter()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[Served]:
    port = free_port()
    env = clean_env(
        model=str(tiny_model_dir),
        max_model_len="512",
        kv_cache_gib="0.25",
        api_key=API_KEY,
        log_format="json",
        responses_store_max_items="64",
    )
    cmd = [sys.executable, "-m", "hypercorn", "atom_anyio:app", "--bind", f"127.0.0.1:{port}"]
    started = time.monotonic()
    with running(cmd, env, port, tmp_path_factory.mktemp("fuzz") / "server.log") as served:
        yield served
        report(time.monotonic() - started)


def report(elapsed_s: float) -> None:
    summary = {
        "requests": sum(STATUSES.values()),
        "statuses": dict(sorted(STATUSES.items())),
        "by_operation": dict(sorted(BY_OPERATION.items())),
        "num_5xx": sum(n for s, n in STATUSES.items() if s >= 500),
        "examples_per_operation": NUM_EXAMPLES,
        "runtime_s": round(elapsed_s, 1),
    }
    print("\nfuzz summary:", json.dumps(summary))
    if path := os.environ.get("ATOM_FUZZ_REPORT"):
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)


# The document the server builds and serves (``test_the_served_document_is_the_one_fuzzed``
# pins that they are the same): schemathesis needs it at collection, before any server runs.
schema = schemathesis.openapi.from_dict(
    openapi_document(),
    config=schemathesis.Config.from_dict(
        {
            "generation": {
                "mode": "all",
                "max-examples": NUM_EXAMPLES,
                "database": "none",
                "with-security-parameters": False,  # the test sends the key (or not) itself
            },
            "suppress-health-check": ["too_slow", "filter_too_much", "data_too_large"],
            "phases": {"coverage": {"enabled": COVERAGE_PHASE}},
        }
    ),
)


def test_the_served_document_is_the_one_fuzzed(server: Served) -> None:
    response = httpx.get(f"{server.url}/openapi.json")  # no key: the document is open
    assert response.status_code == 200
    assert response.json() == openapi_document()


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    """One connection pool for every case: a session per call would load the CA bundle each time
    (50 ms a request here, most of the run's time)."""
    with requests.Session() as s:
        yield s


@schema.parametrize()
def test_fuzzed_requests_get_no_5xx_and_errors_in_the_route_shape(case, server: Served, session) -> None:
    bound_generation(case.operation.path, case.body)
    key = auth_key(case)
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    response = case.call(base_url=server.url, session=session, headers=headers, timeout=60)
    tally(f"{case.operation.method.upper()} {case.operation.path}", response.status_code)
    headers = {name: values[0] for name, values in response.headers.items()}
    check_response(case.operation.path, response.status_code, headers, response.content)
    if case.operation.path not in OPEN_PATHS:
        assert (response.status_code == 401) == (key != API_KEY), response.text
    case.validate_response(response, checks=BUILTIN_CHECKS)  # documented statuses, content types and bodies


def bound_generation(path: str, body: Any) -> None:
    """Cap token counts and choices in place (other values, valid or not, stay as generated)."""
    if not isinstance(body, dict):
        return
    for name in (*TOKEN_CAPS, "min_tokens"):
        if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > MAX_N:
        body["n"] = MAX_N
    if path in GENERATING:
        body.setdefault(GENERATING[path], MAX_TOKENS)


def auth_key(case: Any) -> str | None:
    """The right key for most cases; one in ten has none and one in ten a wrong one
    (chosen from the case's content, so a replayed example keeps its key)."""
    pick = zlib.crc32(repr((case.path_parameters, case.headers, case.body)).encode()) % 10
    return {0: None, 1: "wrong-key"}.get(pick, API_KEY)


def tally(operation: str, status: int) -> None:
    STATUSES[status] += 1
    BY_OPERATION[operation] += 1


def check_response(path: str, status: int, headers: Mapping[str, str], content: bytes) -> None:
    """No 5xx; an error body in the route's shape; the request id echoed."""
    assert status < 500, f"{status} from {path}: {content[:500]!r}"
    assert headers.get("x-request-id"), f"no x-request-id on a {status} from {path}"
    if status >= 400:
        error = json.loads(content)
        if path.startswith("/v1/messages"):
            assert error["type"] == "error" and set(error) == {"type", "error"}, error
            assert isinstance(error["error"]["type"], str) and isinstance(error["error"]["message"], str), error
        else:
            assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, error
            assert isinstance(error["error"]["message"], str) and isinstance(error["error"]["type"], str), error
    elif headers.get("content-type", "").startswith("text/event-stream"):
        assert b"event: error" not in content and b'data: {"error"' not in content, content[-500:]


# hand-written hostile bodies

POST_PATHS = [path for path, *_ in POSTS]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
hostile = settings(max_examples=NUM_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def http(server: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


def post(http: httpx.Client, path: str, content: bytes, content_type: str = "application/json") -> httpx.Response:
    response = http.post(path, content=content, headers={"Content-Type": content_type})
    tally(f"POST {path} (hostile)", response.status_code)
    check_response(path, response.status_code, response.headers, response.content)
    return response


def is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def valid_bodies(http: httpx.Client) -> dict[str, dict[str, Any]]:
    """One small valid body per POST route, to spoil one field at a time."""
    model = http.get("/v1/models").json()["data"][0]["id"]
    messages = [{"role": "user", "content": "hi"}]
    return {
        "/v1/chat/completions": {"messages": messages, "max_tokens": 2},
        "/v1/completions": {"prompt": "hi", "max_tokens": 2},
        "/v1/responses": {"input": "hi", "max_output_tokens": 2},
        "/v1/messages": {"model": model, "messages": messages, "max_tokens": 2},
        "/v1/messages/count_tokens": {"model": model, "messages": messages},
        "/tokenize": {"prompt": "hi"},
        "/detokenize": {"tokens": [1, 2]},
    }


def test_the_valid_bodies_are_valid(http, valid_bodies) -> None:
    for path, body in valid_bodies.items():
        assert post(http, path, json.dumps(body).encode()).status_code == 200, path


@pytest.mark.parametrize("path", POST_PATHS)
@hostile
@given(raw=st.binary(max_size=256).filter(lambda b: not is_json(b)))
def test_bodies_that_are_not_json_are_a_400(http, path: str, raw: bytes) -> None:
    assert post(http, path, raw).status_code == 400


@pytest.mark.parametrize("path", POST_PATHS)
@hostile
@given(
    value=st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(), st.lists(st.integers())
    )
)
def test_json_that_is_not_an_object_is_a_400(http, path: str, value: Any) -> None:
    assert post(http, path, json.dumps(value).encode()).status_code == 400


@pytest.mark.parametrize("path", POST_PATHS)
@hostile
@given(data=st.data(), bad=st.binary(min_size=1, max_size=16).filter(lambda b: not is_utf8(b)))
def test_bodies_that_are_not_utf8_are_a_400(http, valid_bodies, path: str, data: st.DataObject, bad: bytes) -> None:
    """Invalid UTF-8 inside a string of an otherwise valid body."""
    raw = json.dumps(valid_bodies[path]).encode()
    at = data.draw(st.sampled_from([i + 1 for i, c in enumerate(raw) if c == ord('"')]))
    assert post(http, path, raw[:at] + bad + raw[at:]).status_code == 400


def is_utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


NOT_JSON_TYPES = st.sampled_from(
    [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/xml",
        "image/png",
    ]
) | st.from_regex(r"\A[a-z]{1,10}/[a-z]{1,10}\Z").filter(lambda t: t != "application/json" and not t.endswith("+json"))


@pytest.mark.parametrize("path", POST_PATHS)
@hostile
@given(content_type=NOT_JSON_TYPES)
def test_content_types_other_than_json_are_a_415(http, valid_bodies, path: str, content_type: str) -> None:
    assert post(http, path, json.dumps(valid_bodies[path]).encode(), content_type).status_code == 415


@pytest.mark.parametrize("path", POST_PATHS)
@hostile
@given(data=st.data(), depth=st.integers(1_000, 100_000), kind=st.sampled_from(["array", "object"]))
def test_deeply_nested_bodies_are_a_400(
    http, valid_bodies, path: str, data: st.DataObject, depth: int, kind: str
) -> None:
    field = data.draw(st.sampled_from(sorted(valid_bodies[path])))
    nested = "[" * depth + "]" * depth if kind == "array" else '{"a":' * depth + "1" + "}" * depth
    assert post(http, path, with_literal(valid_bodies[path], field, nested)).status_code == 400


def with_literal(body: dict[str, Any], field: str, literal: str) -> bytes:
    """``body`` with ``field`` set to raw JSON text (which json.dumps could not write)."""
    return json.dumps({**body, field: 0}).replace(f'"{field}": 0', f'"{field}": {literal}').encode()


@pytest.mark.parametrize("path", POST_PATHS)
@hostile
@given(data=st.data(), literal=st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 5000]))
def test_non_finite_and_huge_numbers_are_a_4xx(
    http, valid_bodies, path: str, data: st.DataObject, literal: str
) -> None:
    """NaN and Infinity are not JSON; 1e999 overflows to infinity; 5,000 digits pass Python's limit."""
    fields = sorted(set(valid_bodies[path]) | set(model_fields(path)))
    field = data.draw(st.sampled_from(fields))
    status = post(http, path, with_literal(valid_bodies[path], field, literal)).status_code
    assert 400 <= status < 500, (field, literal, status)


def model_fields(path: str) -> dict[str, Any]:
    return next(model for p, model, *_ in POSTS if p == path).model_fields


# one sample of each JSON type; a field is sent those its schema does not allow
SAMPLES = {"null": None, "boolean": True, "number": 1.5, "string": "not-a-value", "array": [1], "object": {"a": 1}}


def unexpected_values(path: str) -> list[tuple[str, Any]]:
    document = openapi_document()
    name = next(model for p, model, *_ in POSTS if p == path).__name__
    properties = document["components"]["schemas"][name]["properties"]
    pairs = []
    for field, schema in sorted(properties.items()):
        for value in SAMPLES.values():
            if not jsonschema.Draft202012Validator({**schema, "components": document["components"]}).is_valid(value):
                pairs.append((field, value))
    return pairs


@pytest.mark.parametrize("path", POST_PATHS)
def test_every_field_sent_an_unexpected_type_is_a_400_naming_it(http, valid_bodies, path: str) -> None:
    for field, value in unexpected_values(path):
        response = post(http, path, json.dumps({**valid_bodies[path], field: value}).encode())
        assert response.status_code == 400, (field, value, response.text)
        error = response.json()["error"]
        assert field in (error.get("param") or error["message"]), (field, value, error)


# what the fuzzing found, pinned

HI = '"messages": [{"role": "user", "content": "hi"}]'
FOUND = [
    pytest.param("/tokenize", '{"prompt": ""}', 400, id="tokenize-empty-prompt"),
    pytest.param(
        "/v1/chat/completions",
        '{"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}], "max_tokens": 2}',
        400,
        id="chat-tool-call-function-not-an-object",
    ),
    pytest.param("/v1/responses", '{"input": [{"type": ["message"]}]}', 400, id="responses-item-type-unhashable"),
    pytest.param(
        "/v1/responses",
        '{"input": "hi", "tool_choice": {"type": "function", "name": {}}}',
        400,
        id="responses-tool-choice-name-unhashable",
    ),
    pytest.param(
        "/v1/messages",
        '{"model": "MODEL", "max_tokens": 2, "top_k": 1180591620717411303424, ' + HI + "}",
        200,
        id="messages-top-k-over-int64",
    ),
    pytest.param("/v1/chat/completions", "{" + HI + ', "x": ' + "[" * 5000 + "]" * 5000 + "}", 400, id="deep-nesting"),
    pytest.param("/v1/completions", '{"prompt": "hi", "seed": ' + "9" * 5000 + "}", 400, id="int-over-4300-digits"),
    pytest.param(
        "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, id="lone-surrogate"
    ),
    pytest.param(
        "/v1/responses",
        '{"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"x": NaN}}]}',
        400,
        id="nan-echoed-as-invalid-json",
    ),
    pytest.param("/v1/chat/completions", "{" + HI + ', "max_tokens": true}', 400, id="bool-read-as-int"),
    pytest.param(
        "/v1/messages", '{"model": "MODEL", "max_tokens": "2", ' + HI + "}", 400, id="numeric-string-read-as-int"
    ),
]


@pytest.mark.parametrize(("path", "raw", "status"), FOUND)
def test_bodies_the_fuzzer_found_are_answered_without_a_5xx(
    http, valid_bodies, path: str, raw: str, status: int
) -> None:
    model = valid_bodies["/v1/messages"]["model"]
    assert post(http, path, raw.replace("MODEL", model).encode()).status_code == status


def test_errors_sent_before_the_body_is_read_leave_the_connection_usable(server: Served) -> None:
    """401, 404 and 415 answer before reading the body; hypercorn closed such a connection
    without ``Connection: close``, so about one in fifty next requests on it failed."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    early = [
        ("/v1/completions", {"Content-Type": "text/plain", **AUTH}, 415),
        ("/v1/completions", {"Authorization": "Bearer wrong-key"}, 401),
        ("/v1/no-such-route", AUTH, 404),
    ]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for i in range(600):
            path, headers, status = early[i % len(early)]
            response = client.post(path, content=body, headers=headers)  # a dropped connection raises here
            assert response.status_code == status
