"""The OpenAI Responses API (`/v1/responses`), served by the chat machinery.

A request becomes a chat request. `instructions` is a leading system message. The stored conversation of
`previous_response_id`, then the `input` items, become chat messages, so the chat template renders them as
it renders a chat history: the assistant output items of one turn (reasoning, message, function_call) merge
into one assistant message with reasoning_content and tool_calls, and a function_call_output is a tool
message. The flat function `tools`, `tool_choice` and `text.format` become the chat ToolPlan and a
structured-output constraint. The chat OutputParser splits the output into reasoning, text and calls, which
become output items: a reasoning item, a message with one output_text, function_call items; a stream sends
the same items as Responses events (EventWriter). Finished responses asked to be stored are kept in a
bounded in-memory LRU (ResponseStore) for `previous_response_id` and `GET /v1/responses/{id}`.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from pydantic_core import to_json
from starlette.requests import Request

from engine.sampling_params import Constraint, InvalidParameter, SamplingParams
from engine.sequence import RequestOutput
from server import render
from server.chat import ChoiceStream, OutputParser, StreamPiece, plan_tools, with_defaults
from server.protocol import (
    NOT_SUPPORTED,
    TOOL_CHOICE_NEEDS_TOOLS,
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    DeltaToolCall,
    ErrorInfo,
    Float,
    FunctionCall,
    FunctionDefinition,
    Int,
    NamedFunction,
    NamedToolChoice,
    RequestBody,
    Tool,
    ToolCallIn,
    only_with,
)
from server.streaming import ClientDisconnected, Generation

if TYPE_CHECKING:
    from server.api import _Server

# Engine and chat parameter names as the Responses API calls them.
_RENAMED = {"max_tokens": "max_output_tokens", "prompt": "input"}
_TEXT_PARTS = ("input_text", "output_text")


class ResponsesError(Exception):
    """A refusal that is not a bad value: an unknown response id (404), a feature pagoda does not offer (400)."""

    def __init__(self, status: int, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# ----- the request -----


class InputPart(ContentPart):
    """A text part of an input item: input_text or output_text (other types parse, and are refused by name)."""

    # Any part parses; where the text is used (a message's content, a function_call_output's output), _TEXT
    # says what is served (ContentPart's chat-only "text" type does not apply here).
    model_config = ConfigDict(json_schema_extra=lambda schema: schema.update(required=["type"]))


_STRING = {"type": "string"}
# A message's content or a function_call_output's output: text, or text parts, each with its text.
_TEXT = {
    "anyOf": [
        _STRING,
        {
            "type": "array",
            "items": {
                "required": ["type", "text"],
                "properties": {"type": {"enum": list(_TEXT_PARTS)}, "text": _STRING},
            },
        },
    ]
}
# What conversation_messages() takes of each item type, for the OpenAPI document.
_ITEM_SHAPES = {
    "oneOf": [
        {
            "properties": {
                "type": {"const": "message"},
                "role": {"enum": ["user", "system", "developer", "assistant"]},
                "content": _TEXT,
            },
            "required": ["role", "content"],
        },
        {
            "properties": {
                "type": {"const": "function_call"},
                "call_id": _STRING,
                "name": _STRING,
                "arguments": _STRING,
            },
            "required": ["type", "call_id", "name", "arguments"],
        },
        {
            "properties": {
                "type": {"const": "function_call_output"},
                "call_id": _STRING,
                "output": _TEXT,
            },
            "required": ["type", "call_id", "output"],
        },
        {"properties": {"type": {"const": "reasoning"}}, "required": ["type"]},
    ]
}


class InputItem(BaseModel):
    """One item of `input`: a message, a function_call, a function_call_output or a reasoning item.

    Loose on purpose: clients send a response's output items back as input, with fields (id, status,
    annotations, ...) that change nothing here; `conversation_messages` checks what each type needs.
    """

    model_config = ConfigDict(extra="allow", json_schema_extra=_ITEM_SHAPES)
    type: str = "message"  # a message may leave it out
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


def _function_tool_only(schema: dict[str, Any]) -> None:
    schema["properties"]["type"] = {"const": "function"}
    schema["properties"]["name"] = {"type": "string", "pattern": r"^[a-zA-Z0-9_.-]{1,64}$"}
    schema["required"] = ["type", "name"]
    schema["additionalProperties"] = False


class FunctionTool(BaseModel):
    # Loose, so a built-in tool (its own fields) parses and is refused by its type, by name; the document says
    # what is served: function tools.
    model_config = ConfigDict(extra="allow", json_schema_extra=_function_tool_only)
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextConfig(RequestBody):
    format: TextFormat | None = None
    verbosity: str | None = NOT_SUPPORTED


_TOOL_CHOICE = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
            "required": ["type", "name"],
        },
    ]
}


class ResponseStreamOptions(RequestBody):
    include_obfuscation: StrictBool = False  # accepted: pagoda's events carry no padding to begin with


class ResponsesRequest(RequestBody):
    model: str | None = None
    # Not empty (the route says "input is empty"; a pydantic bound would say "should be a string").
    input: str | list[InputItem] = Field(json_schema_extra=lambda schema: schema["anyOf"][1].update(minItems=1))
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = Field(None, json_schema_extra=_TOOL_CHOICE)
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    store: StrictBool = True
    stream: StrictBool = False
    stream_options: ResponseStreamOptions | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    # Identifiers and hints that do not change the output, so accepting them changes nothing.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    max_tool_calls: Int | None = None  # bounds built-in tool calls, and pagoda runs none
    # OpenAI parameters pagoda does not implement: refused when they ask for something (unsupported()); the
    # document gives the values that ask for nothing.
    truncation: Literal["auto", "disabled"] = Field("disabled", json_schema_extra={"const": "disabled"})
    background: StrictBool = Field(False, json_schema_extra={"const": False})
    include: list[str] | None = Field(None, json_schema_extra={"maxItems": 0})
    top_logprobs: Int | None = Field(None, json_schema_extra={"const": 0})
    reasoning: dict[str, Any] | None = Field(None, json_schema_extra={"additionalProperties": {"type": "null"}})
    conversation: Any = NOT_SUPPORTED
    prompt: Any = NOT_SUPPORTED
    context_management: Any = NOT_SUPPORTED

    model_config = ConfigDict(
        json_schema_extra={"allOf": [only_with("stream_options", "stream"), TOOL_CHOICE_NEEDS_TOOLS]}
    )

    def unsupported(self) -> str | None:
        """The name of the first parameter that asks for what pagoda does not do, or None."""
        if self.background:
            return "background"
        if self.include:
            return "include"
        if self.top_logprobs:
            return "top_logprobs"
        if self.truncation == "auto":
            return "truncation"
        # Clients often send reasoning with every option null, which asks for nothing.
        if self.reasoning and any(value is not None for value in self.reasoning.values()):
            return "reasoning"
        for name in ("conversation", "prompt", "context_management"):
            if getattr(self, name) is not None:
                return name
        if self.text is not None and self.text.verbosity is not None:
            return "text.verbosity"
        return None

    def input_items(self) -> list[InputItem]:
        return [InputItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    def chat_request(self, messages: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request of these parameters with `messages`. Only the sampling fields the client set are
        set, so with_defaults fills the others from the model's generation config, as it does for chat."""
        sampling = {name: getattr(self, name) for name in ("temperature", "top_p") if name in self.model_fields_set}
        return ChatCompletionRequest(
            messages=messages,
            max_tokens=self.max_output_tokens,
            tools=_chat_tools(self.tools) or None,
            tool_choice=self._chat_tool_choice(),
            parallel_tool_calls=self.parallel_tool_calls,
            **sampling,
        )

    def _chat_tool_choice(self) -> str | NamedToolChoice | None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return NamedToolChoice(type="function", function=NamedFunction(name=choice["name"]))
        raise InvalidParameter(
            "tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": NAME}'
        )

    def constraint(self) -> Constraint | None:
        """The structured-output constraint `text.format` asks for."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Constraint("json_object", "", "text.format")
        if fmt.schema_ is None:
            raise InvalidParameter("text.format.schema", "a json_schema format needs its schema")
        return Constraint("json", json.dumps(fmt.schema_), "text.format.schema")


def _chat_tools(tools: list[FunctionTool]) -> list[Tool]:
    """The function tools in chat's nested shape; anything else is refused by name."""
    result = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise InvalidParameter(f"tools[{i}].type", f"tool type '{tool.type}' is not supported: only function tools")
        extra = next(iter(tool.model_extra or {}), None)
        if extra is not None:
            raise InvalidParameter(f"tools[{i}].{extra}", f"the function tool field '{extra}' is not supported")
        if tool.name is None:
            raise InvalidParameter(f"tools[{i}].name", "a function tool needs its name")
        try:
            function = FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
            )
        except ValidationError as exc:  # the name's pattern: the only check the fields' types leave
            raise InvalidParameter(f"tools[{i}].name", f"tools[{i}].name: {exc.errors()[0]['msg']}") from None
        result.append(Tool(type="function", function=function))
    return result


