"""Test-only fault injection: make the engine fail on purpose, to test how it recovers.

Nothing here runs unless a test asks for it. The engine reads the environment variable
PAGODA_INJECT_FAULTS once, at start-up (a server under test inherits it), or a test sets
`LLMEngine.faults` to a FaultInjector itself; unset, the engine's one check per step is
`faults is None`. The variable holds comma-separated rules `KIND:MATCH[:TIMES]`:

- KIND is where the fault strikes: `step` (a RuntimeError raised by the forward of a step that
  holds a matching request), `oom` (torch.OutOfMemoryError, the same way), `nan` (NaN logits for
  a matching request's rows; the sampling of the others is untouched), `detokenize` (the
  detokenizer of a matching request's sequence raises on its next token) or `grammar` (the grammar
  matcher of a matching constrained request's sequence raises when it is advanced by a token).
- MATCH picks the requests: those whose id contains it (the server's engine ids begin with the
  client's X-Request-Id), or `*` for every request.
- TIMES is how often the rule fires, 1 by default, or `always`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

ENV_VAR = "PAGODA_INJECT_FAULTS"
KINDS = ("step", "oom", "nan", "detokenize", "grammar")


class InjectedFault(RuntimeError):
    """The error a `step` rule raises."""


@dataclass
class FaultRule:
    kind: str
    match: str
    times: int | None = 1  # None: every time
    skip: int = 0  # matching occasions to let pass before the first fault (a test sets it)
    fired: int = 0

    def hits(self, request_id: str) -> bool:
        """Whether the rule fires for this request now (counting it when it does)."""
        if self.match != "*" and self.match not in request_id:
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.fired += 1
        return True


@dataclass
class FaultInjector:
    """Faults to inject (test-only). The engine calls the hooks below only when it has one."""

    rules: list[FaultRule] = field(default_factory=list)

    @classmethod
    def parse(cls, spec: str) -> FaultInjector:
        rules = []
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, rest = item.partition(":")
            match, _, times = rest.partition(":")
            if kind not in KINDS or not match:
                raise ValueError(f"{ENV_VAR}: {item!r} is not KIND:MATCH[:TIMES] with KIND one of {', '.join(KINDS)}")
            rules.append(FaultRule(kind, match, None if times == "always" else int(times or 1)))
        return cls(rules)

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        spec = os.environ.get(ENV_VAR)
        return cls.parse(spec) if spec else None

    def _hit(self, kind: str, request_ids: list[str]) -> list[int]:
        """The indices of `request_ids` that a rule of `kind` fires for."""
        return [i for i, rid in enumerate(request_ids) if any(r.kind == kind and r.hits(rid) for r in self.rules)]

    def before_forward(self, request_ids: list[str]) -> None:
        """Raise as a failing forward would, if a step or oom rule fires for a request of the step."""
        if self._hit("oom", request_ids):
            raise torch.OutOfMemoryError("injected fault: CUDA out of memory. Tried to allocate 20.00 GiB")
        if self._hit("step", request_ids):
            raise InjectedFault("injected fault: the step's forward failed")

    def corrupt_logits(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Fill the logits rows of the requests a nan rule fires for with NaN."""
        for row in self._hit("nan", request_ids):
            logits[row] = float("nan")

    def detokenizer_fails(self, request_id: str) -> bool:
        return bool(self._hit("detokenize", [request_id]))

    def grammar_fails(self, request_id: str) -> bool:
        return bool(self._hit("grammar", [request_id]))


class BrokenMatcher:
    """A `grammar` rule's stand-in for a sequence's xgrammar GrammarMatcher: it fills masks as the real one
    does, but raises when it is to accept a token. It has no xgrammar handle, so a batch call that holds it
    raises too, before any matcher has moved (engine/structured.py then goes one matcher at a time)."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool:
        return self._matcher.fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        raise InjectedFault("injected fault: the grammar matcher failed")
