"""What /v1/chat/completions adds to plain generation: tool calling, reasoning, template options.

A request's `tools` and `tool_choice` make a ToolPlan:
- "none": the tools reach the template, the output is plain content.
- "auto": the model writes calls in its own format and the configured tool-call parser
  (server/tool_parsers.py) takes them out of the text.
- "required": the output is held (by a JSON-schema grammar) to a JSON array of one or more
  {"name": ..., "parameters": {...}} objects, one per call, each name one of the tools and its
  parameters valid for that tool's schema; parallel_tool_calls=false allows exactly one.
- a named function: the output is held to that function's parameters schema, and is its arguments.

An OutputParser then turns each choice's text into content, reasoning_content (server/reasoning.py,
when a reasoning parser is configured and no grammar holds the output) and tool calls, for a whole
text or stream delta by stream delta. Both give the same result for the same text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.sampling_params import Constraint, InvalidParameter
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunction,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCallOut,
)
from server.reasoning import ReasoningParser, get_reasoning_parser
from server.tool_parsers import ToolCall, ToolParser, get_tool_parser, new_call_id

# Sampling defaults a model's generation_config.json may hold, by their request names.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class ChatOptions:
    """The server-wide chat settings (from ServerConfig)."""

    tool_parser: type[ToolParser] | None = None
    auto_tool_choice: bool = False
    reasoning_parser: type[ReasoningParser] | None = None
    chat_template: str | None = None  # the template text; None: the tokenizer's
    generation_defaults: dict[str, float | int] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config, model_dir: str) -> ChatOptions:
        """Raises ValueError for a combination that cannot serve (a start-up error)."""
        if config.enable_auto_tool_choice and not config.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser to say how the model writes calls")
        template = config.chat_template
        if template is not None and Path(template).is_file():
            template = Path(template).read_text()
        return cls(
            tool_parser=get_tool_parser(config.tool_call_parser) if config.tool_call_parser else None,
            auto_tool_choice=config.enable_auto_tool_choice,
            reasoning_parser=get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None,
            chat_template=template,
            generation_defaults=generation_defaults(config.generation_config, model_dir),
        )


def generation_defaults(setting: str, model_dir: str) -> dict[str, float | int]:
    """The sampling defaults of a generation_config.json: the model's ("auto"), none ("vllm"), or a folder's."""
    if setting == "vllm":
        return {}
    folder = Path(model_dir if setting == "auto" else setting)
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting}: no generation_config.json there")
        return {}
    values = json.loads(path.read_text())
    return {name: values[name] for name in GENERATION_DEFAULTS if values.get(name) is not None}


def with_defaults(body, defaults: dict[str, float | int]):
    """The request with the model's sampling defaults for the fields it did not set."""
    missing = {name: value for name, value in defaults.items() if name not in body.model_fields_set}
    return body.model_copy(update=missing) if missing else body


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as chat templates read them. Raises InvalidParameter naming a bad one."""
    conversation = []
    for i, message in enumerate(messages):
        role = message.role
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise InvalidParameter(f"messages[{i}].role", f"messages[{i}].role '{role}' is not supported")
        text = _text(message, i)
        # OpenAI's newer name for the system role; chat templates know only "system".
        entry: dict = {"role": "system" if role == "developer" else role, "content": text}
        if role == "tool":
            if message.tool_call_id is None:
                message_ = "a tool message needs the tool_call_id it answers"
                raise InvalidParameter(f"messages[{i}].tool_call_id", message_)
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            if role != "assistant":
                raise InvalidParameter(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
            # Templates write the arguments with tojson, so they get the object, not its JSON text.
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                }
                for call in message.tool_calls
            ]
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        if message.name is not None:
            entry["name"] = message.name
        conversation.append(entry)
    return conversation


def _text(message: ChatMessage, i: int) -> str:
    if message.content is None:
        if message.role == "assistant" and message.tool_calls:
            return ""  # templates concatenate content; an empty string writes nothing
        raise InvalidParameter(f"messages[{i}].content", f"messages[{i}] needs content")
    if isinstance(message.content, str):
        return message.content
    for j, part in enumerate(message.content):
        if part.type != "text":
            raise InvalidParameter(
                f"messages[{i}].content[{j}].type", f"content part type '{part.type}' is not supported: only text"
            )
        if part.text is None:
            raise InvalidParameter(f"messages[{i}].content[{j}].text", "a text content part needs its text")
    # Several text parts are one message; a newline keeps their words apart (as vLLM joins them).
    return "\n".join(part.text for part in message.content)


def _arguments(text: str) -> dict | str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


# ----- tool plans -----


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict] | None = None  # for the chat template
    function: str | None = None  # mode "named"
    constraint: Constraint | None = None  # "required" and "named": what holds the output


def plan_tools(body: ChatCompletionRequest, options: ChatOptions) -> ToolPlan:
    """The ToolPlan of a request; raises InvalidParameter for a choice the tools or server cannot serve."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidParameter("tool_choice", "tool_choice needs tools")
        return ToolPlan("none")
    specs = [tool.model_dump(exclude_none=True) for tool in tools]
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise InvalidParameter("tools", "tool names must be unique")
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if choice == "none":
        return ToolPlan("none", specs)
    if choice == "auto":
        if not (options.auto_tool_choice and options.tool_parser):
            raise InvalidParameter(
                "tool_choice",
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser; '
                'send tool_choice "required" or a named function, which work without them',
            )
        return ToolPlan("auto", specs)
    if choice == "required":
        return ToolPlan("required", specs, constraint=_required_constraint(body, specs))
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in names:
        raise InvalidParameter("tool_choice", f"tool_choice names '{name}', which is not among the tools")
    parameters = tools[names.index(name)].function.parameters or {"type": "object"}
    return ToolPlan("named", specs, name, Constraint("json", json.dumps(parameters), "tools"))


