"""Prompt preparation: chat rendering, the segment cache, and the context rules."""

from __future__ import annotations

import gc
import json
import logging
import os

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from atom_anyio.engine.block_hash import block_hash_chain
from atom_anyio.prompt.prepare import PrepareContext, PromptError, PromptRequest, prepare_prompt
from atom_anyio.prompt.render import compile_chat_template, render_chat
from atom_anyio.prompt.segment_cache import SegmentCache
from atom_anyio.sampling_params import SamplingParams

# Qwen2.5-style ChatML with tools, reasoning and an enable_thinking switch.
CHATML_TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.reasoning_content %}{{- '\\n<think>\\n' + message.reasoning_content + '\\n</think>\\n' }}{%- endif %}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role != 'system' %}
{{- raise_exception('Unknown role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file from the workspace.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 2024.",
    "def read_file(path):\n    with open(path) as f:\n        return f.read()\n\nclass Agent:\n    pass\n",
    '{"name": "read_file", "arguments": {"path": "/src/main.py"}}\n<tool_response>ok</tool_response>',
    "你好，世界。日本語のテキスト。한국어 텍스트. Ünïcödé café naïve — “quotes” 🎉👩‍💻",
    "user\nassistant\nsystem\ntool\n  indented  \t tabs\n\n\nnew paragraph",
]


def _train_tokenizer(pre_tokenizer, decoder, *, extra_specials=()) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer)
    tokenizer.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    tokenizer.add_special_tokens(list(extra_specials))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        chat_template=CHATML_TOOLS_TEMPLATE,
    )


