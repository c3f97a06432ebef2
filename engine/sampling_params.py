"""Per-request sampling parameters; validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

# A hard cap on top-k logprobs: each one costs a row gather per step.
MAX_LOGPROBS = 20
# Stop strings: generous for real clients (OpenAI takes 4), small enough that a request cannot make its
# matcher costly to build (at most 64 x 256 automaton states) or hold back long stretches of a stream.
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 256


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names it (OpenAI error field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# What a Constraint can hold its output to (engine/structured.py compiles each).
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint: the output must match `spec`, read as `kind`.

    json: a JSON schema (JSON text); json_object: any JSON object (spec unused); regex: a regular
    expression; choice: a JSON list of strings, one of which is the whole output; grammar: an EBNF
    (GBNF) or Lark grammar; structural_tag: xgrammar's structural tag (JSON text).
    """

    kind: str
    spec: str = ""
    param: str = "structured_outputs"  # the request field it came from, for error messages

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidParameter(self.param, f"unknown structured output kind {self.kind!r}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token + top k
    skip_special_tokens: bool = True
    # "cumulative": an output every step that changed the request; "final_only": only the finished
    # one (offline generation, where building a snapshot per token per step is wasted host time).
    output_kind: str = "cumulative"
    constraint: Constraint | None = None  # structured outputs

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidParameter(param, message)

        check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        check(self.temperature >= 0.0, "temperature", f"temperature must be non-negative, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, "top_k", f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"repetition_penalty must be positive, got {self.repetition_penalty}",
        )
        check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}",
        )
        for token_id, bias in (self.logit_bias or {}).items():
            check(-100.0 <= bias <= 100.0, "logit_bias", f"logit_bias for token {token_id} must be in [-100, 100]")
        check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}",
        )
        check(
            all(len(s) <= MAX_STOP_LENGTH for s in self.stop),
            "stop",
            f"a stop string may be at most {MAX_STOP_LENGTH} characters long",
        )
        check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be non-negative")
        check(
            self.output_kind in ("cumulative", "final_only"),
            "output_kind",
            f"output_kind must be cumulative or final_only, got {self.output_kind!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def reads_output_tokens(self) -> bool:
        """Whether sampling needs the tokens generated so far (penalties), not only their count."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
