"""server/tool_parsers.py: recorded-style outputs of each model family parsed whole, malformed ones kept as
content, and streaming that agrees with the whole parse for any split of the text."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.tool_parsers import (
    PARSERS,
    ParsedOutput,
    StreamDelta,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    new_call_id,
)

TOOLS = [
    {"type": "function", "function": {"name": name, "description": "", "parameters": {"type": "object"}}}
    for name in ("get_weather", "search", "get_time", "run_code")
]

WEATHER = '{"city": "San Francisco", "unit": "celsius"}'
SEARCH = (
    '{"query": "東京 café ☕", "filters": {"max_price": 100, "tags": ["new", "sale"], "exact": true, "near": null}}'
)


def calls(parsed: ParsedOutput) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in parsed.tool_calls]


# Per parser: (model output, expected content, expected calls), well-formed outputs only.
WELL_FORMED = {
    "hermes": [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "celsius"}}\n'
            "</tool_call>",
            None,
            [("get_weather", WEATHER)],
        ),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "東京 café ☕", "filters": '
            '{"max_price": 100, "tags": ["new", "sale"], "exact": true, "near": null}}}\n</tool_call>',
            None,
            [("get_weather", WEATHER), ("search", SEARCH)],
        ),
        (
            'I\'ll check the current time for you.\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            "I'll check the current time for you.\n\n",
            [("get_time", "{}")],
        ),
        # Qwen3 after its reasoning was split off; raw newlines inside a code argument.
        (
            '\n\n<tool_call>\n{"name": "run_code", "arguments": {"code": "for i in range(3):\n    print(i)"}}\n'
            "</tool_call>",
            None,
            [("run_code", '{"code": "for i in range(3):\\n    print(i)"}')],
        ),
        (
            "The weather in Paris is 18°C and sunny. <b>Enjoy</b> a < b",
            "The weather in Paris is 18°C and sunny. <b>Enjoy</b> a < b",
            [],
        ),
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "celsius"}}',
            None,
            [("get_weather", WEATHER)],
        ),
        (
            '<|python_tag|>{"name": "get_time", "parameters": {}}',
            None,
            [("get_time", "{}")],
        ),
        (
            '{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "celsius"}}; '
            '{"name": "search", "arguments": {"query": "東京 café ☕", "filters": {"max_price": 100, '
            '"tags": ["new", "sale"], "exact": true, "near": null}}}',
            None,
            [("get_weather", WEATHER), ("search", SEARCH)],
        ),
        ("\nThe capital of France is Paris.", "\nThe capital of France is Paris.", []),
    ],
    "mistral": [
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "celsius"}}]',
            None,
            [("get_weather", WEATHER)],
        ),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "San Francisco", "unit": "celsius"}}, '
            '{"name": "get_time", "arguments": {}, "id": "a1B2c3D4e"}]',
            None,
            [("get_weather", WEATHER), ("get_time", "{}")],
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "San Francisco", "unit": "celsius"}',
            None,
            [("get_weather", WEATHER)],
        ),
        (
            'Let me look both up.[TOOL_CALLS]get_weather[ARGS]{"city": "San Francisco", "unit": "celsius"}'
            '[TOOL_CALLS]search[ARGS]{"query": "東京 café ☕", "filters": {"max_price": 100, "tags": ["new", "sale"], '
            '"exact": true, "near": null}}',
            "Let me look both up.",
            [("get_weather", WEATHER), ("search", SEARCH)],
        ),
        ("Mistral says [1] hello [TOOL without calls", "Mistral says [1] hello [TOOL without calls", []),
    ],
    "pythonic": [
        ('[get_weather(city="San Francisco", unit="celsius")]', None, [("get_weather", WEATHER)]),
        (
            '[get_weather(city="San Francisco", unit="celsius"), search(query="東京 café ☕", '
            'filters={"max_price": 100, "tags": ("new", "sale"), "exact": True, "near": None})]',
            None,
            [("get_weather", WEATHER), ("search", SEARCH)],
        ),
        ("<|python_start|>[get_time()]<|python_end|>", None, [("get_time", "{}")]),
        ("  [run_code(code='x = -1.5\\nprint(x)')]\n", None, [("run_code", '{"code": "x = -1.5\\nprint(x)"}')]),
        ("[1] Paris is the capital of France.", "[1] Paris is the capital of France.", []),
        ("The capital of France is Paris.", "The capital of France is Paris.", []),
    ],
}

# Per parser: (malformed output, expected content, expected calls). The expected content is the text as written.
MALFORMED = {
    "hermes": [
        # Truncated: generation stopped mid-JSON.
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "same", []),
        ("<tool_call>\n{name: get_weather, arguments: {city: Paris}}\n</tool_call>", "same", []),
        ('<tool_call>\n{"name": "send_email", "arguments": {"to": "a@b.c"}}\n</tool_call>', "same", []),
        ('<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', "same", []),
        ('<tool_call>\n{"name": "get_weather", "arguments": "city=Paris"}\n</tool_call>', "same", []),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"t": NaN}}\n</tool_call>', "same", []),
        ('<tool_call>\n["get_weather", {"city": "Paris"}]\n</tool_call>', "same", []),
        # Garbage after the markup is content; the call before it stands.
        (
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nI hope that helps!',
            "\nI hope that helps!",
            [("get_time", "{}")],
        ),
        # Not closed, but the JSON is complete: still a call.
        ('<tool_call>\n{"name": "get_time", "arguments": {}}\n', None, [("get_time", "{}")]),
        # One good block and one bad: the bad one is content.
        (
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
            '"arguments": {}\n</tool_call>',
            '\n<tool_call>\n{"name": "get_time", "arguments": {}\n</tool_call>',
            [("get_time", "{}")],
        ),
        ("stray </tool_call> and <tool_call>", "same", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Par', "same", []),
        ('<|python_tag|>{"name": "get_weather", "parameters": {city: Paris}}', "same", []),
        ('{"name": "send_email", "parameters": {"to": "a@b.c"}}', "same", []),
        ('{"name": "get_time"}', "same", []),
        ('{"answer": 42, "unit": "m"}', "same", []),
        ('{"name": "get_weather", "parameters": ["Paris"]}', "same", []),
        ('<|python_tag|>print("hello")', "same", []),
        ("<|python_tag|>", "same", []),
        ('{"name": "get_time", "parameters": {}} Hope this helps!', "Hope this helps!", [("get_time", "{}")]),
        ('{"name": "get_time", "parameters": {}};', None, [("get_time", "{}")]),
        (
            '{"name": "get_time", "parameters": {}}; {"name": "send_email", "parameters": {}}',
            '{"name": "send_email", "parameters": {}}',
            [("get_time", "{}")],
        ),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par', "same", []),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Par', "same", []),
        ("[TOOL_CALLS] [{name: get_weather}]", "same", []),
        ('[TOOL_CALLS] [{"name": "send_email", "arguments": {}}, {"name": "get_time", "arguments": {}}]', "same", []),
        ('[TOOL_CALLS]send_email[ARGS]{"to": "a@b.c"}', "same", []),
        ('[TOOL_CALLS] ["get_weather"]', "same", []),
        ('[TOOL_CALLS] {"name": "get_time", "arguments": {}}', "same", []),
        ('[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}', "same", []),
        ('[TOOL_CALLS]get_weather[ARGS]"Paris"', "same", []),
        ("[TOOL_CALLS]", "same", []),
        ("[TOOL_CALLS]get_time[ARGS]{} Done, see above.", " Done, see above.", [("get_time", "{}")]),
    ],
    "pythonic": [
        ('[get_weather(city="San Fr', "same", []),
        ('[get_weather("San Francisco")]', "same", []),
        ('[send_email(to="a@b.c")]', "same", []),
        ("[get_weather(city=city_name)]", "same", []),
        ("[get_weather(**{'city': 'Paris'})]", "same", []),
        ("[get_weather(city={1, 2})]", "same", []),
        ("[get_weather(city=1e999)]", "same", []),
        ("[get_weather(city='Paris')] and then some", "same", []),
        ("[get_time(), 42]", "same", []),
        ("[]", "same", []),
        ("<|python_start|>print('hi')<|python_end|>", "same", []),
    ],
}


def run_stream(parser: ToolParser, chunks: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Feeds the chunks and assembles the deltas as an OpenAI client does: (content, calls, the content deltas)."""
    stream = parser.stream()
    deltas = [stream.feed(chunk) for chunk in chunks] + [stream.finish()]
    assembled: dict[int, list] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            assert isinstance(call, ToolCallDelta)
            if call.index not in assembled:
                assert call.id and call.name, "a call's first delta carries its id and name"
                assembled[call.index] = [call.id, call.name, call.arguments]
            else:
                assert call.id is None and call.name is None
                assembled[call.index][2] += call.arguments
    assert sorted(assembled) == list(range(len(assembled)))
    ids = [assembled[i][0] for i in range(len(assembled))]
    assert len(set(ids)) == len(ids)
    contents = [delta.content for delta in deltas]
    return "".join(contents), [(assembled[i][1], assembled[i][2]) for i in range(len(assembled))], contents