@pytest.fixture(scope="module")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with ChatML specials, a BOS post-processor, non-special added tokens,
    and a Phi-3-style special that eats the whitespace around it."""
    return _train_tokenizer(
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
        extra_specials=[AddedToken("<|end|>", lstrip=True, rstrip=True, special=True)],
    )


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))


def _context(tokenizer, *, max_model_len=100_000, block_size=16, **kwargs) -> PrepareContext:
    return PrepareContext(
        tokenizer=tokenizer,
        segment_cache=SegmentCache(tokenizer),
        max_model_len=max_model_len,
        block_size=block_size,
        **kwargs,
    )


def _special_ids(tokenizer) -> set[int]:
    return {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}


def _reference_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# conversations

_LOOKALIKES = [
    "<|im_start",
    "im_end|>",
    "<|im_end |>",
    "<|IM_START|>",
    "<| im_start|>",
    "<|endoftext",
    "<|im_start|>",  # real specials inside content are specials on both sides
    "<|im_end|>",
    "<|end|>",
    "  <|end|>\n ",
    "<tool_call>",
    "</tool_call",
    "<think>",
    "<s>",
    "[INST]",
    "<repo_name",
    "<jupyter_code>",
]
_FRAGMENTS = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=30),
    st.sampled_from(_LOOKALIKES),
    st.sampled_from([" ", "  ", "\n", "\n\n", "\t", " \n ", "\r\n", "\u00a0", "\u3000", "\u2003"]),
    st.sampled_from(["你好，世界", "🎉👩‍💻", "e\u0301\u0308", "naïve café", "1234567890", "3.14159", "x = f(y)"]),
    st.sampled_from(["def f(x):\n    return x + 1\n", '{"a": [1, 2, {"b": null}]}', "The fox. The dog!"]),
)
_TEXT = st.one_of(
    st.lists(_FRAGMENTS, max_size=10).map("".join),
    st.lists(_FRAGMENTS, min_size=1, max_size=4).map(lambda parts: "".join(parts) * 60),
)


@st.composite
def _conversations(draw) -> list[dict]:
    messages = [{"role": "system", "content": draw(_TEXT)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["user", "assistant", "tool_call", "system"]))
        if kind == "tool_call":
            calls = [
                {
                    "id": f"call_{n}",
                    "type": "function",
                    "function": {
                        "name": "read_file",
                        "arguments": json.dumps({"path": draw(_TEXT)}, ensure_ascii=False),
                    },
                }
                for n in range(draw(st.integers(1, 2)))
            ]
            messages.append({"role": "assistant", "content": draw(_TEXT), "tool_calls": calls})
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": draw(_TEXT)} for c in calls]
        elif kind == "assistant":
            reasoning = draw(st.one_of(st.none(), _TEXT))
            messages.append({"role": "assistant", "content": draw(_TEXT), "reasoning_content": reasoning})
        else:
            messages.append({"role": kind, "content": draw(_TEXT)})
    return messages


# rendering


@pytest.mark.parametrize("template_name", ["chatml_tools", "smollm2"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=_conversations(), use_tools=st.booleans(), add_generation_prompt=st.booleans())
def test_render_matches_transformers_apply_chat_template(
    smollm2_tokenizer, template_name, messages, use_tools, add_generation_prompt
):
    template = CHATML_TOOLS_TEMPLATE if template_name == "chatml_tools" else smollm2_tokenizer.chat_template
    tools = TOOLS if use_tools else None
    expected = smollm2_tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    rendered = render_chat(
        compile_chat_template(template),
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        template_kwargs=smollm2_tokenizer.special_tokens_map,
    )
    assert rendered == expected


def test_template_helpers_match_transformers(tiny_tokenizer):
    template = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson(indent=2) }}{% endgeneration %}\n{% endfor %}"
        "{{ strftime_now('%Y') }} {{ tools | tojson }} {{ custom }}"
    )
    messages = [{"role": "user", "content": "é <b>"}, {"role": "assistant", "content": None}, {"role": "user"}]
    rendered = render_chat(
        compile_chat_template(template),
        messages,
        tools=TOOLS,
        template_kwargs={**tiny_tokenizer.special_tokens_map, "custom": "x"},
    )
    expected = tiny_tokenizer.apply_chat_template(
        messages, tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=True, custom="x"
    )
    assert rendered == expected


def test_continue_final_message_ends_inside_the_last_message(tiny_tokenizer):
    messages = [{"role": "user", "content": "Write a poem."}, {"role": "assistant", "content": "Roses are  "}]
    request = PromptRequest(messages=messages, add_generation_prompt=False, continue_final_message=True)
    prepared = prepare_prompt(request, _context(tiny_tokenizer))
    assert prepared.text.endswith("<|im_start|>assistant\nRoses are  ")
    assert prepared.text == tiny_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert prepared.token_ids == _reference_ids(tiny_tokenizer, prepared.text)


def test_chat_template_kwargs_merge_over_server_defaults(tiny_tokenizer):
    ctx = _context(tiny_tokenizer, default_chat_template_kwargs={"enable_thinking": False})
    messages = [{"role": "user", "content": "hi"}]
    assert prepare_prompt(PromptRequest(messages=messages), ctx).text.endswith("<think>\n\n</think>\n\n")
    request = PromptRequest(messages=messages, chat_template_kwargs={"enable_thinking": True})
    assert prepare_prompt(request, ctx).text.endswith("<|im_start|>assistant\n")


def test_template_rejecting_the_messages_is_a_prompt_error(tiny_tokenizer):
    request = PromptRequest(messages=[{"role": "wizard", "content": "abracadabra"}])
    with pytest.raises(PromptError, match="Unknown role: wizard") as error:
        prepare_prompt(request, _context(tiny_tokenizer))
    assert (error.value.code, error.value.param) == ("invalid_value", "messages")


def test_template_kwargs_cannot_replace_the_messages(tiny_tokenizer):
    request = PromptRequest(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"messages": []})
    with pytest.raises(PromptError) as error:
        prepare_prompt(request, _context(tiny_tokenizer))
    assert error.value.param == "chat_template_kwargs"


def test_context_refuses_a_segment_cache_of_another_tokenizer(tiny_tokenizer, smollm2_tokenizer):
    with pytest.raises(ValueError, match="same tokenizer|this context's tokenizer"):
        PrepareContext(
            tokenizer=tiny_tokenizer,
            segment_cache=SegmentCache(smollm2_tokenizer),
            max_model_len=1000,
            block_size=16,
        )


# segment cache


def _assert_cache_is_exact(tokenizer, warm: SegmentCache, cold: SegmentCache, text: str) -> None:
    expected = _reference_ids(tokenizer, text)
    assert cold.encode(text).token_ids == expected
    assert warm.encode(text).token_ids == expected
    again = warm.encode(text)
    assert again.token_ids == expected
    assert again.num_hit_tokens == sum(1 for i in expected if i not in _special_ids(tokenizer))


@pytest.fixture(scope="module")
def smollm2_caches(smollm2_tokenizer):
    return SegmentCache(smollm2_tokenizer), SegmentCache(smollm2_tokenizer, max_tokens=0)


@pytest.fixture(scope="module")
def tiny_caches(tiny_tokenizer):
    return SegmentCache(tiny_tokenizer), SegmentCache(tiny_tokenizer, max_tokens=0)


@pytest.mark.parametrize("template_name", ["chatml_tools", "smollm2"])
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=_conversations(), use_tools=st.booleans())
def test_segment_cache_equals_full_encode_smollm2(
    smollm2_tokenizer, smollm2_caches, template_name, messages, use_tools
):
    warm, cold = smollm2_caches
    assert warm.is_piecewise
    template = CHATML_TOOLS_TEMPLATE if template_name == "chatml_tools" else smollm2_tokenizer.chat_template
    for end in (len(messages) // 2, len(messages)):  # an earlier turn, then the whole conversation
        text = render_chat(
            compile_chat_template(template),
            messages[: max(end, 1)],
            tools=TOOLS if use_tools else None,
            template_kwargs=smollm2_tokenizer.special_tokens_map,
        )
        _assert_cache_is_exact(smollm2_tokenizer, warm, cold, text)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=_conversations(), use_tools=st.booleans(), raw=st.lists(_FRAGMENTS, max_size=12).map("".join))
def test_segment_cache_equals_full_encode_tiny_tokenizer(tiny_tokenizer, tiny_caches, messages, use_tools, raw):
    warm, cold = tiny_caches
    assert warm.is_piecewise
    text = render_chat(
        compile_chat_template(CHATML_TOOLS_TEMPLATE),
        messages,
        tools=TOOLS if use_tools else None,
        template_kwargs=tiny_tokenizer.special_tokens_map,
    )
    _assert_cache_is_exact(tiny_tokenizer, warm, cold, text)
    _assert_cache_is_exact(tiny_tokenizer, warm, cold, raw)
    assert warm.encode(raw, add_special_tokens=True).token_ids == tiny_tokenizer(raw)["input_ids"]


def test_probe_falls_back_to_full_encodes_when_pieces_are_not_exact(caplog):
    # Metaspace adds its prefix "▁" only at the very start of the text, not after a special token
    tokenizer = _train_tokenizer(pre_tokenizers.Metaspace(prepend_scheme="first"), decoders.Metaspace())
    text = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    with caplog.at_level(logging.WARNING, logger="atom_anyio.prompt.segment_cache"):
        cache = SegmentCache(tokenizer)
    assert not cache.is_piecewise
    assert "segment cache off" in caplog.text
    for _ in range(2):
        tokens = cache.encode(text)
        assert tokens.token_ids == _reference_ids(tokenizer, text)
        assert tokens.num_hit_tokens == 0
    assert cache.encode("hello world", add_special_tokens=True).token_ids == tokenizer("hello world")["input_ids"]


def test_cache_is_bounded_by_tokens_and_evicts_least_recently_used(tiny_tokenizer):
    cache = SegmentCache(tiny_tokenizer, max_tokens=60)
    texts = [f"<|im_start|>user\nmessage number {n}: the quick brown fox<|im_end|>\n" for n in range(8)]
    for text in texts:
        cache.encode(text)
        assert cache.num_cached_tokens <= 60
    assert cache.encode(texts[-1]).num_hit_tokens > 0
    assert cache.encode(texts[0]).num_hit_tokens == 1  # only the "\n" piece is still cached
    cache.encode("<|im_start|>" + "a very long piece " * 40)  # more tokens than the whole cache
    assert 0 < cache.num_cached_tokens <= 60


def test_cached_pieces_add_no_objects_for_the_gc_to_walk(tiny_tokenizer):
    cache = SegmentCache(tiny_tokenizer)
    gc.collect()
    tracked_before = len(gc.get_objects())
    for n in range(2000):
        assert cache.encode(f"<|im_start|>user\nmessage {n}: the river<|im_end|>\n").num_hit_tokens >= 0
    gc.collect()
    assert cache.num_cached_tokens > 2000
    assert len(gc.get_objects()) - tracked_before < 200  # not one per cached piece


# prepare: resending the history


def _agentic_conversation(num_steps: int) -> list[dict]:
    messages = [
        {"role": "system", "content": "You are a coding agent. " * 40},
        {"role": "user", "content": "Fix the failing test in src/app.py."},
    ]
    for step in range(num_steps):
        messages += _agent_step(step)
    return messages


def _agent_step(step: int) -> list[dict]:
    call = {
        "id": f"call_{step}",
        "type": "function",
        "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/module_{step}.py"})},
    }
    code = "".join(f"def function_{step}_{n}(x):\n    return x * {n} + {step}\n\n" for n in range(12))
    return [
        {"role": "assistant", "content": f"Reading module {step}.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": code},
    ]


def test_resent_history_is_served_from_the_segment_cache(tiny_tokenizer):
    ctx = _context(tiny_tokenizer)
    history = _agentic_conversation(20)
    first = prepare_prompt(PromptRequest(messages=history, tools=TOOLS), ctx)
    assert first.num_segment_cache_hit_tokens == 0
    new_messages = _agent_step(20)
    second = prepare_prompt(PromptRequest(messages=history + new_messages, tools=TOOLS), ctx)

    specials = _special_ids(tiny_tokenizer)
    old_text_tokens = sum(1 for i in first.token_ids if i not in specials)
    text_tokens = sum(1 for i in second.token_ids if i not in specials)
    assert second.num_segment_cache_hit_tokens >= old_text_tokens
    new_tokens = sum(len(_reference_ids(tiny_tokenizer, json.dumps(m))) for m in new_messages)
    assert text_tokens - second.num_segment_cache_hit_tokens <= new_tokens  # only the new messages were encoded
    assert second.token_ids == _reference_ids(tiny_tokenizer, second.text)
    assert second.token_ids[: len(first.token_ids) - 3] == first.token_ids[:-3]  # "<|im_start|>assistant\n"


# prepare: the context rules


def _chat(n: int) -> list[dict]:
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(n):
        messages.append({"role": "user", "content": f"Question {i}: what is {i} times {i}? " * 3})
        messages.append({"role": "assistant", "content": f"It is {i * i}. " * 3})
    messages.append({"role": "user", "content": "And the last question?"})
    return messages


def _num_tokens(tokenizer, messages, **kwargs) -> int:
    return len(prepare_prompt(PromptRequest(messages=messages, **kwargs), _context(tokenizer)).token_ids)


def test_prompt_that_fits_is_unchanged_and_max_tokens_defaults_to_the_rest(tiny_tokenizer):
    ctx = _context(tiny_tokenizer, max_model_len=4096, block_size=4)
    messages = _chat(5)
    prepared = prepare_prompt(PromptRequest(messages=messages), ctx)
    expected_text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prepared.text == expected_text
    assert prepared.token_ids == _reference_ids(tiny_tokenizer, expected_text)
    assert prepared.request.max_tokens == 4096 - len(prepared.token_ids)
    assert prepared.request.block_hashes == block_hash_chain(prepared.token_ids, 4)
    assert len(prepared.request.block_hashes) == len(prepared.token_ids) // 4
    assert (
        prepare_prompt(PromptRequest(messages=messages, params=SamplingParams(max_tokens=7)), ctx).request.max_tokens
        == 7
    )


def test_max_tokens_past_the_context_is_clamped_to_the_rest_of_it(tiny_tokenizer):
    messages = _chat(10)
    num_prompt = _num_tokens(tiny_tokenizer, messages)
    ctx = _context(tiny_tokenizer, max_model_len=num_prompt + 50)
    for asked, granted in ((50, 50), (51, 50), (32000, 50)):
        request = PromptRequest(messages=messages, params=SamplingParams(max_tokens=asked))
        assert prepare_prompt(request, ctx).request.max_tokens == granted
    small_pool = _context(tiny_tokenizer, max_model_len=num_prompt + 50, max_kv_tokens=num_prompt + 10)
    request = PromptRequest(messages=messages, params=SamplingParams(max_tokens=32000))
    assert prepare_prompt(request, small_pool).request.max_tokens == 10


def test_prompt_that_leaves_no_room_is_a_400_in_both_apis_words(tiny_tokenizer):
    messages = _chat(10)
    num_prompt = _num_tokens(tiny_tokenizer, messages)
    ctx = _context(tiny_tokenizer, max_model_len=num_prompt)
    with pytest.raises(PromptError) as error:
        prepare_prompt(PromptRequest(messages=messages, params=SamplingParams(max_tokens=32000)), ctx)
    assert (error.value.code, error.value.param) == ("context_length_exceeded", "messages")
    assert f"maximum context length is {num_prompt} tokens" in error.value.message
    # Anthropic's wording, which Claude Code parses to compact the conversation and retry
    assert error.value.anthropic_message == f"prompt is too long: {num_prompt} tokens > {num_prompt - 1} maximum"


def test_max_tokens_past_the_context_is_refused_when_clamping_is_off(tiny_tokenizer):
    messages = _chat(10)
    num_prompt = _num_tokens(tiny_tokenizer, messages)
    ctx = _context(tiny_tokenizer, max_model_len=num_prompt + 50, clamp_max_tokens=False)
    assert (
        prepare_prompt(PromptRequest(messages=messages, params=SamplingParams(max_tokens=50)), ctx).request.max_tokens
        == 50
    )
    with pytest.raises(PromptError) as error:
        prepare_prompt(PromptRequest(messages=messages, params=SamplingParams(max_tokens=51)), ctx)
    assert (error.value.code, error.value.param) == ("context_length_exceeded", "messages")
    assert f"maximum context length is {num_prompt + 50} tokens" in error.value.message
    assert f"you requested {num_prompt + 51} tokens ({num_prompt} in the messages, 51 in the completion)" in str(
        error.value
    )
    assert error.value.anthropic_message == (
        f"input length and `max_tokens` exceed context limit: {num_prompt} + 51 > {num_prompt + 50}, "
        "decrease input length or `max_tokens` and try again"
    )


def test_prompt_filling_the_whole_context_is_refused(tiny_tokenizer):
    prompt = "the quick brown fox " * 20
    num_prompt = len(tiny_tokenizer(prompt)["input_ids"])
    ctx = _context(tiny_tokenizer, max_model_len=num_prompt)
    with pytest.raises(PromptError, match=f"{num_prompt} in the prompt, 1 in the completion") as error:
        prepare_prompt(PromptRequest(prompt=prompt), ctx)
    assert error.value.param == "prompt"


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_tokenizer):
    messages = _chat(10)
    full = prepare_prompt(PromptRequest(messages=messages), _context(tiny_tokenizer))
    ctx = _context(tiny_tokenizer, max_model_len=200)
    prepared = prepare_prompt(
        PromptRequest(messages=messages, truncate_prompt_tokens=150, params=SamplingParams(max_tokens=50)), ctx
    )
    assert prepared.token_ids == full.token_ids[-150:]
    assert prepared.text == tiny_tokenizer.decode(full.token_ids[-150:])
    assert prepared.request.block_hashes == block_hash_chain(prepared.token_ids, 16)
    fitted = prepare_prompt(
        PromptRequest(messages=messages, truncate_prompt_tokens=-1, params=SamplingParams(max_tokens=20)), ctx
    )
    assert fitted.token_ids == full.token_ids[-180:]
    cut_short = prepare_prompt(  # the completion gets what the cut prompt leaves
        PromptRequest(messages=messages, truncate_prompt_tokens=150, params=SamplingParams(max_tokens=51)), ctx
    )
    assert (cut_short.num_prompt_tokens, cut_short.request.max_tokens) == (150, 50)
    with pytest.raises(PromptError) as error:  # or, with clamping off, no room for the completion
        prepare_prompt(
            PromptRequest(messages=messages, truncate_prompt_tokens=150, params=SamplingParams(max_tokens=51)),
            _context(tiny_tokenizer, max_model_len=200, clamp_max_tokens=False),
        )
    assert error.value.code == "context_length_exceeded"


@pytest.mark.parametrize("policy", ["server", "request"])
def test_drop_oldest_keeps_system_and_latest_turn_and_fits(tiny_tokenizer, policy):
    messages = _chat(30)
    num_prompt = _num_tokens(tiny_tokenizer, messages)
    max_model_len = num_prompt // 2
    if policy == "server":
        ctx = _context(tiny_tokenizer, max_model_len=max_model_len, context_overflow="drop_oldest")
        request = PromptRequest(messages=messages, params=SamplingParams(max_tokens=32))
    else:
        ctx = _context(tiny_tokenizer, max_model_len=max_model_len)
        request = PromptRequest(messages=messages, params=SamplingParams(max_tokens=32), truncation="auto")
    prepared = prepare_prompt(request, ctx)

    assert len(prepared.token_ids) + 32 <= max_model_len
    num_dropped = prepared.num_dropped_messages
    assert num_dropped > 0
    kept = messages[:1] + messages[1 + num_dropped :]  # the system message and everything after the dropped
    assert prepared.token_ids == _reference_ids(
        tiny_tokenizer, tiny_tokenizer.apply_chat_template(kept, tokenize=False, add_generation_prompt=True)
    )
    assert prepared.text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert prepared.text.endswith("And the last question?<|im_end|>\n<|im_start|>assistant\n")
    assert prepared.request.block_hashes == block_hash_chain(prepared.token_ids, 16)
    one_fewer = messages[:1] + messages[num_dropped:]  # no more was dropped than needed
    assert _num_tokens(tiny_tokenizer, one_fewer) + 32 > max_model_len


def test_drop_oldest_keeps_a_tool_result_with_its_call(tiny_tokenizer):
    messages = _agentic_conversation(10)
    num_latest = _num_tokens(tiny_tokenizer, messages[:1] + messages[-2:], tools=TOOLS)
    ctx = _context(tiny_tokenizer, max_model_len=num_latest + 1, context_overflow="drop_oldest")
    prepared = prepare_prompt(PromptRequest(messages=messages, tools=TOOLS), ctx)
    assert prepared.num_dropped_messages == len(messages) - 3
    assert '"name": "read_file", "arguments": {"path": "src/module_9.py"}' in prepared.text
    assert len(prepared.token_ids) == num_latest


def test_drop_oldest_that_cannot_fit_is_refused(tiny_tokenizer):
    messages = _chat(10)
    messages[-1] = {"role": "user", "content": "a long last question " * 50}
    num_latest = _num_tokens(tiny_tokenizer, messages[:1] + messages[-1:])
    ctx = _context(tiny_tokenizer, max_model_len=num_latest, context_overflow="drop_oldest")
    with pytest.raises(PromptError, match="after dropping the 20 oldest messages") as error:
        prepare_prompt(PromptRequest(messages=messages), ctx)
    assert error.value.code == "context_length_exceeded"
    assert f"({num_latest} in the messages, 1 in the completion)" in error.value.message


def test_a_cut_under_a_max_tokens_of_the_whole_context_leaves_the_rest_to_the_completion(tiny_tokenizer):
    ctx = _context(tiny_tokenizer, max_model_len=1000, context_overflow="drop_oldest")
    prepared = prepare_prompt(PromptRequest(messages=_chat(100), params=SamplingParams(max_tokens=5000)), ctx)
    assert prepared.num_dropped_messages > 0
    assert prepared.num_prompt_tokens + prepared.request.max_tokens == 1000


@pytest.mark.parametrize(
    "request_kwargs",
    [
        {"params": SamplingParams(max_tokens=1000)},  # cap 0
        {"params": SamplingParams(max_tokens=5000)},  # cap < 0
        {"params": SamplingParams(max_tokens=1000), "truncate_prompt_tokens": -1},
        {"truncation": "disabled"},  # the request overrides the server's drop_oldest
    ],
)
def test_impossible_cuts_are_refused(tiny_tokenizer, request_kwargs):
    """With clamping off, a cut that leaves no room for the completion asked for."""
    ctx = _context(tiny_tokenizer, max_model_len=1000, context_overflow="drop_oldest", clamp_max_tokens=False)
    with pytest.raises(PromptError) as error:
        prepare_prompt(PromptRequest(messages=_chat(100), **request_kwargs), ctx)
    assert error.value.code == "context_length_exceeded"


@pytest.mark.parametrize(
    ("request_kwargs", "param"),
    [
        ({"messages": []}, "messages"),
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": []}, "prompt"),
        ({"prompt_token_ids": [1, 10**9]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ({"prompt": "hi", "params": SamplingParams(stop_token_ids=[10**9])}, "stop_token_ids"),
        ({"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"prompt": "hi", "truncation": "middle"}, "truncation"),
    ],
)
def test_invalid_prompts_are_refused(tiny_tokenizer, request_kwargs, param):
    with pytest.raises(PromptError) as error:
        prepare_prompt(PromptRequest(**request_kwargs), _context(tiny_tokenizer))
    assert (error.value.code, error.value.param) == ("invalid_value", param)


def test_completion_prompts_tokenize_like_the_tokenizer(tiny_tokenizer):
    ctx = _context(tiny_tokenizer)
    prompt = "def f(x):\n    return x<|im_end|> 你好"
    prepared = prepare_prompt(PromptRequest(prompt=prompt), ctx)
    assert prepared.token_ids == tiny_tokenizer(prompt)["input_ids"]
    assert prepared.token_ids[0] == tiny_tokenizer.bos_token_id
    assert prepared.text == prompt
    by_ids = prepare_prompt(PromptRequest(prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=3)), ctx)
    assert (by_ids.token_ids, by_ids.text, by_ids.request.max_tokens) == ([5, 6, 7], None, 3)


# prepare from a worker thread


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_prepare_runs_in_a_worker_thread(tiny_tokenizer):
    ctx = _context(tiny_tokenizer)
    limiter = anyio.CapacityLimiter(2)
    requests = [PromptRequest(messages=_chat(n)) for n in range(1, 9)]
    results = [None] * len(requests)

    async def prepare(i: int) -> None:
        results[i] = await anyio.to_thread.run_sync(prepare_prompt, requests[i], ctx, limiter=limiter)

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(prepare, i)
    for request, prepared in zip(requests, results, strict=True):
        assert prepared.token_ids == _reference_ids(tiny_tokenizer, prepared.text)
        assert prepared.text == tiny_tokenizer.apply_chat_template(
            request.messages, tokenize=False, add_generation_prompt=True
        )


def test_a_template_that_reads_no_tools_has_its_calls_parsed_in_the_default_format(tiny_tokenizer):
    """The tiny tokenizer's ChatML reads no ``tools``: they are rendered in, and parsed as, Hermes."""
    assert _context(tiny_tokenizer, tool_call_parser="auto").parser_spec.tool_format == "hermes"
    reads_them = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}{{ messages[0]['content'] }}"
    ctx = _context(tiny_tokenizer, chat_template=reads_them, tool_call_parser="auto")
    assert ctx.parser_spec.tool_format is None
