"""Tool-call parsers: a chat model's generated text to OpenAI tool calls, whole (parse) or as it streams.

Each parser reads one model family's markup, by the names vLLM's --tool-call-parser uses. Both paths run
the same scanner, a stream class's `_scan`: parse scans the whole text at once as the end of generation;
a stream scans what has arrived and consumes only what no later text can change, so every split of the
text into chunks gives what parse gives. A tool call is sent whole (id, name and arguments in one delta)
once its markup is complete and valid: a call that turns out malformed stays content, and a call already
sent could not be taken back.

Malformed markup never raises: its text is content and no call is made from it.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import ClassVar

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A tool call id as OpenAI writes them: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass
class ParsedOutput:
    content: str | None  # the text that is not a tool call; None when it is empty or only whitespace
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    index: int  # the call's position in the message's tool_calls
    id: str | None = None  # id and name come once, in the call's first delta
    name: str | None = None
    arguments: str = ""  # a fragment of the arguments JSON text


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def _reject_constant(name: str) -> None:
    # NaN and Infinity are Python's extensions to JSON; arguments must be JSON that every client reads.
    raise ValueError(f"{name} is not JSON")


# strict=False: models write raw newlines and tabs inside argument strings (code, multi-line text);
# json.dumps escapes them again.
_JSON = json.JSONDecoder(strict=False, parse_constant=_reject_constant)
_SPACE = re.compile(r"\s*")


def _decode(text: str) -> object | None:
    """The JSON value that is all of text (whitespace around it allowed), or None."""
    try:
        return _JSON.decode(text)
    except (ValueError, RecursionError):
        return None


def _decode_at(text: str, pos: int) -> tuple[object, int] | None:
    """The JSON value that starts at pos and where it ends, or None: invalid, or not yet complete."""
    try:
        return _JSON.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def _skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of text that is a proper start of marker (held back until decided)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolParser:
    """Turns one model family's tool-call markup into OpenAI tool calls."""

    name: ClassVar[str]
    stream_class: ClassVar[type[ToolStream]]

    def __init__(self, tools: list[dict] | None = None) -> None:
        # A call to a function the request did not offer is no call; without tools any name goes.
        self.tool_names = {tool["function"]["name"] for tool in tools} if tools else None

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        stream._buf = text
        pieces = stream._scan(final=True)
        content = "".join(piece for piece in pieces if isinstance(piece, str))
        calls = [piece for piece in pieces if isinstance(piece, ToolCall)]
        return ParsedOutput(content if content.strip() else None, calls)

    def stream(self) -> ToolStream:
        """A fresh incremental parser for one choice."""
        return self.stream_class(self)

    def make_call(self, name: object, arguments: object) -> ToolCall | None:
        """The call, or None when the name or the arguments are not those of a call."""
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        if self.tool_names is not None and name not in self.tool_names:
            return None
        return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))

    def call_from_object(self, obj: object) -> ToolCall | None:
        """The call a JSON object {"name": ..., "arguments": {...}} makes ("parameters" is Llama's key)."""
        if not isinstance(obj, dict):
            return None
        return self.make_call(obj.get("name"), obj.get("arguments", obj.get("parameters")))


