"""OpenAI request bodies (chat completions, completions), validated with pydantic."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from atom_anyio.api.errors import APIError
from atom_anyio.api.structured import bad, forced_tools, only_one, response_format, vllm_structured
from atom_anyio.generation_defaults import with_defaults
from atom_anyio.parse import ParserSpec
from atom_anyio.sampling_params import SamplingParams, StructuredOutputs


class Lenient(BaseModel):
    """Unknown fields are ignored, as the official API's clients send many. Known fields are
    strict: a boolean or a numeric string is not a number, as the official APIs answer."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(Lenient):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # every chunk carries the usage so far (vLLM's)


class FunctionDef(Lenient):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class SamplingFields(Lenient):
    """The sampling fields chat completions and completions share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)  # at most limits.MAX_N, checked on the body
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # the sampler holds it in an int64 tensor
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    user: str | None = None
    prompt_cache_key: str | None = None  # OpenAI's: the conversation whose KV lease the request renews
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: a tenant's prefix hits kept from another's
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # vLLM's: lower first, under scheduling_policy=priority
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's structured outputs, and its legacy fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the logprob of every prompt token (and this many alternatives), in the response's top level
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> SamplingFields:
        if self.prompt_logprobs is not None and self.stream:
            raise bad("prompt_logprobs", "prompt logprobs are not available when 'stream' is true")
        return self

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not k.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"bias for token {k} must be between -100 and 100")
        return v

    def vllm_structured(self) -> list[StructuredOutputs | None]:
        guided = {k: getattr(self, k) for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")}
        return vllm_structured(self.structured_outputs, guided)

    @property
    def wants_usage_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def wants_usage_on_every_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def sampling_params(
        self,
        max_tokens: int | None,
        num_logprobs: int | None,
        *,
        defaults: Mapping[str, Any],
        keep_special_tokens: bool = False,
    ) -> SamplingParams:
        """``max_tokens`` None: the rest of the context (prompt preparation resolves it).
        ``defaults``: the model's (``LoadedModel.generation_defaults``), for the fields left out.
        ``keep_special_tokens``: the output parsers read special tokens (``ParserSpec.decodes_special_tokens``)."""
        return SamplingParams(
            n=self.n,
            **with_defaults(
                defaults,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
            ),
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=num_logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,  # validated into a list
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens and not keep_special_tokens,
        )


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, call in enumerate(v or []):
            if not isinstance(call.get("function"), dict):
                raise ValueError(f"tool call {i} needs a 'function' object")
        return v


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    response_format: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError("must be none, auto, required or a named function")
        return v

    def structured(self, spec: ParserSpec) -> StructuredOutputs | None:
        """The request's one output constraint: a response format, vLLM's fields or a forced tool call."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        forced = forced_tools(spec, tools, self.forced_tool, parallel=self.parallel_tool_calls is not False)
        return only_one(response_format(self.response_format), *self.vllm_structured(), forced)

    @property
    def forced_tool(self) -> str | None:
        """``"required"``, a named function, or None when the model may answer without a call."""
        choice = self.tool_choice
        if not self.tools or choice in (None, "none", "auto"):
            return None
        if choice == "required":
            return choice
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise bad("tool_choice", 'a named tool choice is {"type": "function", "function": {"name": ...}}')
        return name

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs``, with ``reasoning_effort`` onto the template's thinking switch
        (as Responses' ``reasoning.effort``); an explicit ``enable_thinking`` wins."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"enable_thinking": thinking_enabled(self.reasoning_effort), **(self.chat_template_kwargs or {})}

    def flat_messages(self) -> list[dict[str, Any]]:
        """Messages with content flattened to text; other parts are refused."""
        out = []
        for i, m in enumerate(self.messages):
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                msg["content"] = text_of_parts(m.content, f"messages.{i}.content")
            if msg.get("tool_calls"):
                msg["tool_calls"] = [parse_arguments(c) for c in msg["tool_calls"]]
            out.append(msg)
        return out


def thinking_enabled(effort: str) -> bool:
    """A reasoning effort as the chat template's one switch: "none" and "minimal" turn thinking off."""
    return effort not in ("none", "minimal")


def text_of_parts(parts: list[dict[str, Any]], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        if kind in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise APIError(
                    400, f"'{where}.{j}.text' must be a string", param=f"{where}.{j}.text", code="invalid_value"
                )
            texts.append(part["text"])
        elif kind in ("image_url", "input_image", "input_audio", "file", "video_url"):
            raise APIError(
                400,
                f"'{where}.{j}' is a {kind} part; this model is text-only and accepts only text parts",
                param=f"{where}.{j}.type",
                code="unsupported_content",
            )
        else:
            raise APIError(
                400,
                f"'{where}.{j}.type' {kind!r} is not a known content part type",
                param=f"{where}.{j}.type",
                code="invalid_value",
            )
    return "\n".join(texts)


def parse_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """Templates expect tool-call arguments as a mapping; OpenAI sends a JSON string."""
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(json.JSONDecodeError):  # else leave it as the client sent it
            fn["arguments"] = json.loads(args) if args.strip() else {}
    return {**call, "function": fn}


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 with echo: the prompt alone (and its logprobs)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)  # with echo, the prompt's tokens' too
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list) -> str | list:
        if isinstance(v, list) and (not v or any(isinstance(x, list) and not x for x in v)):
            raise ValueError("must not be empty")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported by this server (no fill-in-the-middle support)")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of is not supported; use n")
        return v

    @model_validator(mode="after")
    def _no_output_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise bad("max_tokens", "0 asks for no completion, which is only meaningful with 'echo' (the prompt alone)")
        return self

    @property
    def num_prompt_logprobs(self) -> int | None:
        """vLLM's ``prompt_logprobs``, else with ``echo`` the ``logprobs`` of the echoed prompt (as vLLM)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]
