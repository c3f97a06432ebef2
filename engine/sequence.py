"""A request's state: its sequences' token ids, status, block table and timings; the outputs it yields."""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field

import numpy as np

from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.stop_strings import StopMatcher

PLACEHOLDER = -1  # a token id sampled by a step still on the device (async scheduling), not read yet


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks; prefilling or decoding
    SWAPPED = "swapped"  # preempted; its KV blocks wait in the CPU swap pool
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    """Logprobs of one generated token under the model's unmodified distribution."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (token id, logprob), most likely first


@dataclass
class Sequence:
    """One generated continuation. A request with n > 1 forks n sequences sharing its prompt's blocks."""

    seq_id: int
    request: Request
    index: int  # which of the request's n outputs
    seed: int
    token_ids: list[int]  # prompt then output
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens whose K/V are in the cache
    # Draft-model speculation: leading tokens whose draft-model K/V are in the same blocks (engine/spec_decode/
    # draft_model.py). The draft catches up lazily, so this lags num_computed_tokens; it never exceeds it.
    num_draft_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    # Bumped by every change to block_table (BlockManager, Scheduler._swap_in): block_table_array() converts
    # the table again only then, not for every sequence every step.
    block_table_version: int = 0
    _table_array: tuple[int, np.ndarray] | None = field(default=None, init=False, repr=False, compare=False)
    block_hashes: list[bytes] = field(default_factory=list)  # chained names of its full blocks (prefix cache)
    swapped_blocks: list[int] = field(default_factory=list)  # CPU swap-pool blocks, while SWAPPED
    # "stop" | "length" | "abort" | "timeout" (never scheduled in time) | "error" (see Request.error)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    detokenizer: object | None = None  # IncrementalDetokenizer, created when the model has a tokenizer
    matcher: object | None = None  # xgrammar GrammarMatcher of a constrained request (engine/structured.py)
    num_preemptions: int = 0
    num_pending: int = 0  # trailing token_ids that are PLACEHOLDERs: sampled on the device, not read yet
    embedding: list[float] | None = None  # an embedding request's pooled vector, once its prompt has run
    # len(request.prompt_token_ids), kept as a field: the scheduler and the runner read it for every
    # sequence of every step (a request's prompt never changes).
    num_prompt_tokens: int = field(init=False, default=0)
    # The length (prompt + output) at which max_tokens or the context length ends it; set by the scheduler
    # on first use (Scheduler.ends_by_length), which knows the context length.
    max_num_tokens: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_seqs_when_running(self) -> int:
        """Sequence slots this takes once running: a parent not yet forked brings its n - 1 children."""
        request = self.request
        if self.index == 0 and len(request.seqs) < request.params.n:
            return request.params.n - len(request.seqs) + 1
        return 1

    def token_array(self, start: int, end: int) -> np.ndarray:
        """Token ids [start, end) as int64: a slice of the request's prompt array when they are all
        prompt tokens (converting thousands of Python ints is most of what a prompt chunk costs the
        host), else converted here."""
        prompt = self.request.prompt_array
        if end <= len(prompt):
            return prompt[start:end]
        return np.asarray(self.token_ids[start:end], dtype=np.int64)

    def block_table_array(self) -> np.ndarray:
        """block_table as an int32 array, made again only after the table changed (a decode changes it
        once every block_size steps)."""
        cached = self._table_array
        # The length as well as the version: a change that forgot its bump and grew or shrank the table
        # still gets a fresh array.
        if cached is None or cached[0] != self.block_table_version or len(cached[1]) != len(self.block_table):
            cached = self._table_array = (self.block_table_version, np.asarray(self.block_table, dtype=np.int32))
        return cached[1]

    # Cached: the scheduler sorts by it every step, and a request's priority and arrival never change.
    @functools.cached_property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.request.priority, self.request.arrival_time, self.seq_id)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # of an embedding request, a stand-in with n = 1: it samples nothing
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    pooling: PoolingParams | None = None  # set (defaults resolved): an embedding request, which pools its prompt
    seqs: list[Sequence] = field(default_factory=list)
    queue_deadline: float | None = None  # finish with "timeout" if not scheduled by then
    grammar: object | None = None  # the compiled params.constraint (xgrammar CompiledGrammar)
    stop_matcher: StopMatcher | None = None  # params.stop's, shared by the request's n sequences
    # Set when the engine failed this request (a failed step, non-finite logits, a detokenizer error): it
    # ends at once, every sequence with finish_reason "error", and the server answers it with a 500.
    error: str | None = None
    first_scheduled_time: float | None = None  # end of queueing: its first chunk was scheduled
    first_token_time: float | None = None
    finished_time: float | None = None
    # The prompt as int64, converted once here rather than in every step that reads it: the runner's
    # input ids and the prefix-cache names take their prompt tokens from it.
    prompt_array: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.prompt_array = np.asarray(self.prompt_token_ids, dtype=np.int64)

    @property
    def pools_every_token(self) -> bool:
        """Mean pooling: the hidden state of every prompt token counts, so none may come from the prefix cache."""
        return self.pooling is not None and self.pooling.pooling_type == "mean"

    @property
    def is_finished(self) -> bool:
        if self.seqs and self.seqs[0].finish_reason in ("timeout", "error"):
            return True  # ended before the n - 1 children were forked
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestTimes:
    """time.monotonic() stamps of a request's life, for latency metrics."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None


@dataclass
class RequestOutput:
    """A snapshot of a request: cumulative text and tokens of each of its n outputs; of an embedding
    request, its vector (`embedding`, once finished) and one empty output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    times: RequestTimes | None = None
    embedding: list[float] | None = None
    error: str | None = None  # the engine failed the request (see Request.error); finished is then True

    @classmethod
    def of(cls, request: Request) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=s.token_ids[s.num_prompt_tokens : len(s.token_ids) - s.num_pending],
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
            )
            for s in sorted(request.seqs, key=lambda s: s.index)
        ]
        times = RequestTimes(
            request.arrival_time, request.first_scheduled_time, request.first_token_time, request.finished_time
        )
        embedding = request.seqs[0].embedding if request.pooling is not None else None
        return cls(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            outputs,
            request.is_finished,
            times,
            embedding,
            request.error,
        )
