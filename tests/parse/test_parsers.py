"""Output parsers: the reasoning channel and tool calls, fed whole and split at every delta boundary."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from atom_anyio.config import Config
from atom_anyio.parse import OutputParser, ParsedDelta, ParserSpec
from atom_anyio.parse.reasoning import opens_reasoning
from atom_anyio.prompt.render import compile_chat_template, render_chat
from atom_anyio.templates import template_path

THINK = ("<think>", "</think>")
FORMATS = ("hermes", "qwen3_coder", "llama3_json", "mistral")
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Parsed:
    """What a client assembles from the deltas: joined channels and calls by index."""

    reasoning: str = ""
    content: str = ""
    calls: dict[int, list[str]] = field(default_factory=dict)  # index -> [name, joined arguments]
    complete: list[tuple[str, str]] = field(default_factory=list)  # OutputParser.tool_calls (name, arguments)

    def summary(self) -> tuple:
        return self.reasoning, self.content, sorted(self.calls.items()), self.complete


def run(spec: ParserSpec, chunks: list[str], prompt: str | None = None, *, parse_tools: bool = True) -> Parsed:
    parser = OutputParser(spec, opens_reasoning(prompt, spec.reasoning_tags), parse_tools=parse_tools)
    out = Parsed()
    ids: dict[int, str] = {}
    for delta in [parser.feed(c) for c in chunks] + [parser.finish()]:
        out.reasoning += delta.reasoning
        out.content += delta.content
        assert len({d.index for d in delta.tool_calls}) == len(delta.tool_calls), "one entry per call"
        for d in delta.tool_calls:
            if d.index not in out.calls:  # the first delta of a call: its id and name, before any arguments
                assert d.id and CALL_ID.fullmatch(d.id) and d.name, d
                ids[d.index], out.calls[d.index] = d.id, [d.name, ""]
            else:
                assert d.id is None and d.name is None, d
            out.calls[d.index][1] += d.arguments
    for call in parser.tool_calls:
        index = next(i for i, cid in ids.items() if cid == call.id)
        assert out.calls[index] == [call.name, call.arguments], "a complete call is what its deltas joined to"
        out.complete.append((call.name, call.arguments))
    return out


def check_splits(spec: ParserSpec, text: str, prompt: str | None = None, *, parse_tools: bool = True) -> Parsed:
    """The whole-string parse; the same at every single split point and one character at a time."""
    whole = run(spec, [text], prompt, parse_tools=parse_tools)
    for i in range(len(text) + 1):
        assert run(spec, [text[:i], text[i:]], prompt, parse_tools=parse_tools).summary() == whole.summary(), i
    assert run(spec, list(text), prompt, parse_tools=parse_tools).summary() == whole.summary()
    return whole


def calls_of(parsed: Parsed) -> list[tuple[str, object]]:
    return [(name, json.loads(arguments)) for name, arguments in parsed.complete]


# well-formed outputs, built from their parts (text, reasoning, content, calls)

PLAIN = st.text(alphabet='ab <>/{}"[]|=:;,\n', max_size=12).filter(lambda s: not any(t in s for t in TAGS))
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
ARGS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=3)
NAMES = st.text(min_size=1, max_size=8).filter(lambda s: "</tool_call>" not in s)
IDENTS = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)


@dataclass
class Case:
    text: str
    reasoning: str
    content: str
    calls: list[tuple[str, dict]]


def dumps(draw, value) -> str:
    return json.dumps(value, indent=draw(st.sampled_from([None, 2])), ensure_ascii=draw(st.booleans()))


@st.composite
def json_call(draw, args_key: str = "arguments") -> tuple[str, str, dict]:
    name, args = draw(NAMES), draw(ARGS)
    ws = draw(st.sampled_from(["", " ", "\n  "]))
    if draw(st.booleans()):
        text = f'{{{ws}"name":{ws}{dumps(draw, name)},{ws}"{args_key}":{ws}{dumps(draw, args)}{ws}}}'
    else:  # another key order: parsed when the object closes
        text = f'{{"{args_key}": {dumps(draw, args)}, "name": {dumps(draw, name)}}}'
    assume("</tool_call>" not in text)
    return text, name, args


@st.composite
def hermes_case(draw) -> Case:
    calls = draw(st.lists(json_call(), max_size=3))
    content = draw(PLAIN)
    body = content + "".join(
        f"<tool_call>\n{text}\n</tool_call>" + draw(st.sampled_from(["", "\n", " \n"])) for text, *_ in calls
    )
    return Case(body, "", content, [(name, args) for _, name, args in calls])


PARAM_VALUES = (
    st.integers(-99, 99)
    | st.booleans()
    | st.lists(st.integers(0, 9), max_size=3)
    | st.from_regex(r"[A-Za-z][A-Za-z ,.]{0,10}[a-z]", fullmatch=True).filter(
        lambda s: s not in ("true", "false", "null")
    )
)


@st.composite
def qwen3_coder_case(draw) -> Case:
    content, calls, text = draw(PLAIN), [], ""
    for _ in range(draw(st.integers(0, 2))):
        name, params = draw(IDENTS), draw(st.dictionaries(IDENTS, PARAM_VALUES, max_size=3))
        body = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in params.items()
        )
        text += f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>\n"
        calls.append((name, params))
    return Case(content + text, "", content, calls)


@st.composite
def llama3_case(draw) -> Case:
    if draw(st.booleans()):  # a plain answer
        content = draw(PLAIN.filter(lambda s: not s.lstrip().startswith("{")))
        return Case(content, "", content, [])
    calls = draw(st.lists(json_call("parameters"), min_size=1, max_size=3))
    prefix = draw(st.sampled_from(["", "<|python_tag|>", " \n"]))
    return Case(prefix + "; ".join(t for t, *_ in calls), "", "", [(n, a) for _, n, a in calls])


@st.composite
def mistral_case(draw) -> Case:
    content = draw(PLAIN)
    calls = draw(st.lists(json_call(), max_size=3))
    text = content + (f"[TOOL_CALLS][{', '.join(t for t, *_ in calls)}]" if calls else "")
    return Case(text, "", content, [(n, a) for _, n, a in calls])


CASES = {
    "hermes": hermes_case(),
    "qwen3_coder": qwen3_coder_case(),
    "llama3_json": llama3_case(),
    "mistral": mistral_case(),
}


@st.composite
def with_reasoning(draw, case: st.SearchStrategy[Case]) -> Case:
    """A ``<think>`` block in front, as Qwen3 and DeepSeek-R1 write it."""
    c = draw(case)
    reasoning = draw(PLAIN)
    text = f"<think>\n{reasoning}\n</think>\n\n{c.text}"
    return Case(text, reasoning.strip(), c.content.lstrip(), c.calls)


@pytest.mark.parametrize("fmt", FORMATS)
@SETTINGS
@given(data=st.data())
def test_well_formed_output_parses_the_same_at_every_split(fmt: str, data: st.DataObject):
    case = data.draw(CASES[fmt])
    parsed = check_splits(ParserSpec(None, fmt), case.text)
    assert (parsed.reasoning, parsed.content, calls_of(parsed)) == ("", case.content, case.calls)
    assert sorted(parsed.calls) == list(range(len(case.calls)))


@pytest.mark.parametrize("fmt", FORMATS)
@SETTINGS
@given(data=st.data())
def test_reasoning_then_tool_calls_parse_the_same_at_every_split(fmt: str, data: st.DataObject):
    case = data.draw(with_reasoning(CASES[fmt]))
    parsed = check_splits(ParserSpec(THINK, fmt), case.text)
    assert (parsed.reasoning, parsed.content, calls_of(parsed)) == (case.reasoning, case.content, case.calls)
    for tag in TAGS:
        assert tag not in parsed.reasoning and tag not in parsed.content


@SETTINGS
@given(case=hermes_case(), data=st.data())
def test_random_delta_splits_join_to_the_whole_parse(case: Case, data: st.DataObject):
    spec = ParserSpec(THINK, "hermes")
    text = f"<think>{case.text}</think>{case.text}"
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run(spec, chunks).summary() == run(spec, [text]).summary()


FRAGMENTS = st.sampled_from(
    [
        *TAGS,
        "<thi",
        "</th",
        "<tool_",
        "</tool",
        "[TOOL",
        "<|py",
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        ":",
        ",",
        ";",
        " ",
        "\n",
    ]
    + ['"name"', '"arguments"', '"parameters"', '"f"', "a", "1", "<function=f>", "<parameter=p>", "</parameter>"]
    + ["</function>", '{"name": "f", "arguments": {', '{"name": "g", "parameters": {"x": 1}}']
)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(FRAGMENTS, max_size=14), seeded=st.booleans())
def test_any_output_parses_without_error_and_the_same_at_every_split(fmt: str, pieces: list[str], seeded: bool):
    check_splits(ParserSpec(THINK, fmt), "".join(pieces), "<|im_start|>assistant\n<think>\n" if seeded else None)


# the reasoning channel, seeded from the prompt


def shipped_prompt(**kwargs) -> str:
    template = compile_chat_template(Path(template_path("qwen3_tools")).read_text())
    return render_chat(template, [{"role": "user", "content": "Hi"}], template_kwargs=kwargs)


def test_a_prompt_that_ends_inside_think_starts_in_reasoning():
    prompt = shipped_prompt()
    assert prompt.endswith("<think>\n")
    parsed = check_splits(ParserSpec(THINK, "hermes"), "The user greets me.\n</think>\n\nHello!", prompt)
    assert (parsed.reasoning, parsed.content) == ("The user greets me.", "Hello!")


def test_a_prompt_with_thinking_off_starts_in_content():
    prompt = shipped_prompt(enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    parsed = check_splits(ParserSpec(THINK, "hermes"), "Hello!", prompt)
    assert (parsed.reasoning, parsed.content) == ("", "Hello!")
    # the reasoning tags are only recognised at the start of the output
    assert run(ParserSpec(THINK, None), ["Hi <think>x</think>"], prompt).content == "Hi <think>x</think>"


@SETTINGS
@given(reasoning=PLAIN, content=PLAIN)
def test_seeded_reasoning_parses_the_same_at_every_split(reasoning: str, content: str):
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    parsed = check_splits(ParserSpec(THINK, None), f"{reasoning}\n</think>\n\n{content}", prompt)
    assert (parsed.reasoning, parsed.content) == (reasoning.strip(), content.lstrip())


@pytest.mark.parametrize(
    ("prompt", "in_reasoning"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<think>\nhalf a thought", True),  # continue_final_message inside a thought
        ("<think>\nold</think>\n\nanswer<|im_end|>\n<|im_start|>assistant\n", False),
        ("<think>\n\n</think>\n\n", False),
        ("no tags at all", False),
        (None, False),
    ],
)
def test_the_prompt_decides_where_the_output_starts(prompt: str | None, in_reasoning: bool):
    parsed = run(ParserSpec(THINK, None), ["x</think>y"], prompt)
    assert (parsed.reasoning, parsed.content) == (("x", "y") if in_reasoning else ("", "x</think>y"))


def test_unclosed_reasoning_ends_as_reasoning():
    parsed = check_splits(ParserSpec(THINK, "hermes"), "<think>\nstill thinking when max_tokens hit ")
    assert (parsed.reasoning, parsed.content) == ("still thinking when max_tokens hit", "")


# malformed calls are content


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", '<tool_call>{"name": get_weather}</tool_call>'),  # invalid JSON at the close tag
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>'),  # the object never closes
        ("hermes", '<tool_call>{"name": "f", "arguments": "not an object"}</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "unfinished'),  # unclosed at the end
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}'),  # no close tag
        ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\nno function here\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n"),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}'),
        ("llama3_json", '{"name": "f", "parameters": [1]}'),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}'),
        ("mistral", "[TOOL_CALLS] no list"),
        ("mistral", '[TOOL_CALLS][{"name": "f"}]'),
    ],
)
def test_a_malformed_call_comes_back_as_content(fmt: str, text: str):
    parsed = check_splits(ParserSpec(THINK, fmt), text)
    assert parsed.content == text and parsed.complete == []


@pytest.mark.parametrize(
    "text",
    [
        'ok <tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call> then',
        '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "g", "arguments": {]}</tool_call>',
    ],
)
def test_streamed_pieces_keep_the_texts_order_when_a_call_proves_malformed(text: str):
    """A call announced and then found malformed comes back as text after its deltas (as many tokens
    arriving at once, a verified draft's, bring it): ``feed_pieces`` gives content before calls in
    each piece, so a block-building client (Anthropic's, the Responses API's) sees the call's deltas,
    then its text; never a delta of a call after text that followed it. At every two-way split and
    one character at a time, the pieces join to ``feed``'s result."""
    spec = ParserSpec(None, "hermes")
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    reference = OutputParser(spec, False, parse_tools=True)
    whole = reference.parse_all(text)
    for parts in splits:
        parser = OutputParser(spec, False, parse_tools=True)
        pieces = [pd for part in parts for pd in parser.feed_pieces(part)] + parser.finish_pieces()
        events: list[tuple[str, int | None]] = []
        for pd in pieces:
            events += [("text", None)] if pd.content else []
            events += [("call", d.index) for d in pd.tool_calls]
        for at, (kind, index) in enumerate(events):
            if kind == "call":  # no text between a call's first delta and this one
                first = next(i for i, e in enumerate(events) if e == ("call", index))
                assert ("text", None) not in events[first:at], (parts, pieces)
        joined = sum(pieces, ParsedDelta())
        assert joined.content == whole.content, parts
        assert [(c.name, c.arguments) for c in parser.tool_calls] == [
            (c.name, c.arguments) for c in reference.tool_calls
        ]


def test_an_end_tag_inside_a_json_string_is_the_strings_text():
    arguments = '{"note": "a</tool_call>b"}'
    text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    parsed = check_splits(ParserSpec(None, "hermes"), text)
    assert parsed.complete == [("f", arguments)] and parsed.content == ""


# a call the token budget cut: a call with the arguments so far, never markup in the content


def run_cut(spec: ParserSpec, text: str) -> tuple[str, list]:
    """``text`` fed in pieces, then finished as an output that ran out of tokens: the content and
    (name, arguments, is_cut, joined argument deltas) of each call."""
    parser = OutputParser(spec, False, parse_tools=True)
    deltas = [parser.feed(text[i : i + 3]) for i in range(0, len(text), 3)] + [parser.finish(is_cut=True)]
    content = "".join(d.content for d in deltas)
    streamed: dict[int, str] = {}
    for d in (t for delta in deltas for t in delta.tool_calls):
        streamed[d.index] = streamed.get(d.index, "") + d.arguments
    calls = [(c.name, c.arguments, c.is_cut, streamed[i]) for i, c in enumerate(parser.tool_calls)]
    return content, calls


@pytest.mark.parametrize(
    ("fmt", "text", "cut_arguments"),
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"city": "Os', '{"city": "Os'),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"city": "Oslo"}}\n</tool', '{"city": "Oslo"}'),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, 2', '{"a": [1, 2'),
        ("llama3_json", '{"name": "f", "parameters": {"a": tr', '{"a": tr'),
        ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nx", '{"a": 1'),
    ],
)
def test_a_call_the_token_budget_cut_is_a_cut_call_with_its_arguments_so_far(fmt, text, cut_arguments):
    content, calls = run_cut(ParserSpec(None, fmt), text)
    assert content == "" and calls == [("f", cut_arguments, True, cut_arguments)]


def test_after_complete_calls_the_cut_one_comes_last_and_a_nameless_one_is_dropped():
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = run_cut(ParserSpec(None, "hermes"), f'Checking.\n{call}\n{call}\n<tool_call>\n{{"na')
    assert content == "Checking.\n" and calls == [("f", '{"a": 1}', False, '{"a": 1}')] * 2
    content, calls = run_cut(ParserSpec(None, "hermes"), f'{call}\n<tool_call>\n{{"name": "g", "arguments": {{"b')
    assert content == "" and calls[-1] == ("g", '{"b', True, '{"b')


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_'),
        ("hermes", "<tool_"),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, '),
        ("mistral", "[TOOL_CALLS]"),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; '),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}};<|pyth'),
    ],
)
def test_call_markup_the_budget_cut_is_dropped(fmt, text):
    content, calls = run_cut(ParserSpec(None, fmt), text)
    assert content == "" and calls == [("f", '{"a": 1}', False, '{"a": 1}')] * text.count('"name"')


