"""Reasoning parsers: the `<think>...</think>` part of a model's output apart from its answer.

The reasoning is the text between the markers, whitespace stripped at both ends; the content is the text
after `</think>`, leading whitespace stripped. `<think>` counts only at the start of the output (after
whitespace): a model that writes the tag later is quoting it. A parser that starts in reasoning (the prompt
already opened `<think>`) reads the output as reasoning up to `</think>`, a leading `<think>` dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of text that is a proper start of marker (held back until decided)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningParser:
    name: ClassVar[str]
    prompt_opens_think: ClassVar[bool] = False  # the chat template ends the prompt inside <think>

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning or self.prompt_opens_think

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content), None for either that is empty."""
        body = text.lstrip()
        if body.startswith(OPEN):
            body = body[len(OPEN) :]
        elif not self.starts_in_reasoning:
            return None, text.lstrip() or None
        reasoning, _, content = body.partition(CLOSE)
        return reasoning.strip() or None, content.lstrip() or None

    def stream(self) -> ReasoningStream:
        """A fresh incremental parser for one choice."""
        return ReasoningStream(self.starts_in_reasoning)


class ReasoningStream:
    """One choice's text as it is generated: feed() each new piece, finish() at the end."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._state = "opening"  # "opening" (is there a leading <think>?), "reasoning" or "content"
        self._buf = ""  # text not yet decided
        self._reasoning_started = False
        self._held_space = ""  # the reasoning's trailing whitespace: sent only if more reasoning follows
        self._content_started = False

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        delta = ReasoningDelta()
        if self._state == "opening":
            body = self._buf.lstrip()
            if body.startswith(OPEN):
                self._buf = body[len(OPEN) :]
                self._state = "reasoning"
            elif not final and OPEN.startswith(body):
                return delta
            else:
                self._state = "reasoning" if self._starts_in_reasoning else "content"
        if self._state == "reasoning":
            close = self._buf.find(CLOSE)
            if close == -1:
                end = len(self._buf) - (0 if final else _partial_marker(self._buf, CLOSE))
                delta.reasoning = self._reasoning(self._buf[:end])
                self._buf = self._buf[end:]
                return delta
            delta.reasoning = self._reasoning(self._buf[:close])
            self._buf = self._buf[close + len(CLOSE) :]
            self._state = "content"
        text, self._buf = self._buf, ""
        if not self._content_started:
            text = text.lstrip()
            self._content_started = bool(text)
        delta.content = text
        return delta

    def _reasoning(self, piece: str) -> str:
        """The part of a new piece of reasoning to send: leading whitespace dropped, trailing whitespace held."""
        text = self._held_space + piece if self._reasoning_started else piece.lstrip()
        sent = text.rstrip()
        self._held_space = text[len(sent) :]
        self._reasoning_started = self._reasoning_started or bool(sent)
        return sent


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: its chat template opens <think> in the prompt; no </think> means all of it is reasoning."""

    name = "deepseek_r1"
    prompt_opens_think = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only inside a <think> block of the output (none with enable_thinking=false)."""

    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None
