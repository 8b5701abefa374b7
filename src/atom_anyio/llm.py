"""The offline API, shaped like vLLM's: ``LLM(...).generate`` and ``.chat``.

Each call runs the same async engine loop the server runs, inside
``anyio.run``; the model, KV pool and prefix cache persist across calls.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import anyio

from atom_anyio.config import env_setting
from atom_anyio.engine.core import Engine
from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.stream import ChoiceDelta, Logprob, collect
from atom_anyio.models.loader import LoadedModel, load_planned
from atom_anyio.models.plan import plan_model
from atom_anyio.obs.logging import log_to_stderr_by_default
from atom_anyio.obs.loop_health import release_freed_memory
from atom_anyio.prompt.prepare import PrepareContext, PromptRequest, prepare_prompt
from atom_anyio.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Logprob] | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprob | None] | None = None  # SamplingParams.prompt_logprobs: None for the first token

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


PromptInput = str | list[int] | dict[str, Any]


class LLM:
    """``LLM(model=None)`` serves the default model (SmolLM2-135M-Instruct)."""

    def __init__(
        self,
        model: str | LoadedModel | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        attention_backend: str | None = None,
        tensor_parallel_size: int = 1,
        gguf_weights: str | None = None,
        batch_invariant: bool | None = None,
        hf_overrides: dict[str, Any] | None = None,
        **engine_kwargs: Any,
    ):
        log_to_stderr_by_default()
        if isinstance(model, LoadedModel) and (plan := model.plan) is not None:
            # the kernel switches it was loaded with, unless given (the Engine refuses a disagreement)
            engine_kwargs = {"cpu_native_kernels": plan.native_kernels, "cpu_amx": plan.amx, **engine_kwargs}
        cfg = EngineConfig(**engine_kwargs, tensor_parallel_size=tensor_parallel_size)
        if isinstance(model, LoadedModel):
            self.loaded = model
        else:
            if batch_invariant is None:  # ATOM_BATCH_INVARIANT; unset: auto (batch_invariant_auto_reason)
                batch_invariant = env_setting("batch_invariant")
            plan = plan_model(
                model,
                dtype,
                device,
                attention_backend or env_setting("attention_backend"),  # ATOM_ATTENTION_BACKEND
                tensor_parallel_size,
                gguf_weights or env_setting("gguf_weights") or "auto",  # ATOM_GGUF_WEIGHTS
                batch_invariant,
                hf_overrides if hf_overrides is not None else env_setting("hf_overrides"),
                cfg.cpu_native_kernels,
                cfg.cpu_amx,
            )
            self.loaded = load_planned(plan)
        self.engine = Engine(self.loaded, cfg)
        self.tokenizer = self.loaded.tokenizer
        self.prepare_ctx = PrepareContext.for_engine(
            self.engine, self.tokenizer, chat_template=self.loaded.chat_template
        )
        release_freed_memory()  # what loading freed goes back to the system

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete text prompts, token-id lists or ``{"prompt_token_ids": [...]}``."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = []
        for p in prompts:
            if isinstance(p, str):
                requests.append({"prompt": p})
            elif isinstance(p, dict):
                requests.append({"prompt_token_ids": list(p["prompt_token_ids"])})
            else:
                requests.append({"prompt_token_ids": list(p)})
        return self._run(requests, params, use_tqdm)

    def chat(
        self,
        conversations: list[dict[str, Any]] | Seq[list[dict[str, Any]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation or a list of them, through the chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        chat = {"tools": tools, "chat_template_kwargs": chat_template_kwargs}
        requests = [
            {"messages": list(conv), "add_generation_prompt": add_generation_prompt, **chat} for conv in conversations
        ]
        return self._run(requests, params, use_tqdm)

    def _run(self, requests: list[dict[str, Any]], params, use_tqdm: bool) -> list[RequestOutput]:
        """Prepare every prompt (``PromptRequest`` fields) the way the server does (render, segment
        cache, hashes, context rules, validation), then run them all through the engine loop."""
        params = params or SamplingParams(**self.loaded.generation_defaults)  # the model's, as vLLM's LLM
        per_item = list(params) if isinstance(params, Seq) else [params] * len(requests)
        if len(per_item) != len(requests):
            raise ValueError("give one SamplingParams, or one per prompt")
        items = []
        for fields, sp in zip(requests, per_item, strict=True):
            prepared = prepare_prompt(PromptRequest(**fields, params=sp), self.prepare_ctx)  # PromptError: refused
            items.append((prepared.text, prepared.request))
        return anyio.run(self._generate_all, items, use_tqdm)

    async def _generate_all(self, items, use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        results: list[RequestOutput | None] = [None] * len(items)
        bar = tqdm(total=len(items), desc="generate", disable=not use_tqdm or len(items) < 2)
        async with anyio.create_task_group() as tg:
            await tg.start(self.engine.run)
            async with anyio.create_task_group() as requests:
                for i, (text, request) in enumerate(items):
                    requests.start_soon(self._collect, i, text, request, results, bar)
            tg.cancel_scope.cancel()
        bar.close()
        return results  # type: ignore[return-value]

    async def _collect(self, i, text, request, results, bar) -> None:
        choices = await collect(self.engine.submit(request), request.params.n)
        wants_logprobs = request.params.logprobs is not None
        outs = [_output(k, d, wants_logprobs) for k, d in enumerate(choices)]
        cached = max((d.num_cached_tokens for d in choices if d is not None), default=0)
        prompt_logprobs = next((d.prompt_logprobs for d in choices if d is not None and d.prompt_logprobs), None)
        results[i] = RequestOutput(text, request.prompt_token_ids, outs, cached, prompt_logprobs)
        bar.update(1)


def _output(index: int, d: ChoiceDelta | None, wants_logprobs: bool) -> CompletionOutput:
    if d is None:
        return CompletionOutput(index=index, logprobs=[] if wants_logprobs else None)
    logprobs = (d.logprobs or []) if wants_logprobs else None
    return CompletionOutput(index, d.text, d.token_ids, d.finish_reason, d.stop_reason, logprobs, d.error)
