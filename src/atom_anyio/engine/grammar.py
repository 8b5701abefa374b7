"""Structured outputs: a request's constraint compiled to an xgrammar grammar, bounded in time.

``Grammars`` is one per server. It compiles in the prepare step's worker thread (never on the
event loop) through a small pool so that a compile can be given up on after ``timeout_s``;
xgrammar's own cache, keyed by the schema text, makes a repeated schema free. The engine then
runs one ``GrammarMatcher`` per sequence: a step's masks are filled from it when the step is built
(``fill_bitmask``), the worker applies them, and the output side advances it by each token appended.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from atom_anyio.engine.wind_down import Closer
from atom_anyio.sampling_params import StructuredOutputs

# JSON Schema keywords xgrammar 0.2 would silently ignore: enforcing only part of a schema would
# let outputs through that do not validate, so a schema using one is refused instead.
UNSUPPORTED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "oneOf",
    "contains",
    "minContains",
    "maxContains",
    "patternProperties",
    "propertyNames",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
    "$dynamicRef",
)
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties")
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the API layer answers 400 naming ``param``."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Constraint:
    """What the engine needs to constrain one request's sequences."""

    grammar: xgr.CompiledGrammar
    closer: Closer  # how an output near its max_tokens closes the grammar (wind_down.py)
    param: str = "structured_outputs"  # the request field it came from, named when it admits no output

    def new_matcher(self) -> xgr.GrammarMatcher:
        """A matcher for one sequence (each choice its own: their outputs differ)."""
        return xgr.GrammarMatcher(self.grammar)

    def admits_a_token(self, matcher: xgr.GrammarMatcher) -> bool:
        """Whether ``matcher``'s next mask allows any token (its grammar can go on, or end)."""
        return admits_a_token(self.grammar, matcher)


class Grammars:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        timeout_s: float = 10.0,
        num_threads: int = 2,
        cache_bytes: int = 256 * 2**20,
    ):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=num_threads, cache_limit_bytes=cache_bytes)
        self.closer = Closer(info)
        self.timeout_s = timeout_s
        # a compile past the bound keeps its thread until it ends: xgrammar cannot be interrupted
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar")

    def constraint(self, spec: StructuredOutputs) -> Constraint:
        """``spec`` compiled, as the engine takes it (see ``compile``)."""
        return Constraint(self.compile(spec), self.closer, spec.param)

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """The grammar of ``spec``; raises ``GrammarError`` naming ``spec.param``. Blocking: call it
        from a worker thread."""
        for where, schema in _schemas_of(spec):
            check_schema(schema, where)
        future = self._pool.submit(self._compile, spec)
        try:
            grammar = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise GrammarError(f"grammar compilation exceeded {self.timeout_s} s", spec.param) from None
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = _LOCATION.sub("", str(exc).strip())
            raise GrammarError(f"'{spec.param}' cannot be compiled into a grammar: {reason}", spec.param) from None
        # a language with no string in it (the regex ``[^\s\S]``, an empty character class) compiles, and
        # its mask would leave every logit -inf: the sampler's pick then broke the grammar, a 500 where
        # the request is at fault (a stop token counts: an empty output is an output)
        if not admits_a_token(grammar, xgr.GrammarMatcher(grammar)):
            raise GrammarError(f"'{spec.param}' admits no output: no token of the vocabulary can start it", spec.param)
        return grammar

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        c, v = self.compiler, spec.value
        if spec.kind == "json":
            return c.compile_grammar(_json_schema_ebnf(v if isinstance(v, str) else json.dumps(v)))
        if spec.kind == "json_object":  # an object, as OpenAI's json_object promises (not any JSON value)
            return c.compile_grammar(_json_schema_ebnf('{"type": "object"}'))
        if spec.kind == "regex":
            return c.compile_regex(v)
        if spec.kind == "choice":
            return c.compile_grammar(choice_ebnf(v))
        if spec.kind == "grammar":
            return c.compile_grammar(v)
        return c.compile_grammar(_structural_tag_ebnf(v if isinstance(v, str) else json.dumps(v)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# xgrammar 0.2.9 writes a length-bounded JSON string's characters as this class, which lets raw
# control characters through (invalid JSON); its unbounded strings already exclude them
_BOUNDED_STRING_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\\r\n]"

# The digits of each part of a JSON number (integer, fraction, exponent) a grammar allows: a double
# keeps at most 17 significant digits and I-JSON's exact integers (RFC 7493) have at most 16, so a
# longer run carries nothing a reader keeps, and an unbounded one lets a sampled model spend its
# whole budget on one number. xgrammar writes such a run as `[0-9]*` after the leading digit, or
# as a one-digit rule repeated `{1, -1}` (after a leading digit or not); quoted literals,
# Regex("...") and character classes are left alone.
MAX_NUMBER_DIGITS = 16
_DIGIT_RULE = re.compile(r"^(\w+) ::= \(\(\[0-9\]\)\)$", re.MULTILINE)
_EBNF_PIECE = re.compile(
    r'(?P<star>\[0-9\]\*)|(?P<lead>\[1-9\] )?(?P<rule>\w+)\{1, -1\}|"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]'
)


def _bounded_numbers(ebnf: str) -> str:
    """``ebnf`` with every digit run of a JSON number at most ``MAX_NUMBER_DIGITS`` long."""
    digit_rules = set(_DIGIT_RULE.findall(ebnf))

    def bound(m: re.Match[str]) -> str:
        if m["star"]:
            return f"[0-9]{{0, {MAX_NUMBER_DIGITS - 1}}}"
        if m["rule"] in digit_rules:
            return f"{m['lead'] or ''}{m['rule']}{{1, {MAX_NUMBER_DIGITS - bool(m['lead'])}}}"
        return m[0]

    return _EBNF_PIECE.sub(bound, ebnf)


def _no_control_characters(grammar: xgr.Grammar) -> str:
    return str(grammar).replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)


