"""Per-request sampling parameters, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # number of top alternatives; 0 = the sampled token only
    prompt_logprobs: int | None = None  # the same for every prompt token (vLLM's); computed in the prefill
    max_tokens: int | None = 16  # None: the rest of the context; 0: the prompt only (its prompt logprobs)
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # tokens the reasoning block may take before it is closed (Anthropic's thinking.budget_tokens);
    # honoured where the prompt leaves a reasoning block open
    reasoning_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.top_k < 0:
            self.top_k = 0
        for name, ok in (
            ("n", self.n >= 1),
            ("temperature", self.temperature >= 0),
            ("top_p", 0 < self.top_p <= 1),
            ("min_p", 0 <= self.min_p <= 1),
            ("repetition_penalty", self.repetition_penalty > 0),
            ("presence_penalty", -2 <= self.presence_penalty <= 2),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 0),
            ("min_tokens", self.min_tokens >= 0),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20),
        ):
            if not ok:
                raise ValueError(f"invalid {name}: {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    """One output constraint, shaped like vLLM's ``structured_outputs``; the grammar enforces it.

    ``value`` by kind: json, a JSON schema (a dict or its JSON text); json_object, None; regex, the
    pattern; choice, the list of allowed strings; grammar, EBNF text; structural_tag, an xgrammar
    structural tag (a dict). ``param`` is the request field it came from, named in a 400.
    """

    kind: str
    value: Any = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