def _required_constraint(body: ChatCompletionRequest, specs: list[dict]) -> Constraint:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "const": spec["function"]["name"]},
                "parameters": spec["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for spec in specs
    ]
    schema: dict = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not body.parallel_tool_calls:
        schema["maxItems"] = 1
    return Constraint("json", json.dumps(schema), "tools")


# ----- output parsing -----


@dataclass
class ParsedChoice:
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


def tool_calls_out(calls: list[ToolCall]) -> list[ToolCallOut]:
    return [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def _finish(reason: str | None, calls: bool) -> str | None:
    # A choice that ends in calls says so; one cut by max_tokens stays "length".
    return "tool_calls" if calls and reason == "stop" else reason


def _required_calls(text: str) -> list[ToolCall] | None:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and "name" in i for i in items):
        return None
    return [ToolCall(new_call_id(), i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items]


@dataclass
class OutputParser:
    """Splits a request's choices into content, reasoning and tool calls, per its ToolPlan."""

    plan: ToolPlan
    options: ChatOptions
    starts_in_reasoning: bool = False  # the prompt ends inside an open <think>

    @property
    def active(self) -> bool:
        """Whether the text needs parsing at all (else it is content as generated)."""
        return self.plan.mode != "none" or self._reasoning() is not None

    def _reasoning(self) -> ReasoningParser | None:
        if self.options.reasoning_parser is None or self.plan.constraint is not None:
            return None  # a tool-call grammar holds the whole output: there is no reasoning in it
        return self.options.reasoning_parser(self.starts_in_reasoning)

    def _tool_parser(self) -> ToolParser:
        return self.options.tool_parser(self.plan.tools)

    def parse(self, text: str, finish_reason: str | None) -> ParsedChoice:
        mode = self.plan.mode
        if mode == "named" and finish_reason != "length":
            return ParsedChoice(None, None, [ToolCall(new_call_id(), self.plan.function, text)], "tool_calls")
        if mode == "required" and finish_reason != "length":
            calls = _required_calls(text)
            if calls is not None:
                return ParsedChoice(None, None, calls, "tool_calls")
        reasoning, content = None, text
        parser = self._reasoning()
        if parser is not None:
            reasoning, content = parser.parse(text)
        calls: list[ToolCall] = []
        if mode == "auto" and content:
            parsed = self._tool_parser().parse(content)
            content, calls = parsed.content, parsed.tool_calls
        return ParsedChoice(content or None, reasoning, calls, _finish(finish_reason, bool(calls)))

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


@dataclass
class StreamPiece:
    """What one choice's stream sends next (any part may be empty)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ChoiceStream:
    """One choice's stream: text deltas in, StreamPieces out, agreeing with OutputParser.parse."""

    def __init__(self, parser: OutputParser):
        self.plan = parser.plan
        self.reasoning = parser._reasoning()
        self.reasoning_stream = self.reasoning.stream() if self.reasoning is not None else None
        self.tool_stream = parser._tool_parser().stream() if self.plan.mode == "auto" else None
        self.required = _ArrayItems() if self.plan.mode == "required" else None
        self.num_calls = 0
        self.text = ""  # all of it, for a required output that turns out not to parse

    def feed(self, text: str) -> StreamPiece:
        self.text += text
        if self.plan.mode == "named":
            return self._named(text)
        if self.required is not None:
            return self._calls([_required_calls(f"[{item}]") for item in self.required.feed(text)])
        return self._content(text, final=False)

    def finish(self, finish_reason: str | None) -> tuple[StreamPiece, str | None]:
        """The rest, and the choice's finish_reason as the response states it."""
        if self.plan.mode in ("named", "required"):  # the grammar made the whole output calls
            return StreamPiece(), "length" if finish_reason == "length" else "tool_calls"
        piece = self._content("", final=True)
        return piece, _finish(finish_reason, self.num_calls > 0)

    def _named(self, text: str) -> StreamPiece:
        calls = []
        if self.num_calls == 0:
            self.num_calls = 1
            head = DeltaFunction(name=self.plan.function, arguments="")
            calls.append(DeltaToolCall(index=0, id=new_call_id(), type="function", function=head))
        if text:
            calls.append(DeltaToolCall(index=0, function=DeltaFunction(arguments=text)))
        return StreamPiece(tool_calls=calls)

    def _calls(self, batches: list[list[ToolCall] | None]) -> StreamPiece:
        piece = StreamPiece()
        for calls in batches:
            for call in calls or []:
                head = DeltaFunction(name=call.name, arguments=call.arguments)
                piece.tool_calls.append(DeltaToolCall(index=self.num_calls, id=call.id, type="function", function=head))
                self.num_calls += 1
        return piece

    def _content(self, text: str, final: bool) -> StreamPiece:
        piece = StreamPiece()
        content = text
        if self.reasoning_stream is not None:
            delta = self.reasoning_stream.finish() if final else self.reasoning_stream.feed(text)
            piece.reasoning, content = delta.reasoning, delta.content
        if self.tool_stream is None:
            piece.content = content
            return piece
        deltas = [self.tool_stream.feed(content)] if content else []
        if final:
            deltas.append(self.tool_stream.finish())
        for delta in deltas:
            piece.content += delta.content
            for call in delta.tool_calls:
                self.num_calls = max(self.num_calls, call.index + 1)
                function = DeltaFunction(name=call.name, arguments=call.arguments)
                typ = "function" if call.id is not None else None
                piece.tool_calls.append(DeltaToolCall(index=call.index, id=call.id, type=typ, function=function))
        return piece


class _ArrayItems:
    """Cuts a streamed JSON array of objects into its items' text, each when its closing brace arrives."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False
        self.item = ""

    def feed(self, text: str) -> list[str]:
        items = []
        for ch in text:
            if self.depth >= 2:
                self.item += ch
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.item = ch
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}":
                    items.append(self.item)
                    self.item = ""
        return items