def test_llama3_json_cut_before_a_name_stays_content():
    content, calls = run_cut(ParserSpec(None, "llama3_json"), '{"answer": 4')  # it need not be a call at all
    assert content == '{"answer": 4' and calls == []


def test_text_before_and_between_calls_is_content_and_waits_for_the_next_feed():
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    text = f"Let me check. {call}\nthen {call}\n"
    parser = OutputParser(ParserSpec(None, "hermes"), False, parse_tools=True)
    first = parser.feed(text)
    assert first.content == "Let me check. " and [d.index for d in first.tool_calls] == [0]
    rest = parser.finish()  # content after a call comes in a later result, keeping the text order
    assert rest.content == "\nthen " and [d.index for d in rest.tool_calls] == [1]
    assert [c.name for c in parser.tool_calls] == ["f", "f"]


def test_streamed_arguments_arrive_in_several_fragments_after_the_name():
    spec = ParserSpec(None, "hermes")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    parser = OutputParser(spec, False, parse_tools=True)
    deltas = [d for i in range(0, len(text), 4) for d in parser.feed(text[i : i + 4]).tool_calls]
    deltas += parser.finish().tool_calls
    assert deltas[0].name == "get_weather" and all(d.name is None for d in deltas[1:])
    fragments = [d.arguments for d in deltas]
    assert len(fragments) > 3 and "".join(fragments) == '{"city": "Paris", "days": 3}'


