"""The one per-request state object, and the deltas it streams."""

from __future__ import annotations

import enum
import itertools
import time
import weakref
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from atom_anyio.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom_anyio.engine.detokenizer import IncrementalDetokenizer
    from atom_anyio.engine.stream import DeltaSender


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    """The sampled token's logprob and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """What one step produced for one sequence (choice ``index``)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or token id that matched
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


_seq_ids = itertools.count()
_alive: weakref.WeakSet[Sequence] = weakref.WeakSet()


def num_alive() -> int:
    """Sequence objects not yet collected (0 when the server is idle: nothing keeps finished ones)."""
    return len(_alive)


class Sequence:
    """A prompt and its completion while it is in the engine. The engine
    drops every reference when it finishes; nothing keeps finished ones."""

    def __init__(
        self,
        token_ids: list[int],
        params: SamplingParams,
        stream: DeltaSender,
        detokenizer: IncrementalDetokenizer,
        block_hashes: list[int],
        index: int = 0,
        seed: int | None = None,
    ):
        self.seq_id = next(_seq_ids)
        self.index = index
        self.token_ids = token_ids  # prompt then generated; owned here
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.seed = seed
        self.stream = stream
        self.detokenizer = detokenizer
        self.block_hashes = block_hashes  # chained hash of every full block
        self.block_table = array("i")  # block ids; an int32 buffer the worker reads without a copy
        self.num_computed_tokens = 0
        self.num_committed_blocks = 0  # leading blocks already published to the prefix cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.status = Status.WAITING
        self.max_tokens = params.max_tokens or 0
        self.siblings: list[Sequence] = []  # the other choices of an n > 1 request, until released
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.extra: dict[str, Any] = {}
        self.matcher: Any = None  # an xgrammar GrammarMatcher when the output is constrained
        # token ids the output must end with before the matcher applies (a reasoning end tag); () once it has
        self.grammar_gate: tuple[int, ...] = ()
        _alive.add(self)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def active_matcher(self) -> Any:
        """The matcher constraining the next token, or None."""
        return None if self.grammar_gate else self.matcher

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
