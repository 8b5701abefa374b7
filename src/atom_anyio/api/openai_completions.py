"""POST /v1/completions."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint

from atom_anyio.api.generation import GenerationStream
from atom_anyio.api.http import kv_lease, parse_body, sse
from atom_anyio.api.openai_chat import OpenAIEncoder, openai_finish_reason
from atom_anyio.api.openai_schemas import CompletionRequest
from atom_anyio.api.runtime import Runtime
from atom_anyio.api.structured import only_one
from atom_anyio.engine.stream import ChoiceDelta, Logprob, RequestStream, collect
from atom_anyio.prompt.prepare import PreparedPrompt, PromptRequest


def completions_blueprint(rt: Runtime) -> Blueprint:
    bp = Blueprint("openai_completions", __name__)

    @bp.post("/v1/completions")
    async def completions() -> Any:
        req = await parse_body(CompletionRequest)
        rt.check_model(req.model)
        structured = only_one(*req.vllm_structured())
        params = req.sampling_params(req.max_tokens, req.logprobs, defaults=rt.loaded.generation_defaults)
        prompts = [
            PromptRequest(
                prompt=p if isinstance(p, str) else None,
                prompt_token_ids=None if isinstance(p, str) else p,
                params=params,  # one for every prompt: read, never changed
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                structured=structured,
                lease=kv_lease(req.prompt_cache_key),
                cache_salt=req.cache_salt,
                priority=req.priority,
            )
            for p in req.prompts()
        ]
        encoder_for = functools.partial(CompletionEncoder, rt, req)
        return await rt.generate(prompts, is_stream=req.stream, encoder_for=encoder_for)

    return bp


class CompletionEncoder(OpenAIEncoder):
    """Engine deltas -> text_completion objects."""

    id_prefix = "cmpl-"
    object_name = chunk_object_name = "text_completion"

    def __init__(self, rt: Runtime, req: CompletionRequest, prepared: list[PreparedPrompt]):
        super().__init__(rt, req)
        # usage counts every prompt; Usage.add() only raises it to one prompt's count
        self.usage.prompt_tokens = sum(p.num_prompt_tokens for p in prepared)
        self.prompt_texts = [p.text or "" for p in prepared]
        self.first_prompt_tokens = [p.token_ids[0] for p in prepared]
        if req.echo:
            decode = rt.loaded.tokenizer.decode
            self.prompt_texts = [p.text if p.text is not None else decode(p.token_ids) for p in prepared]
        self.num_choices = len(prepared) * req.n

    def logprobs(self, lps: list[Logprob | None], offset: int, first_token: int = -1) -> dict[str, Any]:
        """OpenAI's legacy shape; ``None`` entries (the echoed prompt's first token) have no logprob.
        Each position's alternatives include its own token, as OpenAI's and vLLM's do."""
        tokens, values, tops, offsets = [], [], [], []
        for lp in lps:
            text, _ = self.token_text(lp.token_id if lp is not None else first_token)
            tokens.append(text)
            values.append(lp.logprob if lp is not None else None)
            if lp is None:
                tops.append(None)
            else:
                top = {self.token_text(t)[0]: v for t, v in lp.top}
                top.setdefault(text, lp.logprob)
                tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _echo(self, index: int) -> str:
        return self.prompt_texts[index // self.req.n] if self.req.echo else ""

    def _choice_logprobs(self, d: ChoiceDelta, offset: int, *, first: bool) -> dict[str, Any] | None:
        """The logprobs of a choice's delta: with echo, its first one leads with the prompt's."""
        if self.req.logprobs is None:
            return None
        lps: list[Logprob | None] = list(d.logprobs or [])
        if first and self.req.echo and d.prompt_logprobs:
            lps = [*d.prompt_logprobs, *lps]
        if not lps and not first:
            return None
        return self.logprobs(lps, offset, self.first_prompt_tokens[d.index // self.req.n])

    def _prompt_logprobs(self, d: ChoiceDelta) -> dict[str, Any]:
        """vLLM's ``prompt_logprobs`` on a choice, when the request asked for them."""
        if self.req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": self.vllm_prompt_logprobs(d.prompt_logprobs or [])}

    async def response(self, stream: RequestStream) -> dict[str, Any]:
        choices = await collect(GenerationStream(stream, self.usage, self.num_choices), self.num_choices)
        return self.envelope([self._choice(c) for c in choices])

    def _choice(self, c: ChoiceDelta) -> dict[str, Any]:
        return {
            "index": c.index,
            "text": self._echo(c.index) + c.text,
            "logprobs": self._choice_logprobs(c, 0, first=True),
            "finish_reason": openai_finish_reason(c.finish_reason),
            "stop_reason": c.stop_reason,
            **self._prompt_logprobs(c),
        }

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        offsets = [0] * self.num_choices
        echoed: set[int] = set()
        async with GenerationStream(stream, self.usage, self.num_choices) as deltas:
            async for d in deltas:
                text = d.text
                first = d.index not in echoed
                if first:
                    echoed.add(d.index)
                    text = self._echo(d.index) + text
                choice = {
                    "index": d.index,
                    "text": text,
                    "logprobs": self._choice_logprobs(d, offsets[d.index], first=first),
                    "finish_reason": openai_finish_reason(d.finish_reason),
                }
                offsets[d.index] += len(text)
                yield sse(self.chunk([choice]))
        for event in self.usage_chunk_and_done():
            yield event
