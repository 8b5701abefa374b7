"""What the engine accepts: one typed request per prompt, validated before it arrives."""

from __future__ import annotations

from dataclasses import dataclass

from atom_anyio.engine.block_hash import ROOT_HASH, block_hash_chain
from atom_anyio.engine.grammar import Constraint
from atom_anyio.sampling_params import SamplingParams


@dataclass(frozen=True)
class ReasoningBudget:
    """After ``num_tokens`` output tokens with the reasoning block still open, the next tokens are
    ``end_token_ids`` (the block's end tag), whatever the model samples; then the answer follows."""

    num_tokens: int
    end_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVLease:
    """How a finished request's KV should outlast it (``block_manager``'s leases): for its
    conversation ``key`` (a prompt_cache_key, a session header; None: the request alone), for
    ``ttl_s`` seconds (None: the server's ``kv_lease_ttl_s``; 0: no lease)."""

    key: str | None = None
    ttl_s: float | None = None


@dataclass(frozen=True)
class EngineRequest:
    """One prompt and how to continue it. Built once by ``prompt.prepare.prepare_prompt``, where it
    is checked against the context, the KV pool and the vocabulary; the engine only asserts."""

    prompt_token_ids: list[int]
    block_hashes: list[int]  # block_hash_chain(prompt_token_ids, block_size)
    params: SamplingParams  # as the request asked (params.max_tokens None: the rest of the context)
    max_tokens: int  # resolved once: the request's, or the rest of the context; 0: prefill only
    constraint: Constraint | None = None  # a compiled grammar every choice's output follows
    # the prompt leaves a reasoning block open: the tokens of its end tag (the grammar waits for them,
    # a reasoning budget forces them); (): it does not
    reasoning_end_ids: tuple[int, ...] = ()
    lease: KVLease = KVLease()
    root_hash: int = ROOT_HASH  # the block-hash chain's root: salted_root(cache_salt)
    priority: int = 0  # vLLM's: under scheduling_policy=priority, lower is scheduled first

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def reasoning_budget(self) -> ReasoningBudget | None:
        """The request's reasoning budget, where the prompt leaves a reasoning block open to spend it in."""
        if self.params.reasoning_budget is None or not self.reasoning_end_ids:
            return None
        return ReasoningBudget(self.params.reasoning_budget, self.reasoning_end_ids)

    @classmethod
    def of_tokens(
        cls, token_ids: list[int], params: SamplingParams, engine, constraint: Constraint | None = None
    ) -> EngineRequest:
        """For driving an ``Engine`` directly (benchmarks, tests): hashes and max_tokens filled in the
        way ``prompt.prepare`` does. Nothing is checked: the caller keeps within the engine's limits."""
        max_tokens = engine.max_model_len - len(token_ids) if params.max_tokens is None else params.max_tokens
        hashes = block_hash_chain(token_ids, engine.cfg.block_size)
        return cls(list(token_ids), hashes, params, max_tokens, constraint)