def _part_text(parts: str | list[ContentPart], param: str) -> str:
    if isinstance(parts, str):
        return parts
    for j, part in enumerate(parts):
        if part.type not in _TEXT_PARTS:
            raise InvalidParameter(f"{param}[{j}].type", f"content part type '{part.type}' is not supported: only text")
        if part.text is None:
            raise InvalidParameter(f"{param}[{j}].text", "a text content part needs its text")
    # As chat joins a message's text parts.
    return "\n".join(part.text for part in parts)


def conversation_messages(history: list[InputItem], items: list[InputItem]) -> list[ChatMessage]:
    """The chat messages of a stored conversation followed by a request's input items. Raises
    InvalidParameter naming the bad item (`input[i]...`); stored items were checked when they came in."""
    messages: list[ChatMessage] = []
    turn: ChatMessage | None = None  # the assistant message that the current turn's output items extend
    for k, item in enumerate(history + items):
        param = f"input[{k - len(history)}]"
        kind = item.type
        if kind == "message":
            if item.role not in ("user", "system", "developer", "assistant"):
                raise InvalidParameter(f"{param}.role", f"{param}.role '{item.role}' is not supported")
            if item.content is None:
                raise InvalidParameter(f"{param}.content", f"{param} needs content")
            text = _part_text(item.content, f"{param}.content")
            if item.role != "assistant":
                messages.append(ChatMessage(role=item.role, content=text))
                turn = None
            elif turn is not None and not turn.content and not turn.tool_calls:  # the turn so far is reasoning
                turn.content = text
            else:
                turn = ChatMessage(role="assistant", content=text)
                messages.append(turn)
        elif kind == "function_call":
            for field in ("call_id", "name", "arguments"):
                if getattr(item, field) is None:
                    raise InvalidParameter(f"{param}.{field}", f"a function_call item needs its {field}")
            if turn is None:
                turn = ChatMessage(role="assistant", content="", tool_calls=[])
                messages.append(turn)
            call = ToolCallIn(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            turn.tool_calls = [*(turn.tool_calls or []), call]
        elif kind == "function_call_output":
            if item.call_id is None:
                raise InvalidParameter(f"{param}.call_id", "a function_call_output item needs the call_id it answers")
            if item.output is None:
                raise InvalidParameter(f"{param}.output", "a function_call_output item needs its output")
            output = _part_text(item.output, f"{param}.output")
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=output))
            turn = None
        elif kind == "reasoning":
            content = item.content or []
            text = content if isinstance(content, str) else "\n".join(part.text or "" for part in content)
            if turn is None or turn.content or turn.tool_calls:
                turn = ChatMessage(role="assistant", content="")
                messages.append(turn)
            turn.reasoning_content = text
        else:
            raise InvalidParameter(f"{param}.type", f"input item type '{kind}' is not supported")
    return messages


