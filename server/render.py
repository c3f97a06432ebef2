"""Turning the engine's RequestOutputs into OpenAI response bodies and stream chunks.

A RequestOutput is cumulative (the whole text and token ids so far), so a stream remembers, per
choice, how much it has sent and sends the rest.
"""

from __future__ import annotations

import array
import base64
import sys
from dataclasses import dataclass, field

from pydantic import BaseModel
from pydantic_core import to_json

from engine.sequence import CompletionOutput, RequestOutput, TokenLogprobs
from engine.tokenizer import Tokenizer
from server.chat import ChoiceStream, OutputParser, tool_calls_out
from server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    Embedding,
    EmbeddingList,
    EmbeddingUsage,
    TopLogprob,
    Usage,
)


class TokenStrings:
    """The text of single token ids, for logprobs; cached, since the same ids come up again and again."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            # A token that is part of a multi-byte character decodes to U+FFFD on its own;
            # OpenAI would give its raw bytes, which this tokenizer API does not expose.
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


@dataclass
class Job:
    """What one chat or completions request asked of the engine: one engine request per prompt."""

    id: str
    created: int
    model: str
    prompts: list[list[int]]
    n: int
    logprobs: bool
    echo_texts: list[str] | None = None  # completions with echo: the prompts' text, in order
    parser: OutputParser | None = None  # chat with tools or reasoning: how the text splits

    def choice_index(self, prompt_index: int, choice: CompletionOutput) -> int:
        # OpenAI numbers the choices of a list of prompts prompt by prompt.
        return prompt_index * self.n + choice.index


def usage(outputs: dict[int, RequestOutput]) -> Usage:
    prompt = sum(len(out.prompt_token_ids) for out in outputs.values())
    completion = sum(len(c.token_ids) for out in outputs.values() for c in out.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def chat_logprobs(entries: list[TokenLogprobs], strings: TokenStrings) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = strings(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for entry in entries:
        sampled = top(entry.token_id, entry.logprob)
        content.append(ChatTokenLogprob(**sampled.model_dump(), top_logprobs=[top(t, lp) for t, lp in entry.top]))
    return ChatLogprobs(content=content)


def completion_logprobs(entries: list[TokenLogprobs], strings: TokenStrings, offset: int) -> CompletionLogprobs:
    """Legacy completions logprobs; `offset` is where the first token's text starts in the choice's text."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for entry in entries:
        text = strings(entry.token_id)
        top = {strings(t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)  # the sampled token is always listed, as OpenAI does
        result.tokens.append(text)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(text)
    return result


def chat_completion(job: Job, out: RequestOutput, strings: TokenStrings) -> ChatCompletion:
    choices = []
    for c in out.outputs:
        message, finish_reason = ChatMessageOut(content=c.text), c.finish_reason
        if job.parser is not None:
            parsed = job.parser.parse(c.text, c.finish_reason)
            message = ChatMessageOut(
                content=parsed.content, reasoning_content=parsed.reasoning, tool_calls=tool_calls_out(parsed.tool_calls)
            )
            finish_reason = parsed.finish_reason
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=chat_logprobs(c.logprobs or [], strings) if job.logprobs else None,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    return ChatCompletion(id=job.id, created=job.created, model=job.model, choices=choices, usage=usage({0: out}))


def completion(job: Job, outputs: dict[int, RequestOutput], strings: TokenStrings) -> Completion:
    choices = []
    for prompt_index, out in sorted(outputs.items()):
        echo = job.echo_texts[prompt_index] if job.echo_texts else ""
        for c in out.outputs:
            choices.append(
                CompletionChoice(
                    index=job.choice_index(prompt_index, c),
                    text=echo + c.text,
                    logprobs=completion_logprobs(c.logprobs or [], strings, len(echo)) if job.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
    return Completion(id=job.id, created=job.created, model=job.model, choices=choices, usage=usage(outputs))


def embeddings(job: Job, outputs: dict[int, RequestOutput], encoding_format: str) -> EmbeddingList:
    data = [
        Embedding(index=i, embedding=_base64(out.embedding) if encoding_format == "base64" else out.embedding)
        for i, out in sorted(outputs.items())
    ]
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs.values())
    return EmbeddingList(
        data=data, model=job.model, usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
    )


def _base64(vector: list[float]) -> str:
    """float32 values, little-endian, in base64: what the openai SDK decodes (numpy's float32 or array('f'))."""
    values = array.array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


@dataclass
class _Sent:
    """How much of one choice a stream has sent."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    finished: bool = False


@dataclass
class _NewPart:
    index: int  # the choice's index in the response
    choice: CompletionOutput
    sent: _Sent
    text: str
    logprobs: list[TokenLogprobs]  # empty unless asked for
    finish_reason: str | None  # set once, when the choice has just finished


@dataclass
class _Chunker:
    job: Job
    strings: TokenStrings
    sent: dict[int, _Sent] = field(default_factory=dict)
    last: dict[int, RequestOutput] = field(default_factory=dict)  # per prompt, for usage

    def _new_parts(self, prompt_index: int, out: RequestOutput) -> list[_NewPart]:
        self.last[prompt_index] = out
        parts = []
        for c in out.outputs:
            index = self.job.choice_index(prompt_index, c)
            sent = self.sent.setdefault(index, _Sent())
            if sent.finished:
                continue
            part = _NewPart(index, c, sent, c.text[sent.text_len :], (c.logprobs or [])[sent.num_tokens :], None)
            sent.text_len, sent.num_tokens = len(c.text), len(c.token_ids)
            if c.finish_reason is not None:
                sent.finished = True
                part.finish_reason = c.finish_reason
            # A token whose text is held back (half a character, maybe a stop string) has nothing
            # to send, unless its logprobs were asked for.
            if part.text or part.logprobs or part.finish_reason:
                parts.append(part)
        return parts


def _text_template(chunk: BaseModel, marker: str) -> tuple[str, str]:
    """The JSON of a chunk with one text choice, split around `marker` (its index and empty text), so a
    chunk for another index and text is prefix + index + JSON string + suffix. Taken from the model's
    own serialization, so the bytes stay what pydantic writes, field for field."""
    prefix, suffix = chunk.model_dump_json().split(marker)
    return prefix, suffix


def _json_str(text: str) -> str:
    # pydantic's own serializer, so the escaping is byte for byte what model_dump_json would write.
    return to_json(text).decode()


@dataclass
class ChatChunker(_Chunker):
    """Chunks as JSON strings. A plain content delta (most chunks) is filled into a template instead of
    building and serializing pydantic models: this runs once per token per stream, on the event loop."""

    streams: dict[int, ChoiceStream] = field(default_factory=dict)  # per choice, when the job has a parser

    def __post_init__(self) -> None:
        template = self._chunk(ChatChunkChoice(index=0, delta=Delta(content=""), logprobs=None))
        self._prefix, self._suffix = _text_template(template, '0,"delta":{"content":""}')

    def start(self) -> list[str]:
        """The first chunk of every choice: the assistant role, as OpenAI's streams begin."""
        return [
            self._chunk(ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))).model_dump_json()
            for i in range(self.job.n)
        ]

    def update(self, prompt_index: int, out: RequestOutput) -> list[str]:
        if self.job.parser is not None:
            return self._parsed_update(prompt_index, out)
        chunks = []
        for part in self._new_parts(prompt_index, out):
            if part.text or part.logprobs:
                if self.job.logprobs:
                    logprobs = chat_logprobs(part.logprobs, self.strings)
                    delta = Delta(content=part.text)
                    chunk = self._chunk(ChatChunkChoice(index=part.index, delta=delta, logprobs=logprobs))
                    chunks.append(chunk.model_dump_json())
                else:
                    content = _json_str(part.text)
                    chunks.append(f'{self._prefix}{part.index},"delta":{{"content":{content}}}{self._suffix}')
            if part.finish_reason is not None:
                # OpenAI ends each choice with a chunk of its own: an empty delta and the reason.
                chunks.append(
                    self._chunk(
                        ChatChunkChoice(
                            index=part.index,
                            delta=Delta(),
                            finish_reason=part.finish_reason,
                            stop_reason=part.choice.stop_reason,
                        )
                    ).model_dump_json()
                )
        return chunks

    def _parsed_update(self, prompt_index: int, out: RequestOutput) -> list[str]:
        """Chunks of a choice whose text is split into content, reasoning and tool calls as it streams."""
        chunks = []
        for part in self._new_parts(prompt_index, out):
            stream = self.streams.get(part.index)
            if stream is None:
                stream = self.streams[part.index] = self.job.parser.stream()
            pieces = [stream.feed(part.text)] if part.text else []
            finish_reason = None
            if part.finish_reason is not None:
                rest, finish_reason = stream.finish(part.finish_reason)
                pieces.append(rest)
            logprobs = chat_logprobs(part.logprobs, self.strings) if self.job.logprobs and part.logprobs else None
            for piece in pieces:
                if piece or logprobs is not None:
                    delta = Delta(
                        content=piece.content or None,
                        reasoning_content=piece.reasoning or None,
                        tool_calls=piece.tool_calls or None,
                    )
                    chunks.append(self._chunk(ChatChunkChoice(index=part.index, delta=delta, logprobs=logprobs)))
                    logprobs = None
            if finish_reason is not None:
                choice = ChatChunkChoice(
                    index=part.index, delta=Delta(), finish_reason=finish_reason, stop_reason=part.choice.stop_reason
                )
                chunks.append(self._chunk(choice))
        return [chunk.model_dump_json() for chunk in chunks]

    def usage_chunk(self) -> str:
        return self._chunk(None, usage(self.last)).model_dump_json()

    def _chunk(self, choice: ChatChunkChoice | None, usage_: Usage | None = None) -> ChatCompletionChunk:
        job = self.job
        return ChatCompletionChunk(
            id=job.id, created=job.created, model=job.model, choices=[choice] if choice else [], usage=usage_
        )