class ToolStream:
    """One choice's text as it is generated: feed() each new piece, finish() at the end."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._buf = ""  # text not yet decided
        self._num_calls = 0
        # Whitespace-only content is no content (parse gives None), so whitespace waits until text follows.
        self._held_space = ""
        self._content_started = False

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        return self._delta(self._scan(final=False))

    def finish(self) -> StreamDelta:
        return self._delta(self._scan(final=True))

    def _scan(self, final: bool) -> list[str | ToolCall]:
        """Consumes from the buffer's start what is decided (all of it when final): content and calls, in order."""
        raise NotImplementedError

    def _take(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        return taken

    def _delta(self, pieces: list[str | ToolCall]) -> StreamDelta:
        delta = StreamDelta()
        for piece in pieces:
            if isinstance(piece, ToolCall):
                delta.tool_calls.append(ToolCallDelta(self._num_calls, piece.id, piece.name, piece.arguments))
                self._num_calls += 1
            elif self._content_started:
                delta.content += piece
            else:
                self._held_space += piece
                if self._held_space.strip():
                    delta.content += self._held_space
                    self._content_started = True
        return delta


class HermesStream(ToolStream):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, anywhere in the text."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _scan(self, final: bool) -> list[str | ToolCall]:
        pieces: list[str | ToolCall] = []
        while self._buf:
            start = self._buf.find(self.OPEN)
            if start == -1:
                pieces.append(self._take(len(self._buf) - (0 if final else _partial_marker(self._buf, self.OPEN))))
                break
            pieces.append(self._take(start))
            close = self._buf.find(self.CLOSE, len(self.OPEN))
            if close == -1:
                if not final:
                    break  # the block is still being written
                # Generation stopped inside the block: a complete call is still a call.
                block = self._take(len(self._buf))
                pieces.append(self._parser.call_from_object(_decode(block[len(self.OPEN) :])) or block)
                break
            call = self._parser.call_from_object(_decode(self._buf[len(self.OPEN) : close]))
            block = self._take(close + len(self.CLOSE))
            pieces.append(call or block)
        return pieces


class Llama3JsonStream(ToolStream):
    """`{"name": ..., "parameters": {...}}` objects making up the output, after an optional `<|python_tag|>`,
    separated by whitespace and an optional ";". Each object of the leading run of valid ones is a call and
    the text after them is content; when the first is no call (or the text starts otherwise), all is content."""

    TAG = "<|python_tag|>"

    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self._after_call = False
        self._is_content = False  # decided: the rest is content

    def _scan(self, final: bool) -> list[str | ToolCall]:
        pieces: list[str | ToolCall] = []
        while not self._is_content:
            buf = self._buf
            pos = _skip_space(buf, 0)
            if self._after_call:
                if buf.startswith(";", pos):
                    pos = _skip_space(buf, pos + 1)
                content_from = pos  # the separator is markup
            else:
                if buf.startswith(self.TAG, pos):
                    pos = _skip_space(buf, pos + len(self.TAG))
                elif not final and self.TAG.startswith(buf[pos:]):
                    return pieces
                content_from = 0
            if pos == len(buf) and not final:
                return pieces
            call, end = None, pos
            if buf.startswith("{", pos):
                decoded = _decode_at(buf, pos)
                if decoded is None and not final:
                    return pieces  # the object is still being written
                if decoded is not None:
                    call, end = self._parser.call_from_object(decoded[0]), decoded[1]
            if call is None:
                self._take(content_from)
                self._is_content = True
            else:
                self._take(end)
                pieces.append(call)
                self._after_call = True
        pieces.append(self._take(len(self._buf)))
        return pieces


class MistralStream(ToolStream):
    """`[TOOL_CALLS]` and either a JSON array of {"name", "arguments"} objects (all valid, or the array is
    content) or `name[ARGS]{...}`, each call after its own `[TOOL_CALLS]`. Text around them is content."""

    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _NAME = re.compile(r"[\w.-]*")

    def _scan(self, final: bool) -> list[str | ToolCall]:
        pieces: list[str | ToolCall] = []
        while self._buf:
            start = self._buf.find(self.MARK)
            if start == -1:
                pieces.append(self._take(len(self._buf) - (0 if final else _partial_marker(self._buf, self.MARK))))
                break
            pieces.append(self._take(start))
            taken = self._calls(final)
            if taken is None:
                break
            pieces.extend(taken)
        return pieces

    def _calls(self, final: bool) -> list[str | ToolCall] | None:
        """Takes the calls of the `[TOOL_CALLS]` the buffer starts with, or the text they failed to be;
        None while undecided."""
        buf = self._buf
        pos = _skip_space(buf, len(self.MARK))
        if buf.startswith("[", pos):
            decoded = _decode_at(buf, pos)
            if decoded is None:
                return None if not final else [self._take(len(buf))]
            value, end = decoded
            calls = [self._parser.call_from_object(obj) for obj in value] if isinstance(value, list) else []
            text = self._take(end)
            return calls if calls and all(calls) else [text]
        name_end = self._NAME.match(buf, pos).end()
        if not buf.startswith(self.ARGS, name_end):
            if not final and self.ARGS.startswith(buf[name_end:]):
                return None
            return [self._take(name_end)]
        args = _skip_space(buf, name_end + len(self.ARGS))
        if args == len(buf) and not final:
            return None
        if not buf.startswith("{", args):
            return [self._take(args)]
        decoded = _decode_at(buf, args)
        if decoded is None:
            return None if not final else [self._take(len(buf))]
        call = self._parser.make_call(buf[pos:name_end], decoded[0])
        text = self._take(decoded[1])
        return [call or text]


class PythonicStream(ToolStream):
    """The whole output is a Python list of calls with literal keyword arguments, `[f(a=1), g(b="x")]`,
    maybe inside `<|python_start|>` ... `<|python_end|>`; any other text is all content."""

    START, END = "<|python_start|>", "<|python_end|>"
    _LIST_START = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")  # "[name(": a call list, once complete
    _LIST_PREFIX = re.compile(r"(\[\s*([A-Za-z_]\w*\s*)?)?")  # what can still grow into "[name("

    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self._is_content = False  # decided: all of the text is content

    def _scan(self, final: bool) -> list[str | ToolCall]:
        if not self._is_content:
            if final:
                calls = self._call_list(self._buf)
                if calls:
                    self._buf = ""
                    return calls
            elif self._may_be_call_list(self._buf):
                # Held until the end: text after a complete list would still make all of it content.
                return []
            self._is_content = True
        return [self._take(len(self._buf))]

    def _may_be_call_list(self, text: str) -> bool:
        body = text.lstrip()
        if body.startswith(self.START):
            body = body[len(self.START) :].lstrip()
        elif self.START.startswith(body):
            return True
        return bool(self._LIST_START.match(body) or self._LIST_PREFIX.fullmatch(body))

    def _call_list(self, text: str) -> list[ToolCall] | None:
        body = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        # The streamed path decides from the start "[name(" alone, so parse holds to it too.
        if not self._LIST_START.match(body):
            return None
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List):
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                return None
            # Keyword arguments only: a positional one (or a **mapping) has no parameter name for the JSON object.
            if node.args or any(kw.arg is None for kw in node.keywords):
                return None
            try:
                arguments = {kw.arg: _json_value(ast.literal_eval(kw.value)) for kw in node.keywords}
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
            call = self._parser.make_call(node.func.id, arguments)
            if call is None:
                return None
            calls.append(call)
        return calls


def _json_value(value: object) -> object:
    """A Python literal as the JSON value it stands for (tuples become lists); ValueError if it has none."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _json_value(item) for key, item in value.items()}
    raise ValueError(f"{type(value).__name__} {value!r} is not a JSON value")


class HermesToolParser(ToolParser):
    """Hermes, Qwen2.5 and Qwen3."""

    name = "hermes"
    stream_class = HermesStream


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calls."""

    name = "llama3_json"
    stream_class = Llama3JsonStream


class MistralToolParser(ToolParser):
    """Mistral: the JSON array of v0.3-era models and the `name[ARGS]{...}` form of newer ones."""

    name = "mistral"
    stream_class = MistralStream


class PythonicToolParser(ToolParser):
    """Llama 3.2 / Llama 4 pythonic calls."""

    name = "pythonic"
    stream_class = PythonicStream


PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None