# schema text -> EBNF, in front of the compiler's cache (keyed by the EBNF): a repeated schema skips the conversion
@functools.lru_cache(maxsize=256)
def _json_schema_ebnf(schema: str) -> str:
    """JSON from ``schema``, compact (no whitespace but the one space after ``,`` and ``:``, as
    vLLM's ``disable_any_whitespace``): a sampled model cannot pad the object with whitespace."""
    return _bounded_numbers(_no_control_characters(xgr.Grammar.from_json_schema(schema, any_whitespace=False)))


@functools.lru_cache(maxsize=256)
def _structural_tag_ebnf(tag: str) -> str:
    return _no_control_characters(xgr.Grammar.from_structural_tag(json.dumps(_compact_json(json.loads(tag)))))


def _compact_json(node: Any) -> Any:
    """A structural tag whose plain JSON-schema contents are the compact JSON of ``_json_schema_ebnf``
    (xgrammar's own allow whitespace, at least one character at a time); one that sets a
    whitespace limit, another style or another option keeps xgrammar's reading."""
    if isinstance(node, list):
        return [_compact_json(value) for value in node]
    if not isinstance(node, dict):
        return node
    is_plain = set(node) <= {"type", "json_schema", "style"} and node.get("style", "json") == "json"
    if node.get("type") == "json_schema" and is_plain:
        return {"type": "grammar", "grammar": _json_schema_ebnf(json.dumps(node["json_schema"]))}
    return {key: _compact_json(value) for key, value in node.items()}


def choice_ebnf(choices: Sequence[str]) -> str:
    """A grammar whose language is exactly ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schemas_of(spec: StructuredOutputs) -> Iterator[tuple[str, Any]]:
    """The JSON schemas inside ``spec``, each with the field to name if it is refused."""
    if spec.kind == "json":
        schema = spec.value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"'{spec.param}' is not valid JSON: {exc}", spec.param) from None
        yield spec.param, schema
    elif spec.kind == "structural_tag":
        yield from ((spec.param, s) for s in _tag_schemas(spec.value))


def _tag_schemas(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        if node.get("type") == "json_schema":
            yield node.get("json_schema")
        for value in node.values():
            yield from _tag_schemas(value)
    elif isinstance(node, list):
        for value in node:
            yield from _tag_schemas(value)


def check_schema(schema: Any, param: str, path: str = "") -> None:
    """Refuse a schema that uses a feature the grammar cannot enforce, naming the feature and where."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"'{param}{path}' must be a JSON schema object", param)
    for key in UNSUPPORTED_KEYWORDS:
        if key in schema:
            raise _unsupported(param, path, key)
    if schema.get("uniqueItems"):
        raise _unsupported(param, path, "uniqueItems")
    if "multipleOf" in schema and schema.get("type") != "integer":
        raise _unsupported(param, path, "multipleOf", " on a non-integer")
    if len(schema.get("allOf") or ()) > 1:
        raise _unsupported(param, path, "allOf", " of more than one schema")
    ref = schema.get("$ref")
    if ref is not None and not str(ref).startswith("#"):
        raise _unsupported(param, path, "$ref", f" to another document ({ref})")
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            check_schema(sub, param, f"{path}.{key}.{name}")
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or ()):
            check_schema(sub, param, f"{path}.{key}.{i}")
    for key in _SUBSCHEMAS:
        if key in schema:
            check_schema(schema[key], param, f"{path}.{key}")


def _unsupported(param: str, path: str, keyword: str, detail: str = "") -> GrammarError:
    where = f" at '{path.lstrip('.')}'" if path else ""
    return GrammarError(
        f"'{param}' uses the JSON Schema keyword '{keyword}'{detail}{where}, which the grammar engine cannot enforce",
        param,
    )


def admits_a_token(grammar: xgr.CompiledGrammar, matcher: xgr.GrammarMatcher) -> bool:
    """Whether ``matcher`` (of ``grammar``) allows any token next. A grammar can also run into a dead
    end later (a JSON string whose pattern no character matches: its opening quote, then nothing)."""
    bitmask = xgr.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


# each step: the masks filled when it is built (the loop's side), applied by the worker


def fill_bitmask(matchers: Sequence[Any], drafts: Sequence[Sequence[int]], vocab_size: int) -> tuple[list[int], Any]:
    """The step's grammar masks as plain data: the constrained rows, and an int32 bitmask with a row
    per sampled row (all allowed where unconstrained). ``matchers``: one per sample row (None where
    unconstrained); ``drafts``: each one's draft tokens (or empty), whose positions each get the
    grammar's state after the draft tokens before them. Reads the matchers and leaves them as they were."""
    spans = [len(d) + 1 for d in drafts] if drafts else [1] * len(matchers)
    bitmask = xgr.allocate_token_bitmask(sum(spans), vocab_size)
    rows, row = [], 0
    for j, (matcher, span) in enumerate(zip(matchers, spans, strict=True)):
        if matcher is not None:
            draft = drafts[j] if drafts else []
            for i in range(span):
                matcher.fill_next_token_bitmask(bitmask, row + i)
                if i < len(draft):
                    assert matcher.accept_token(draft[i]), "a draft token its grammar forbids was not trimmed"
            if draft:
                matcher.rollback(len(draft))
            rows += range(row, row + span)
        row += span
    return rows, bitmask


def apply_bitmask(logits: Any, bitmask: Any, rows: list[int]) -> None:
    """Mask, in place, the tokens each of ``rows``' grammar forbids next (the worker's side)."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