CASES = [(name, *case) for name, cases in WELL_FORMED.items() for case in cases] + [
    (name, text, text if content == "same" else content, expected)
    for name, cases in MALFORMED.items()
    for text, content, expected in cases
]


@pytest.mark.parametrize("name, text, content, expected", CASES)
def test_parse(name, text, content, expected):
    parsed = PARSERS[name](TOOLS).parse(text)
    assert parsed.content == content
    assert calls(parsed) == expected
    for call in parsed.tool_calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id)
        assert isinstance(json.loads(call.arguments), dict)
    assert len({call.id for call in parsed.tool_calls}) == len(parsed.tool_calls)


@pytest.mark.parametrize("name, text, content, expected", CASES)
def test_stream_one_character_at_a_time(name, text, content, expected):
    streamed, streamed_calls, _ = run_stream(PARSERS[name](TOOLS), list(text))
    assert streamed == (content or "")
    assert streamed_calls == expected


MARKUP = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|python_start|>"]


@st.composite
def split_output(draw, cases):
    """A parser name, a recorded output and a random split of it into chunks."""
    name, text = draw(st.sampled_from(cases))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=16)))
    return name, text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=400, deadline=None)
@given(split_output([(name, case[0]) for name, cases in WELL_FORMED.items() for case in cases]))
def test_stream_well_formed_agrees_with_parse(case):
    name, text, chunks = case
    parser = PARSERS[name](TOOLS)
    parsed = parser.parse(text)
    content, streamed_calls, contents = run_stream(parser, chunks)
    assert content == (parsed.content or "")
    assert streamed_calls == calls(parsed)
    for piece in contents:
        assert not any(marker in piece for marker in MARKUP)


