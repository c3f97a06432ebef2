"""Pydantic models of the OpenAI request and response bodies that pagoda serves.

Requests forbid unknown fields, so a parameter pagoda does not know is answered 400 with its
name instead of being ignored. Fields that OpenAI defines but pagoda does not implement yet are
declared, so they parse, and `unsupported()` names the first one that was set.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.sampling_params import InvalidParameter, SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # Many clients send null for what they leave unset, as OpenAI allows: null takes the default.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(BaseModel):
    # Other part types (image_url, input_audio) carry other fields; they are refused by type, by name.
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str  # checked when the prompt is built, so a tool message gets a clear answer
    content: str | list[ContentPart]
    name: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # json_schema etc.; only type "text" is accepted
    type: str


class _GenerationRequest(_Request):
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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises InvalidParameter naming the bad parameter."""
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
        )


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
    # OpenAI parameters pagoda does not implement yet: set to anything, they are refused.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
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
            "tools",
            "tool_choice",
            "parallel_tool_calls",
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
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities"
        if self.store:
            return "store"
        return None


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


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
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


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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


class Delta(BaseModel):
    # A streamed delta carries only what changed: the role once, then content.
    role: str | None = Field(None, exclude_if=_omit_none)
    content: str | None = Field(None, exclude_if=_omit_none)


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
