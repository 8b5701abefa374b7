"""The one per-sequence state object: a prompt and its completion while it is in the engine."""

from __future__ import annotations

import enum
import itertools
import time
import weakref
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from atom_anyio.engine.wind_down import WIND_DOWN_TOKENS, Closing

if TYPE_CHECKING:
    import numpy as np

    from atom_anyio.engine.detokenizer import IncrementalDetokenizer
    from atom_anyio.engine.request import EngineRequest
    from atom_anyio.engine.stream import ChoiceSender, Logprob


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
        request: EngineRequest,
        stream: ChoiceSender,
        detokenizer: IncrementalDetokenizer,
        index: int = 0,
        siblings: Iterable[Sequence] = (),
    ):
        params = request.params
        constraint = request.constraint
        self.seq_id = next(_seq_ids)
        self.index = index  # the choice's index in its request
        self.token_ids = list(request.prompt_token_ids)  # prompt then generated; owned here
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.max_tokens = request.max_tokens
        self.seed = None if params.seed is None else params.seed + index  # choices differ, runs repeat
        self.stream = stream
        self.detokenizer = detokenizer
        self.block_hashes = list(request.block_hashes)  # chained hash of every full block
        self.root_hash = request.root_hash  # what the first block's hash chains on (a tenant's salt)
        self.lease = request.lease  # how its blocks outlast it
        self.priority = request.priority  # under scheduling_policy=priority: lower first, then arrival
        self.block_table = array("i")  # block ids; an int32 buffer the worker reads without a copy
        self.num_computed_tokens = 0
        # async scheduling (0 otherwise): tokens in steps sent and not yet postprocessed, and the
        # tokens those steps sample (placeholders: appended when their step's result is back)
        self.num_scheduled_tokens = 0
        self.num_placeholders = 0
        self.num_committed_blocks = 0  # leading blocks already published to the prefix cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.status = Status.WAITING
        self.siblings = list(siblings)  # the other choices of an n > 1 request, until released
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.constraint = constraint  # its grammar, for telling a dead end from a broken mask
        self.matcher: Any = constraint.new_matcher() if constraint else None  # an xgrammar GrammarMatcher
        self.closer = constraint.closer if constraint else None
        self.num_closing_tokens = 0  # tokens the wind-down chose to close the grammar in time
        # token ids the output must end with before the matcher applies (a reasoning end tag); () once it has
        self.grammar_gate: tuple[int, ...] = request.reasoning_end_ids if constraint else ()
        self.reasoning_budget = request.reasoning_budget  # None once the reasoning block has closed
        # prompt logprobs: top alternatives asked for (None: not asked); entry i is prompt token i's,
        # from the logits at position i - 1 (None for the first); sent once, on the first delta
        self.num_prompt_logprobs = params.prompt_logprobs
        self.prompt_logprobs: list[Logprob | None] = [None] if params.prompt_logprobs is not None else []
        self.prompt_logprobs_sent = params.prompt_logprobs is None
        # speculative decoding: the next draft's length (0: the most; it adapts to acceptance), steps
        # to go without one (after drafts wholly rejected in a row), and the request's draft tokens
        # verified and accepted
        self.num_speculative_tokens = 0
        self.num_rejected_drafts = 0  # wholly rejected in a row
        self.num_steps_without_draft = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.draft_context: np.ndarray | None = None  # token_ids as int64 for the drafts, spare room after
        self.num_draft_context = 0  # of token_ids, copied there
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
    def num_unscheduled_tokens(self) -> int:
        """Tokens no step has taken yet, placeholders included (async scheduling); with no step in
        flight, ``num_uncomputed_tokens``."""
        return len(self.token_ids) + self.num_placeholders - self.num_computed_tokens - self.num_scheduled_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not all computed: no prefix-cache hit may skip their rows."""
        return not self.prompt_logprobs_sent and len(self.prompt_logprobs) < self.num_prompt_tokens

    def take_prompt_logprobs(self) -> list[Logprob | None] | None:
        """The prompt logprobs, the first time (for the choice's first delta); None after, or if not asked."""
        if self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        out, self.prompt_logprobs = self.prompt_logprobs, []
        return out

    @property
    def active_matcher(self) -> Any:
        """The matcher constraining the next token, or None."""
        return None if self.grammar_gate else self.matcher

    @property
    def closing(self) -> Closing | None:
        """Within ``WIND_DOWN_TOKENS`` of its max_tokens with its grammar applying: the room the output
        side keeps to close the grammar (``output_processor.decide``); None before, and without a grammar."""
        num_left = self.max_tokens - self.num_output_tokens
        if self.active_matcher is None or num_left > WIND_DOWN_TOKENS:
            return None
        assert not self.num_placeholders, "a constrained sequence never runs ahead: its count is exact"
        return Closing(self.closer, num_left)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
