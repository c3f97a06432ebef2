"""Pydantic models of the OpenAI request and response bodies that pagoda serves.

Requests forbid unknown fields, so a parameter pagoda does not know is answered 400 with its
name instead of being ignored. Fields that OpenAI defines but pagoda does not implement yet are
declared, so they parse, and `unsupported()` names the first one that was set.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    StrictBool,  # pydantic would take 0 and 1 (and "yes") as booleans
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError

from engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    Constraint,
    InvalidParameter,
    SamplingParams,
)


def _json_integer(value: Any) -> Any:
    # pydantic takes true as 1, false as 0 and "7" as 7, so {"tokens": [false]} would be read as token 0. A JSON
    # number is taken (2.0 is the integer 2, as JSON Schema says; 2.5 is refused next), nothing else.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def _json_number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):  # as _json_integer: no true, no "0.5"
        raise PydanticCustomError("float_type", "Input should be a valid number")
    return value


# An integer field: a JSON number with no fraction, never a boolean or a string.
Int = Annotated[int, BeforeValidator(_json_integer)]
# A float field: a JSON number, never a boolean or a string.
Float = Annotated[float, BeforeValidator(_json_number)]
# A token id. The routes and the engine refuse one outside the vocabulary, naming the field; the OpenAPI
# document states the bounds (api.py fills in x-token-id's minimum and maximum).
TokenId = Annotated[Int, Field(json_schema_extra={"x-token-id": True})]


def _non_empty(schema: dict[str, Any]) -> None:
    """Document every text and list of a prompt as non-empty: the routes refuse an empty one with a message
    that says which (a pydantic bound would report the union's first member instead: "should be a string")."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "string":
            branch["minLength"] = 1
        elif branch.get("type") == "array":
            branch["minItems"] = 1
            _non_empty(branch["items"])


# Completions' prompt and embeddings' input: a text, texts, token ids, or lists of token ids; none empty.
Prompt = Annotated[str | list[str] | list[TokenId] | list[list[TokenId]], Field(json_schema_extra=_non_empty)]


class RequestBody(BaseModel):
    """A request body, or a part of one: unknown fields are refused and null means absent."""

    # NaN and infinities are refused by every float field, whatever its bounds (Python's JSON reader takes NaN).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # Many clients send null for what they leave unset, as OpenAI allows: null takes the default.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        # The document says what _null_is_absent does: every optional field may be null.
        schema = handler.resolve_ref_schema(handler(core_schema))
        required = set(schema.get("required", ()))
        for name, prop in schema.get("properties", {}).items():
            if name not in required and not _takes_null(prop):
                outer = {key: prop.pop(key) for key in _ANNOTATIONS if key in prop}
                schema["properties"][name] = {**outer, "anyOf": [prop, {"type": "null"}]}
            elif "anyOf" in prop:
                # A field's own schema keys (its json_schema_extra: const, enum...) sit beside the anyOf, where
                # they would refuse null too: they belong to the value's branch.
                value = next(branch for branch in prop["anyOf"] if branch.get("type") != "null")
                value.update({key: prop.pop(key) for key in list(prop) if key not in (*_ANNOTATIONS, "anyOf")})
        return schema


_ANNOTATIONS = ("title", "description", "default")


def _takes_null(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "null" or any(_takes_null(s) for s in schema.get("anyOf", ()))


class StreamOptions(RequestBody):
    include_usage: StrictBool = False


def _text_part_only(schema: dict[str, Any]) -> None:
    schema["properties"]["type"]["const"] = "text"
    schema["properties"]["text"] = {"type": "string"}
    schema["required"] = ["type", "text"]


class ContentPart(BaseModel):
    # Other part types (image_url, input_audio) carry other fields; they parse, and are then refused by type, by
    # name. The document says what is served: text parts.
    model_config = ConfigDict(extra="allow", json_schema_extra=_text_part_only)
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallIn(BaseModel):
    """A tool call of an assistant message in the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


_HAS_TOOL_CALLS = {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}
# What chat.template_messages() takes of each role, for the OpenAPI document: content (tool calls instead, for an
# assistant), and a tool message's tool_call_id.
_MESSAGE_SHAPES = {
    "oneOf": [
        {
            "properties": {"role": {"enum": ["system", "developer", "user"]}, "content": {"not": {"type": "null"}}},
            "required": ["content"],
            "not": _HAS_TOOL_CALLS,
        },
        {
            "properties": {"role": {"const": "assistant"}},
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
            ],
        },
        {
            "properties": {
                "role": {"const": "tool"},
                "content": {"not": {"type": "null"}},
                "tool_call_id": {"type": "string"},
            },
            "required": ["content", "tool_call_id"],
            "not": _HAS_TOOL_CALLS,
        },
    ]
}


class ChatMessage(RequestBody):
    model_config = ConfigDict(json_schema_extra=_MESSAGE_SHAPES)

    role: str  # checked when the prompt is built, so an unknown role gets a clear answer
    content: str | list[ContentPart] | None = None  # None: an assistant message of tool calls only
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant: reasoning sent back (templates may show or drop it)


class JsonSchemaFormat(RequestBody):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(RequestBody):
    """vLLM's `structured_outputs` request field: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: str | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class FunctionDefinition(RequestBody):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


StopString = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]
# A parameter OpenAI defines and pagoda does not implement: it parses, so that setting it is refused by name
# (unsupported()); the document says the only value served, null.
NOT_SUPPORTED: Any = Field(None, json_schema_extra={"type": "null"})


def only_with(field: str, needs: str) -> dict[str, Any]:
    """Schema: `field` may be set (not null) only when `needs` is true."""
    return {
        "anyOf": [
            {"not": {"required": [field]}},
            {"properties": {field: {"type": "null"}}},
            {"required": [needs], "properties": {needs: {"const": True}}},
        ]
    }


_STREAM_OPTIONS_NEED_STREAM = only_with("stream_options", "stream")
# A tool_choice but none: tools to choose from (chat.plan_tools).
TOOL_CHOICE_NEEDS_TOOLS = {
    "anyOf": [
        {"not": {"required": ["tool_choice"]}},
        {"properties": {"tool_choice": {"enum": [None, "none"]}}},
        {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
    ]
}
_TOP_LOGPROBS_NEED_LOGPROBS = only_with("top_logprobs", "logprobs")
# Echoed prompt tokens would need prompt logprobs, which the engine does not compute.
_NOT_ECHO_WITH_LOGPROBS = {
    "not": {"required": ["echo", "logprobs"], "properties": {"echo": {"const": True}, "logprobs": {"type": "integer"}}}
}


class _GenerationRequest(RequestBody):
    """Parameters shared by chat and completions, including vLLM's extras (sent via extra_body)."""

    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    n: Int = Field(1, ge=1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Int | None = None
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    # Keys are token ids: _token_id() refuses others by name; the document says so with propertyNames.
    logit_bias: dict[str, Annotated[Float, Field(ge=-100, le=100)]] | None = Field(
        None, json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}}
    )
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Identifiers and hints that do not change the output, so accepting them changes nothing.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's sampling extras.
    top_k: Int = Field(0, ge=-1)
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(1.0, gt=0.0)
    min_tokens: Int = Field(0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    priority: Int = 0
    # vLLM's structured outputs: the current field and the older guided_* ones.
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: xgrammar is the only backend
    guided_whitespace_pattern: str | None = None  # accepted: JSON is written without free whitespace

    def constraint(self) -> Constraint | None:
        """The structured-output constraint the request asks for (at most one field may ask)."""
        found: list[Constraint] = []
        so = self.structured_outputs
        if so is not None:
            if so.json_ is not None:
                found.append(Constraint("json", _schema_text(so.json_), "structured_outputs.json"))
            if so.regex is not None:
                found.append(Constraint("regex", so.regex, "structured_outputs.regex"))
            if so.choice is not None:
                found.append(_choice(so.choice, "structured_outputs.choice"))
            if so.grammar is not None:
                found.append(Constraint("grammar", so.grammar, "structured_outputs.grammar"))
            if so.json_object:
                found.append(Constraint("json_object", "", "structured_outputs.json_object"))
            if so.structural_tag is not None:
                found.append(Constraint("structural_tag", so.structural_tag, "structured_outputs.structural_tag"))
        if self.guided_json is not None:
            found.append(Constraint("json", _schema_text(self.guided_json), "guided_json"))
        if self.guided_regex is not None:
            found.append(Constraint("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            found.append(_choice(self.guided_choice, "guided_choice"))
        if self.guided_grammar is not None:
            found.append(Constraint("grammar", self.guided_grammar, "guided_grammar"))
        found += self._format_constraints()
        if len(found) > 1:
            names = ", ".join(c.param for c in found)
            raise InvalidParameter(found[1].param, f"give one structured output constraint, not several ({names})")
        return found[0] if found else None

    def _format_constraints(self) -> list[Constraint]:
        return []

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, constraint: Constraint | None = None
    ) -> SamplingParams:
        """Raises InvalidParameter naming the bad parameter. `constraint`: the structured-output
        constraint (see constraint()), or one the caller made (tool calling)."""
        bias = None
        if self.logit_bias:
            bias = {_token_id(key): value for key, value in self.logit_bias.items()}
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            constraint=constraint,
        )


def _schema_text(schema: dict | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def _choice(choices: list[str], param: str) -> Constraint:
    if not choices:
        raise InvalidParameter(param, f"{param} needs at least one choice")
    return Constraint("choice", json.dumps(choices), param)


def _token_id(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None


class ChatCompletionRequest(_GenerationRequest):
    model_config = ConfigDict(
        json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS, TOOL_CHOICE_NEEDS_TOOLS]}
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = Field(None, json_schema_extra={"const": ["text"]})  # the only one served
    store: StrictBool | None = Field(None, json_schema_extra={"const": False})  # chat completions are never stored
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    # vLLM's template extras: keyword arguments for the chat template (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI parameters pagoda does not implement yet: set to anything, they are refused.
    functions: Any = NOT_SUPPORTED
    function_call: Any = NOT_SUPPORTED
    audio: Any = NOT_SUPPORTED
    prediction: Any = NOT_SUPPORTED
    web_search_options: Any = NOT_SUPPORTED
    reasoning_effort: Any = NOT_SUPPORTED
    verbosity: Any = NOT_SUPPORTED

    def unsupported(self) -> str | None:
        """The name of the first parameter that was set but is not implemented, or None."""
        for name in (
            "functions",
            "function_call",
            "audio",
            "prediction",
            "web_search_options",
            "reasoning_effort",
            "verbosity",
        ):
            if getattr(self, name) is not None:
                return name
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities"
        if self.store:
            return "store"
        return None

    def _format_constraints(self) -> list[Constraint]:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return []
        if fmt.type == "json_object":
            return [Constraint("json_object", "", "response_format")]
        if fmt.json_schema is None:
            raise InvalidParameter("response_format.json_schema", "response_format json_schema needs its json_schema")
        return [Constraint("json", json.dumps(fmt.json_schema.schema_), "response_format.json_schema.schema")]


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    max_tokens: Int | None = Field(16, ge=1)  # OpenAI's and vLLM's default for completions
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    best_of: Int | None = Field(None, json_schema_extra={"const": 1})  # one completion per choice: OpenAI's default
    suffix: str | None = NOT_SUPPORTED

    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM, _NOT_ECHO_WITH_LOGPROBS]})

    def unsupported(self) -> str | None:
        if self.suffix is not None:
            return "suffix"
        if self.best_of is not None and self.best_of != 1:
            return "best_of"
        if self.echo and self.logprobs is not None:
            # Echoed prompt tokens would need prompt logprobs, which the engine does not compute.
            return "echo"
        return None


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(
        None, json_schema_extra={"x-hidden-size": True}
    )  # accepted only as the model's hidden size: pagoda does not shorten vectors
    user: str | None = None


class TokenizeRequest(RequestBody):
    # One of prompt and messages (the route says so when both or neither are given).
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


# ----- responses -----


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=lambda v: not v)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token id that ended it


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


def _omit_none(value: Any) -> bool:
    return value is None


class DeltaFunction(BaseModel):
    name: str | None = Field(None, exclude_if=_omit_none)
    arguments: str = ""


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: index, id, type and name first, then fragments of its arguments."""

    index: int
    id: str | None = Field(None, exclude_if=_omit_none)
    type: Literal["function"] | None = Field(None, exclude_if=_omit_none)
    function: DeltaFunction


class Delta(BaseModel):
    # A streamed delta carries only what changed: the role once, then content (or reasoning, or tool calls).
    role: str | None = Field(None, exclude_if=_omit_none)
    content: str | None = Field(None, exclude_if=_omit_none)
    reasoning_content: str | None = Field(None, exclude_if=_omit_none)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=_omit_none)


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, exclude_if=_omit_none)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_omit_none)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = Field(None, exclude_if=_omit_none)


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=_omit_none)  # absent on streamed chunks


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of the little-endian float32 values


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagoda"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
