"""server/reasoning.py: <think> blocks as Qwen3 and DeepSeek-R1 write them, parsed whole, and streaming that
agrees with the whole parse for any split of the text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.reasoning import REASONING_PARSERS, ReasoningParser, get_reasoning_parser

THOUGHT = "Okay, the user asks for 17 * 23.\n\n17 * 20 = 340 and 17 * 3 = 51, so 391."

# (parser, starts_in_reasoning, model output, expected reasoning, expected content)
CASES = [
    # Qwen3 with thinking on: the model opens and closes the block.
    ("qwen3", False, f"<think>\n{THOUGHT}\n</think>\n\n17 * 23 = **391**.", THOUGHT, "17 * 23 = **391**."),
    # Qwen3 with enable_thinking=false: the template put the empty block in the prompt, or the model writes it.
    ("qwen3", False, "17 * 23 = 391.", None, "17 * 23 = 391."),
    ("qwen3", False, "<think>\n\n</think>\n\n17 * 23 = 391.", None, "17 * 23 = 391."),
    # Cut off while thinking (max_tokens): all of it is reasoning.
    ("qwen3", False, f"<think>\n{THOUGHT}", THOUGHT, None),
    # A <think> that does not lead the output is quoted, not a block.
    ("qwen3", False, "Use <think> tags.</think> ok", None, "Use <think> tags.</think> ok"),
    ("qwen3", False, "\n\n<b>bold</b> <thin", None, "<b>bold</b> <thin"),
    ("qwen3", False, "", None, None),
    ("qwen3", False, "<think>", None, None),
    # Content keeps its text after the first </think>, trailing whitespace and later tags included.
    ("qwen3", False, "<think>a</think>b</think>\n", "a", "b</think>\n"),
    # The prompt ended with <think> (the server saw it): the output starts inside reasoning.
    ("qwen3", True, f"{THOUGHT}\n</think>\n\n391", THOUGHT, "391"),
    ("qwen3", True, "no close at all", "no close at all", None),
    # DeepSeek-R1: the template opens <think>; older outputs repeat it.
    ("deepseek_r1", False, f"{THOUGHT}\n</think>\n\nThe answer is 391.", THOUGHT, "The answer is 391."),
    ("deepseek_r1", False, f"<think>\n{THOUGHT}\n</think>\n\nThe answer is 391.", THOUGHT, "The answer is 391."),
    ("deepseek_r1", False, f"{THOUGHT}", THOUGHT, None),
    ("deepseek_r1", False, "</think>\n\nJust the answer: 391.", None, "Just the answer: 391."),
    (
        "deepseek_r1",
        False,
        "Let me think about <thinking> 日本語 🦀\n</think>",
        "Let me think about <thinking> 日本語 🦀",
        None,
    ),
    ("deepseek_r1", False, "  \n", None, None),
]


def run_stream(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    stream = parser.stream()
    deltas = [stream.feed(chunk) for chunk in chunks] + [stream.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize("name, starts, text, reasoning, content", CASES)
def test_parse(name, starts, text, reasoning, content):
    assert REASONING_PARSERS[name](starts).parse(text) == (reasoning, content)


@pytest.mark.parametrize("name, starts, text, reasoning, content", CASES)
def test_stream_one_character_at_a_time(name, starts, text, reasoning, content):
    assert run_stream(REASONING_PARSERS[name](starts), list(text)) == (reasoning or "", content or "")


@st.composite
def split_case(draw):
    name, starts, text, _, _ = draw(st.sampled_from(CASES))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return name, starts, text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=300, deadline=None)
@given(split_case())
def test_stream_agrees_with_parse(case):
    name, starts, text, chunks = case
    parser = REASONING_PARSERS[name](starts)
    reasoning, content = parser.parse(text)
    streamed = run_stream(parser, chunks)
    assert streamed == (reasoning or "", content or "")
    if "think>" not in (reasoning or "") + (content or ""):  # a well-formed output: no tag leaks
        assert "think>" not in streamed[0] + streamed[1]


PIECES = ["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "b c"]


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(REASONING_PARSERS)),
    starts=st.booleans(),
    pieces=st.lists(st.sampled_from(PIECES), max_size=12),
    data=st.data(),
)
def test_any_text_streams_as_parsed(name, starts, pieces, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    parser = REASONING_PARSERS[name](starts)
    reasoning, content = parser.parse(text)
    assert run_stream(parser, chunks) == (reasoning or "", content or "")


def test_partial_markers_are_held_back():
    stream = REASONING_PARSERS["qwen3"]().stream()
    assert stream.feed("<thi").reasoning == ""
    assert stream.feed("nk>\nStep one.\n</th").reasoning == "Step one."
    delta = stream.feed("ink>\n\nDone.")
    assert (delta.reasoning, delta.content) == ("", "Done.")
    stream = REASONING_PARSERS["qwen3"]().stream()
    assert stream.feed("<").content == ""
    assert stream.feed("b>").content == "<b>"


def test_registry():
    assert {"deepseek_r1", "qwen3"} <= set(REASONING_PARSERS)
    assert get_reasoning_parser("qwen3") is REASONING_PARSERS["qwen3"]
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


def test_server_flag_choices_name_every_parser():
    """--tool-call-parser and --reasoning-parser offer exactly the parsers that exist."""
    from server.config import REASONING_PARSERS as REASONING_FLAG_CHOICES
    from server.config import TOOL_CALL_PARSERS
    from server.tool_parsers import PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
    assert set(REASONING_FLAG_CHOICES) == set(REASONING_PARSERS)