def test_qwen3_coder_parameters_are_json_when_they_parse():
    text = (
        "<tool_call>\n<function=search>\n<parameter=query>\nweather in Paris\n</parameter>\n"
        '<parameter=limit>\n5\n</parameter>\n<parameter=filters>\n{"lang": "fr"}\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    parsed = check_splits(ParserSpec(None, "qwen3_coder"), text)
    assert calls_of(parsed) == [("search", {"query": "weather in Paris", "limit": 5, "filters": {"lang": "fr"}})]


def test_tool_syntax_is_content_when_tools_are_not_parsed():
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    parsed = check_splits(ParserSpec(THINK, "hermes"), text, parse_tools=False)
    assert parsed.content == text and parsed.calls == {}


def test_parsed_deltas_add_up():
    a = ParsedDelta("r", "c")
    assert not ParsedDelta() and a and (a + ParsedDelta("s", "d")) == ParsedDelta("rs", "cd")


# detection from the chat template


def test_the_shipped_template_is_detected_as_think_and_hermes():
    spec = ParserSpec.detect(Path(template_path("qwen3_tools")).read_text())
    assert spec == ParserSpec(THINK, "hermes")


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ '<tool_call>' }}{{ '<function=' + name + '>' }}", ParserSpec(None, "qwen3_coder")),
        ("{{ '<think>\\n' }}{{ '<tool_call>' }}", ParserSpec(THINK, "hermes")),
        ("{{ '[TOOL_CALLS]' + tool_calls | tojson }}", ParserSpec(None, "mistral")),
        ("{{ '<|python_tag|>' }}{{ 'ipython' }}", ParserSpec(None, "llama3_json")),
        ("{{ tools }}<｜Assistant｜></think>", ParserSpec(THINK, None)),
        ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}", ParserSpec(None, None)),
        ("{{ '<|im_start|>' + message.content }}", ParserSpec(None, None)),
        ("<｜Assistant｜></think>", ParserSpec(THINK, None)),
        ("{{ '<|start|>' }}{{ '<|channel|>final' }}", ParserSpec(tool_format="harmony", is_harmony=True)),
        (None, ParserSpec(None, None)),
        ({"default": "plain", "tool_use": "{{ '<tool_call>' }}"}, ParserSpec(None, "hermes")),
    ],
)
def test_parsers_are_detected_from_the_template(template, expected):
    assert ParserSpec.detect(template) == expected


def test_tools_rendered_in_the_default_format_are_parsed_in_it_unless_the_template_teaches_another():
    assert ParserSpec.detect("<｜Assistant｜></think>", renders_default_tools=True) == ParserSpec(THINK, "hermes")
    assert ParserSpec.detect("{{ '<function=' }}", renders_default_tools=True) == ParserSpec(None, "qwen3_coder")


def test_flags_force_or_disable_the_parsers():
    template = Path(template_path("qwen3_tools")).read_text()
    assert ParserSpec.detect(template, reasoning_parser="none", tool_call_parser="none") == ParserSpec()
    assert ParserSpec.detect("", reasoning_parser="deepseek_r1", tool_call_parser="mistral") == ParserSpec(
        THINK, "mistral"
    )
    with pytest.raises(ValueError, match="hermes.*qwen3_coder.*llama3_json.*mistral"):
        ParserSpec.detect(template, tool_call_parser="gpt")
    with pytest.raises(ValueError, match="reasoning_parser"):
        Config.of(reasoning_parser="think_hard")
