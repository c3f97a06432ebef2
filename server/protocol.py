"""Pydantic models of the OpenAI request and response bodies that pagoda serves.

Requests forbid unknown fields, so a parameter pagoda does not know is answered 400 with its
name instead of being ignored. Fields that OpenAI defines but pagoda does not implement yet are
declared, so they parse, and `unsupported()` names the first one that was set.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.sampling_params import Constraint, InvalidParameter, SamplingParams


class RequestBody(BaseModel):
    """A request body, or a part of one: unknown fields are refused and null means absent."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # Many clients send null for what they leave unset, as OpenAI allows: null takes the default.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(RequestBody):
    include_usage: bool = False


class ContentPart(BaseModel):
    # Other part types (image_url, input_audio) carry other fields; they are refused by type, by name.
    model_config = ConfigDict(extra="allow")
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


class ChatMessage(RequestBody):
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
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(RequestBody):
    """vLLM's `structured_outputs` request field: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class FunctionDefinition(RequestBody):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class _GenerationRequest(RequestBody):
    """Parameters shared by chat and completions, including vLLM's extras (sent via extra_body)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Identifiers and hints that do not change the output, so accepting them changes nothing.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's sampling extras.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # vLLM's structured outputs: the current field and the older guided_* ones.
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
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
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    store: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's template extras: keyword arguments for the chat template (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI parameters pagoda does not implement yet: set to anything, they are refused.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

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
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.suffix is not None:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.echo and self.logprobs is not None:
            # Echoed prompt tokens would need prompt logprobs, which the engine does not compute.
            return "echo"
        return None


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # accepted only as the model's hidden size: pagoda does not shorten vectors
    user: str | None = None


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


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