@settings(max_examples=400, deadline=None)
@given(split_output([(name, case[0]) for name, cases in MALFORMED.items() for case in cases]))
def test_stream_malformed_agrees_with_parse(case):
    name, text, chunks = case
    parser = PARSERS[name](TOOLS)
    parsed = parser.parse(text)
    content, streamed_calls, _ = run_stream(parser, chunks)
    assert content == (parsed.content or "")
    assert streamed_calls == calls(parsed)


# Pieces of markup, JSON and Python that random texts are made of.
PIECES = [
    *MARKUP,
    "</think>",
    '{"name": "get_time", "arguments": {}}',
    '{"name": "x", "parameters": {"a": [1]}}',
    "get_time",
    "get_time(",
    "x=1",
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    ";",
    ",",
    '"',
    " ",
    "\n",
    "<",
    "|",
    "word",
]


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(PARSERS)), pieces=st.lists(st.sampled_from(PIECES), max_size=12), data=st.data())
def test_any_text_never_raises_and_streams_as_parsed(name, pieces, data):
    text = "".join(pieces)
    parser = PARSERS[name]()
    parsed = parser.parse(text)
    _, _, chunks = data.draw(split_output([(name, text)]))
    content, streamed_calls, _ = run_stream(parser, chunks)
    assert content == (parsed.content or "")
    assert streamed_calls == calls(parsed)


def test_without_tools_any_name_is_a_call():
    text = '<tool_call>\n{"name": "send_email", "arguments": {"to": "a@b.c"}}\n</tool_call>'
    assert calls(PARSERS["hermes"]().parse(text)) == [("send_email", '{"to": "a@b.c"}')]
    assert calls(PARSERS["hermes"](TOOLS).parse(text)) == []


def test_first_delta_of_a_call_has_its_index_id_and_name():
    stream = PARSERS["hermes"](TOOLS).stream()
    assert stream.feed("Checking.\n<tool").content == "Checking.\n"
    assert stream.feed('_call>\n{"name": "get_time", ').tool_calls == []
    delta = stream.feed(
        '"arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert [(d.index, d.name, d.arguments) for d in delta.tool_calls] == [(0, "get_time", "{}"), (1, "get_time", "{}")]
    assert delta.tool_calls[0].id != delta.tool_calls[1].id
    assert delta.content == "\n"  # between the blocks: content, as content has begun
    assert stream.finish() == StreamDelta()


def test_registry():
    assert sorted(PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic"]
    assert get_tool_parser("mistral") is PARSERS["mistral"]
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("granite")
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