# ----- the response -----


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)


class MessageItem(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list = Field(default_factory=list)
    content: list[ReasoningText]
    status: str = "completed"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(BaseModel):
    # Prefix-cache hits are not counted per request, so none are claimed.
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None
    max_output_tokens: int | None
    previous_response_id: str | None
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    store: bool
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


def output_items(parser: OutputParser, text: str, finish_reason: str | None) -> list[OutputItem]:
    """A whole output as items, as EventWriter streams them: reasoning, then the message (text, or empty when
    there is neither text nor a call), then the calls; the last is incomplete if the length limit cut it."""
    parsed = parser.parse(text, finish_reason)
    items: list[OutputItem] = []
    if parsed.reasoning:
        items.append(ReasoningItem(id=_new_id("rs"), content=[ReasoningText(text=parsed.reasoning)]))
    # Whitespace alone is no text (a stream holds it back until text follows).
    content = parsed.content if parsed.content and parsed.content.strip() else ""
    if content or not parsed.tool_calls:
        items.append(MessageItem(id=_new_id("msg"), content=[OutputText(text=content)]))
    for call in parsed.tool_calls:
        items.append(FunctionCallItem(id=_new_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments))
    if finish_reason == "length":
        items[-1].status = "incomplete"
    return items


def finished_response(
    draft: ResponseObject, items: list[OutputItem], out: RequestOutput, reasoning_tokens: int
) -> ResponseObject:
    """The response once its output is complete; `draft` is the response as it was created."""
    choice = out.outputs[0]
    incomplete = choice.finish_reason == "length"
    usage = ResponseUsage(
        input_tokens=len(out.prompt_token_ids),
        output_tokens=len(choice.token_ids),
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=len(out.prompt_token_ids) + len(choice.token_ids),
    )
    return draft.model_copy(
        update={
            "status": "incomplete" if incomplete else "completed",
            "completed_at": None if incomplete else int(time.time()),
            "incomplete_details": IncompleteDetails() if incomplete else None,
            "output": items,
            "usage": usage,
        }
    )


def _reasoning_text(items: list[OutputItem]) -> str:
    return "".join(part.text for item in items if isinstance(item, ReasoningItem) for part in item.content)


# ----- the stream -----


class EventWriter:
    """One response's event stream, as Server-Sent Events text: the engine's cumulative outputs in, events out.

    Items open and close one after another, each with its content part and deltas. A message opens at the
    first text that is not whitespace, so a stream and a whole output (output_items) agree on the items.
    """

    def __init__(self, draft: ResponseObject, stream: ChoiceStream):
        self.draft = draft
        self.stream = stream
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.calls: dict[int, FunctionCallItem] = {}  # by the parser's call index
        self.sequence_number = 0
        self.text_len = 0  # characters of the output text fed to the parser so far
        self.held_space = ""  # whitespace that would open a message: sent once text follows it

    def opening(self) -> str:
        created = self._event("response.created", response=self.draft)
        return created + self._event("response.in_progress", response=self.draft)

    def update(self, out: RequestOutput) -> str:
        choice = out.outputs[0]
        text, self.text_len = choice.text[self.text_len :], len(choice.text)
        events = self._piece(self.stream.feed(text)) if text else []
        if choice.finish_reason is not None:
            piece, _ = self.stream.finish(choice.finish_reason)
            events += self._piece(piece)
            if not any(isinstance(item, (MessageItem, FunctionCallItem)) for item in self.items):
                events += self._open_message()
            events += self._close("incomplete" if choice.finish_reason == "length" else "completed")
        return "".join(events)

    def closing(self, response: ResponseObject) -> str:
        return self._event(f"response.{response.status}", response=response)

    def error(self, info: ErrorInfo) -> str:
        return self._event("error", code=info.code, message=info.message, param=info.param)

    def _event(self, type: str, **fields: Any) -> str:
        data = to_json({"type": type, "sequence_number": self.sequence_number, **fields}).decode()
        self.sequence_number += 1
        return f"event: {type}\ndata: {data}\n\n"

    def _piece(self, piece: StreamPiece) -> list[str]:
        events = []
        if piece.reasoning:
            events += self._reasoning(piece.reasoning)
        if piece.content:
            events += self._content(piece.content)
        for call in piece.tool_calls:
            events += self._call(call)
        return events

    def _reasoning(self, text: str) -> list[str]:
        events = []
        item = self.open
        if not isinstance(item, ReasoningItem):
            item = ReasoningItem(id=_new_id("rs"), content=[], status="in_progress")
            events += self._open(item)
            events += self._add_part(item, ReasoningText(text=""))
        item.content[0].text += text
        index = len(self.items) - 1
        events.append(
            self._event(
                "response.reasoning_text.delta", item_id=item.id, output_index=index, content_index=0, delta=text
            )
        )
        return events

    def _content(self, text: str) -> list[str]:
        events = []
        if not isinstance(self.open, MessageItem):
            text, self.held_space = self.held_space + text, ""
            if not text.strip():
                self.held_space = text
                return events
            events += self._open_message()
        item = self.open
        item.content[0].text += text
        index = len(self.items) - 1
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=item.id,
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _call(self, call: DeltaToolCall) -> list[str]:
        events = []
        if call.id is not None:  # a call's first delta: its id and name
            item = FunctionCallItem(
                id=_new_id("fc"), call_id=call.id, name=call.function.name, arguments="", status="in_progress"
            )
            events += self._open(item)
            self.calls[call.index] = item
        item = self.calls[call.index]
        if call.function.arguments:
            item.arguments += call.function.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=self.items.index(item),
                    delta=call.function.arguments,
                )
            )
        return events

    def _open_message(self) -> list[str]:
        item = MessageItem(id=_new_id("msg"), content=[], status="in_progress")
        return self._open(item) + self._add_part(item, OutputText(text=""))

    def _open(self, item: OutputItem) -> list[str]:
        events = self._close("completed")
        self.items.append(item)
        self.open = item
        return [*events, self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _add_part(self, item: MessageItem | ReasoningItem, part: OutputText | ReasoningText) -> list[str]:
        event = self._event(
            "response.content_part.added", item_id=item.id, output_index=len(self.items) - 1, content_index=0, part=part
        )
        item.content.append(part)
        return [event]

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        index = len(self.items) - 1
        events = []
        if isinstance(item, FunctionCallItem):
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    arguments=item.arguments,
                )
            )
        else:
            part = item.content[0]
            done = "response.output_text.done" if isinstance(item, MessageItem) else "response.reasoning_text.done"
            extra = {"logprobs": []} if isinstance(item, MessageItem) else {}
            events.append(
                self._event(done, item_id=item.id, output_index=index, content_index=0, text=part.text, **extra)
            )
            events.append(
                self._event(
                    "response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part
                )
            )
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events