@dataclass
class CompletionChunker(_Chunker):
    """Chunks as JSON strings; a plain text chunk (most chunks) is filled into a template, as in ChatChunker."""

    def __post_init__(self) -> None:
        template = self._chunk([CompletionChoice(index=0, text="", logprobs=None, finish_reason=None)])
        self._prefix, self._suffix = _text_template(template, '0,"text":""')

    def start(self) -> list[str]:
        """With echo, each choice's stream begins with its prompt's text."""
        if not self.job.echo_texts:
            return []
        chunks = []
        for prompt_index, text in enumerate(self.job.echo_texts):
            for i in range(self.job.n):
                index = prompt_index * self.job.n + i
                choice = CompletionChoice(index=index, text=text, finish_reason=None)
                chunks.append(self._chunk([choice]).model_dump_json())
        return chunks

    def update(self, prompt_index: int, out: RequestOutput) -> list[str]:
        chunks = []
        for part in self._new_parts(prompt_index, out):
            if not self.job.logprobs and part.finish_reason is None:
                chunks.append(f'{self._prefix}{part.index},"text":{_json_str(part.text)}{self._suffix}')
                continue
            logprobs = None
            if self.job.logprobs:
                logprobs = completion_logprobs(part.logprobs, self.strings, part.sent.text_offset)
                part.sent.text_offset += sum(len(t) for t in logprobs.tokens)
            choice = CompletionChoice(
                index=part.index,
                text=part.text,
                logprobs=logprobs,
                finish_reason=part.finish_reason,
                stop_reason=part.choice.stop_reason if part.finish_reason else None,
            )
            chunks.append(self._chunk([choice]).model_dump_json())
        return chunks

    def usage_chunk(self) -> str:
        return self._chunk([], usage(self.last)).model_dump_json()

    def _chunk(self, choices: list[CompletionChoice], usage_: Usage | None = None) -> Completion:
        job = self.job
        return Completion(id=job.id, created=job.created, model=job.model, choices=choices, usage=usage_)
