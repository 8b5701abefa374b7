"""GPT-OSS's harmony format: the shipped harmony template, the streaming parser for its channels
and calls, and the chat, messages and responses endpoints over a tiny model whose tokenizer has
the harmony special tokens (a ScriptedSampler writes the harmony output)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers
from support_fakes import scripted
from support_models import TINY_TOKENIZER
from support_servers import serving_app

from atom_anyio.models.loader import load_model
from atom_anyio.parse import OutputParser, ParserSpec
from atom_anyio.parse.harmony import HarmonyParser
from atom_anyio.templates import template_path

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
HARMONY = ParserSpec(tool_format="harmony", is_harmony=True)
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. I call the tool.<|end|>"
CALL_HEADER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
CALL = f"{ANALYSIS}{CALL_HEADER}{ARGUMENTS}<|call|>"
ANSWER = f"{ANALYSIS}<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def parse(text: str, pieces: list[str] | None = None, *, parse_tools: bool = True):
    """(reasoning, content, calls, deltas) of ``text`` fed in ``pieces`` (default: whole)."""
    parser = HarmonyParser(parse_tools=parse_tools)
    reasoning, content, deltas = "", "", []
    for piece in [*(pieces or [text]), None]:
        r, c, d = parser.feed(piece) if piece is not None else parser.finish()
        reasoning, content, deltas = reasoning + r, content + c, deltas + d
    return reasoning, content, parser.calls, deltas


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


# the parser on text streams


def test_analysis_is_reasoning_and_final_is_content():
    reasoning, content, calls, deltas = parse(ANSWER)
    assert reasoning == "The user wants the weather. I call the tool."
    assert content == "It is sunny in Paris." and not calls and not deltas


@pytest.mark.parametrize(
    "text",
    [ANSWER, CALL, f"{ANALYSIS}<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>{CALL_HEADER}{{}}"],
)
def test_any_split_gives_the_whole_result_and_no_tag_leaks(text):
    whole = parse(text)
    chars = parse(text, list(text))
    assert chars[:2] == whole[:2]
    assert [(c.name, c.arguments) for c in chars[2]] == [(c.name, c.arguments) for c in whole[2]]
    assert "<|" not in chars[0] + chars[1] and "|>" not in chars[0] + chars[1]
    rng = random.Random(0)
    for _ in range(20):
        assert parse(text, random_split(text, rng))[:2] == whole[:2]


def test_a_call_streams_its_name_first_then_argument_fragments():
    reasoning, content, [call], deltas = parse(CALL, list(CALL))
    assert reasoning == "The user wants the weather. I call the tool." and content == ""
    assert deltas[0].name == "get_weather" and deltas[0].id == call.id and deltas[0].arguments == ""
    assert all(d.name is None and d.index == 0 for d in deltas[1:]) and len(deltas) > 2
    assert "".join(d.arguments for d in deltas) == ARGUMENTS == call.arguments
    assert call.id.startswith("call_") and call.name == "get_weather"


def test_the_recipient_may_come_before_the_channel_and_calls_are_indexed():
    second = "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
    _, _, calls, deltas = parse(CALL.removesuffix("<|call|>") + "<|end|>" + second)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", ARGUMENTS), ("get_time", "{}")]
    assert [d.index for d in deltas if d.name] == [0, 1]


def test_a_preamble_on_commentary_is_content_and_channels_keep_messages_apart():
    text = (
        "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>Second.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    )
    reasoning, content, calls, _ = parse(text)
    assert reasoning == "First.\nSecond." and content == "Let me check.\nSunny." and not calls


def test_a_built_in_tool_message_is_reasoning():
    text = '<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "x"}<|call|>'
    reasoning, content, calls, deltas = parse(text)
    assert reasoning == '{"query": "x"}' and content == "" and not calls and not deltas


def test_a_malformed_or_cut_off_call_comes_back_as_content():
    _, content, calls, deltas = parse(f"{CALL_HEADER}{{city: Paris}}<|call|>")
    assert content == "{city: Paris}" and not calls and deltas[0].name == "get_weather"
    _, content, calls, _ = parse(f'{CALL_HEADER}{{"city": "Par')  # max_tokens cut it
    assert content == '{"city": "Par' and not calls


def test_without_tool_parsing_a_call_body_is_content():
    _, content, calls, deltas = parse(CALL, parse_tools=False)
    assert content == ARGUMENTS and not calls and not deltas


def test_output_that_is_not_harmony_is_content_as_it_is():
    for text in ["Hello there.\nHow are you?", "It is <|end|> sunny", "<|channel|>analysis but no message\nmore"]:
        assert parse(text)[:2] == ("", text)
        assert parse(text, list(text))[:2] == ("", text)


def test_a_header_cut_off_by_the_end_shows_nothing():
    assert parse(f"{ANALYSIS}<|start|>assistant<|channel|>fin")[:2] == (
        "The user wants the weather. I call the tool.",
        "",
    )


def test_output_parser_runs_harmony_for_the_harmony_spec():
    parser = OutputParser(HARMONY, False, parse_tools=True)
    parsed = parser.parse_all(CALL)
    assert parsed.reasoning.startswith("The user wants") and parsed.content == ""
    assert [c.name for c in parser.tool_calls] == ["get_weather"]
    assert HARMONY.decodes_special_tokens(parse_tools=False)
    assert not ParserSpec(None, "hermes").decodes_special_tokens(parse_tools=True)


def test_the_harmony_parsers_are_detected_and_named_as_in_vllm():
    template = Path(template_path("harmony")).read_text()
    assert ParserSpec.detect(template) == HARMONY
    assert ParserSpec.detect(template, tool_call_parser="none") == ParserSpec(is_harmony=True)
    assert ParserSpec.detect("", reasoning_parser="openai_gptoss", tool_call_parser="openai") == HARMONY
    with pytest.raises(ValueError, match="cannot read harmony"):
        ParserSpec.detect(template, tool_call_parser="hermes")


# the template and the endpoints over a tiny model with the harmony tokens


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-harmony")
    tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = Path(template_path("harmony")).read_text()
    tokenizer.save_pretrained(path)
    ids = tokenizer.convert_tokens_to_ids(HARMONY_TOKENS)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=[ids[HARMONY_TOKENS.index("<|return|>")], ids[HARMONY_TOKENS.index("<|call|>")]],
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return load_model(str(path))


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"  # Quart is asyncio-only


@pytest.fixture(scope="module")
async def atom(harmony_model):
    async with serving_app(harmony_model, kv_cache_gib=0.05, max_model_len=4096) as app:
        yield app


@pytest.mark.anyio
async def test_the_harmony_template_renders_tools_calls_and_results_as_single_tokens(atom):
    messages = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {
            "role": "assistant",
            "reasoning_content": "I need the tool.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"sunny": true}'},
    ]
    r = await atom.quart.test_client().post("/tokenize", json={"messages": messages, "tools": [WEATHER_TOOL]})
    tokens = (await r.get_json())["tokens"]
    tokenizer = atom.runtime.loaded.tokenizer
    prompt = tokenizer.decode(tokens)
    assert prompt.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" in prompt
    assert (
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n"
        in prompt
    )
    assert (
        '// The weather in a city.\ntype get_weather = (_: {\ncity: string,\nunit?: "celsius" | "fahrenheit",\n}) => any;'
        in prompt
    )
    assert "<|start|>user<|message|>What is the weather in Paris?<|end|>" in prompt
    assert "<|start|>assistant<|channel|>analysis<|message|>I need the tool.<|end|>" in prompt
    assert (
        f"<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{ARGUMENTS}<|call|>"
        in prompt
    )
    assert prompt.endswith(
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true}<|end|><|start|>assistant'
    )
    special = set(tokenizer.convert_tokens_to_ids(HARMONY_TOKENS))
    assert sum(t in special for t in tokens) == prompt.count("<|")  # every tag is one special token


@pytest.mark.anyio
async def test_chat_splits_reasoning_content_and_calls_streamed_and_not(atom):
    client = atom.quart.test_client()
    body = {"messages": USER, "max_tokens": 200}
    with scripted(atom, ANSWER):
        message = (await (await client.post("/v1/chat/completions", json=body)).get_json())["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants the weather. I call the tool."
    assert message["content"] == "It is sunny in Paris."
    with scripted(atom, CALL):
        choice = (await (await client.post("/v1/chat/completions", json={**body, "tools": [WEATHER_TOOL]})).get_json())[
            "choices"
        ][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ARGUMENTS}
    with scripted(atom, CALL):
        r = await client.post("/v1/chat/completions", json={**body, "tools": [WEATHER_TOOL], "stream": True})
        events = [e.removeprefix("data: ") for e in (await r.get_data(as_text=True)).split("\n\n") if e]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]
    reasoning = "".join(c["delta"].get("reasoning_content") or "" for c in chunks)
    calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
    assert reasoning == "The user wants the weather. I call the tool." and "<|" not in json.dumps(chunks)
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(t["function"]["arguments"] for t in calls) == ARGUMENTS
    assert chunks[-1]["finish_reason"] == "tool_calls"


@pytest.mark.anyio
async def test_messages_and_responses_read_harmony(atom):
    client = atom.quart.test_client()
    tools = [{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    body = {"model": atom.runtime.model_name, "max_tokens": 200, "messages": USER, "tools": tools}
    with scripted(atom, CALL):
        out = await (await client.post("/v1/messages", json=body)).get_json()
    assert out["stop_reason"] == "tool_use", out
    assert [b["type"] for b in out["content"]] == ["thinking", "tool_use"]
    assert out["content"][1]["input"] == json.loads(ARGUMENTS)
    with scripted(atom, ANSWER):
        r = await client.post(
            "/v1/responses", json={"input": "What is the weather in Paris?", "max_output_tokens": 200}
        )
        out = await r.get_json()
    assert r.status_code == 200, out
    kinds = [item["type"] for item in out["output"]]
    assert kinds == ["reasoning", "message"], out
    assert out["output"][1]["content"][0]["text"] == "It is sunny in Paris."