# ----- stored responses -----


@dataclass
class StoredResponse:
    response: ResponseObject
    input: list[InputItem]  # this request's items; instructions are not kept, as OpenAI does not carry them over
    previous: StoredResponse | None  # the response it continued (held here even once the store has dropped it)

    def conversation(self) -> list[InputItem]:
        """Every input and output item of the conversation, up to and including this response's output."""
        chain = []
        node: StoredResponse | None = self
        while node is not None:
            chain.append(node)
            node = node.previous
        items: list[InputItem] = []
        for node in reversed(chain):
            items += node.input
            items += [InputItem.model_validate(item.model_dump()) for item in node.response.output]
        return items


class ResponseStore:
    """Finished responses by id; beyond `capacity`, the least recently used is dropped."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str, param: str) -> StoredResponse:
        stored = self._responses.get(response_id)
        if stored is None:
            raise ResponsesError(404, f"no response with id '{response_id}' is stored", param, "response_not_found")
        self._responses.move_to_end(response_id)
        return stored

    def put(self, stored: StoredResponse) -> None:
        self._responses[stored.response.id] = stored
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def delete(self, response_id: str) -> None:
        self.get(response_id, "response_id")
        del self._responses[response_id]


# ----- the endpoint -----


class ResponsesAPI:
    """The /v1/responses routes' work, over the server's chat pieces and its `start` (validation, admission,
    rate limits, metrics and disconnects, as for chat)."""

    def __init__(
        self,
        server: _Server,
        start: Callable[[Request, render.Job, SamplingParams, int], Generation],
        error_info: Callable[[Exception], ErrorInfo],
        store: ResponseStore,
    ):
        self.server = server
        self.start = start
        self.error_info = error_info
        self.store = store

    async def create(self, body: ResponsesRequest, request: Request) -> ResponseObject | AsyncIterator[str]:
        """The finished response, or its stream of events (SSE text)."""
        server = self.server
        server.check_model(body.model)
        name = body.unsupported()
        if name is not None:
            raise ResponsesError(400, f"'{name}' is not supported by pagoda", name, "unsupported_parameter")
        if body.stream_options is not None and not body.stream:
            raise InvalidParameter("stream_options", "stream_options is only allowed with stream=true")
        previous = None
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id, "previous_response_id")
        items = body.input_items()
        options = server.settings.chat
        try:
            messages = conversation_messages(previous.conversation() if previous else [], items)
            if body.instructions is not None:
                messages.insert(0, ChatMessage(role="system", content=body.instructions))
            if not messages:
                raise InvalidParameter("input", "input is empty")
            chat = with_defaults(body.chat_request(messages), options.generation_defaults)
            plan = plan_tools(chat, options)
            constraint = body.constraint()
            if plan.constraint is not None and constraint is not None:
                raise InvalidParameter(constraint.param, f"tool_choice '{plan.mode}' cannot be combined with it")
            params = chat.sampling_params(chat.max_tokens, None, constraint or plan.constraint)
            prompt = await server.in_thread(
                server.chat_prompt, chat.messages, True, plan.tools, None, "input", large=server.is_large(request)
            )
            await server.compile(params)
            parser = OutputParser(plan, options, server.ends_in_reasoning(prompt))
            fmt = body.text.format if body.text is not None else None
            draft = ResponseObject(
                id=_new_id("resp"),
                created_at=int(time.time()),
                model=server.model_name,
                instructions=body.instructions,
                max_output_tokens=body.max_output_tokens,
                previous_response_id=body.previous_response_id,
                parallel_tool_calls=body.parallel_tool_calls,
                temperature=chat.temperature,
                top_p=chat.top_p,
                tool_choice=body.tool_choice or "auto",
                tools=[tool.model_dump(exclude_none=True) for tool in body.tools],
                text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                store=body.store,
                metadata=body.metadata,
                user=body.user,
            )
            job = render.Job(draft.id, draft.created_at, draft.model, [prompt], 1, False)
            generation = self.start(request, job, params, 0)
        except InvalidParameter as exc:
            raise InvalidParameter(_RENAMED.get(exc.param, exc.param), str(exc)) from None
        stored = StoredResponse(draft, items, previous)
        if body.stream:
            return self._events(generation, EventWriter(draft, parser.stream()), stored)
        last = None
        async for _, out in generation.outputs():
            last = out
        choice = last.outputs[0]
        return await self._finish(stored, output_items(parser, choice.text, choice.finish_reason), last)

    async def _events(self, generation: Generation, writer: EventWriter, stored: StoredResponse) -> AsyncIterator[str]:
        # An error after the headers are sent can only be told in the stream: it becomes an error event.
        try:
            yield writer.opening()
            last = None
            async for batch in generation.batches():
                last = batch[-1][1]
                events = "".join(writer.update(out) for _, out in batch)
                if events:
                    yield events
            yield writer.closing(await self._finish(stored, writer.items, last))
        except ClientDisconnected:
            return
        except Exception as exc:
            yield writer.error(self.error_info(exc))
        finally:
            generation.cancel()

    async def _finish(self, stored: StoredResponse, items: list[OutputItem], out: RequestOutput) -> ResponseObject:
        reasoning = _reasoning_text(items)
        tokens = 0
        if reasoning:
            # The reasoning's own tokens: the parsers split text, not token ids.
            tokens = len(await self.server.in_thread(self.server.tokenizer.encode, reasoning, False))
        stored.response = finished_response(stored.response, items, out, tokens)
        if stored.response.store:
            self.store.put(stored)
        return stored.response

    def retrieve(self, response_id: str, stream: bool) -> ResponseObject:
        if stream:
            raise ResponsesError(400, "streaming a stored response again is not supported", "stream")
        return self.store.get(response_id, "response_id").response

    def delete(self, response_id: str) -> DeletedResponse:
        self.store.delete(response_id)
        return DeletedResponse(id=response_id)

    def cancel_refusal(self, response_id: str) -> ResponsesError:
        """Why a response cannot be cancelled: only background responses can, and pagoda runs none (an
        unknown id raises its 404 instead)."""
        self.store.get(response_id, "response_id")
        return ResponsesError(
            400, "only responses created with background=true can be cancelled; this one has finished", "response_id"
        )
