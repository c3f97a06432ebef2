"""Structured outputs: a request's output held to a JSON schema, a regex, a list of choices or a grammar.

Built on xgrammar. A Constraint (from SamplingParams) is compiled once per distinct spec into a
CompiledGrammar (xgrammar caches compiled grammars by their text, so a schema every request
repeats compiles once); each sequence of a constrained request gets its own GrammarMatcher, which
accepts the tokens the sequence is given. Before a constrained row is sampled, its matcher writes
the set of tokens the grammar allows next into one bit per token of an int32 bitmask, and the
sampler sets every other token's logit to -inf on the logits' device in one call for the whole batch.

Whether a sampled token was allowed is read from the bitmask it was sampled under, so the matchers
are advanced by a step's tokens in one call for the batch. A matcher that has accepted a stop token
has terminated (a sequence with ignore_eos outlives it); the engine then drops it, and the sequence
is constrained no more.

With async scheduling, the advance by one step's tokens and the fill of the next step's mask run as
one GrammarWork on a worker thread (Grammars.start): xgrammar's batch calls release the GIL, so the
engine thread updates the sequences and schedules the step after meanwhile, and waits only where the
mask is applied. One piece of grammar work runs at a time; the engine waits for it before it touches a
matcher again. A matcher that raises there fails its own sequence only (GrammarDone.failed).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling_params import Constraint, InvalidParameter

log = logging.getLogger("pagoda.structured")

# Compiled grammars xgrammar keeps (LRU by bytes): thousands of typical schemas.
_CACHE_BYTES = 512 << 20

# The GIL switch interval while the grammar thread works. Between xgrammar's calls (which release the
# GIL) it needs the GIL a few times a step, while the engine thread runs Python without a pause; CPython
# hands the GIL to a waiting thread only after the switch interval, 5 ms by default: longer than the
# whole window the work has, so the work would wait for the engine thread to block on its result.
_SWITCH_INTERVAL_S = 1e-4

# xgrammar's errors begin with a timestamp and the C++ source line: "[03:41:44] /project/cpp/x.cc:820: ".
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _error_text(exc: Exception) -> str:
    return _ERROR_PREFIX.sub("", str(exc).strip()).strip()


@dataclass
class StepMask:
    """The bitmask of one step's constrained rows: `bitmask[i]` is the allowed set of sampling row `rows[i]`."""

    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, bit t of a row set = token t allowed
    rows: list[int]

    def refused(self, token_ids: list[int]) -> set[int]:
        """The sampling rows whose token (token_ids[row]) this mask did not allow."""
        tokens = np.asarray([token_ids[row] for row in self.rows], dtype=np.int64)
        words = self.bitmask.numpy()[np.arange(len(self.rows)), tokens >> 5]
        allowed = (words >> (tokens & 31).astype(np.int32)) & 1  # arithmetic shift, then the one bit
        return {self.rows[i] for i in np.flatnonzero(allowed == 0)}


@dataclass
class GrammarWork:
    """A step's grammar work: advance each matcher of `accepts` by its token, then fill the mask of the
    next step's `fills` (sampling row, matcher). `owner` (the engine's sequence) names what fails."""

    accepts: list[tuple[object, object, int]] = field(default_factory=list)  # (owner, matcher, token)
    fills: list[tuple[object, int, object]] = field(default_factory=list)  # (owner, row, matcher)


@dataclass
class GrammarDone:
    """What a GrammarWork left: the next step's mask (None for no rows), and the owners whose matcher raised,
    with the error (their matchers' state is unknown: they are in no mask)."""

    mask: StepMask | None
    failed: list[tuple[object, str]]


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary, advances matchers and fills masks."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        # The model's vocabulary (its logits' width), which may be padded past the tokenizer's: ids
        # past the tokenizer's are never allowed. The stop tokens are the engine's (generation_config's too).
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True, cache_limit_bytes=_CACHE_BYTES)
        # xgrammar's own threads (half the cores) fill a step's rows, in C++ without the GIL.
        self._batch = xgr.BatchGrammarMatcher("auto")
        self._pin = torch.cuda.is_available()
        self._width = xgr.get_bitmask_shape(1, vocab_size)[1]
        # One thread: a step's work needs the one before it done (a matcher advances in token order).
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-grammar")

    def compile(self, constraint: Constraint):
        """The CompiledGrammar of a constraint; raises InvalidParameter (naming constraint.param) if it
        cannot be compiled. Blocks for the compile (milliseconds for a typical schema, cached after)."""
        compiler = self._compiler
        kind, spec = constraint.kind, constraint.spec
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(json.loads(spec)))
            if kind == "grammar":
                return self._compile_grammar(spec)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = f"{constraint.param} cannot be compiled: {_error_text(exc)}"
            raise InvalidParameter(constraint.param, message) from None
        raise InvalidParameter(constraint.param, f"unknown structured output kind {kind!r}")

    def _compile_grammar(self, text: str):
        """xgrammar's EBNF (GBNF) first; a grammar written in Lark (as vLLM also accepts) second."""
        try:
            return self._compiler.compile_grammar(text)
        except RuntimeError as ebnf_error:
            try:
                return self._compiler.compile_lark(text)
            except RuntimeError:
                raise ebnf_error from None

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def accept(self, matchers: list, token_ids: list[int]) -> None:
        """Advance each matcher by its token (one the mask it was sampled under allowed)."""
        if matchers:
            self._xgr.BatchGrammarMatcher.batch_accept_token(matchers, token_ids)

    def fill(self, rows: list[tuple[int, object]]) -> StepMask | None:
        """The mask of (sampling row, matcher) pairs, whose matchers have not terminated; None for none.
        Raises what a matcher raised."""
        mask, failed = self._fill(rows)
        if failed:
            raise failed[0][1]
        return mask

    def _fill(self, rows: list[tuple[int, object]]) -> tuple[StepMask | None, list[tuple[int, Exception]]]:
        """fill(), and the indices into `rows` of the matchers that raised, with what they raised (the mask
        leaves their rows out)."""
        if not rows:
            return None, []
        bitmask = self._bitmask(len(rows))
        try:
            self._batch.batch_fill_next_token_bitmask([m for _, m in rows], bitmask)
        except Exception:  # filling only reads a matcher: each is filled again on its own, below
            pass
        else:
            return StepMask(bitmask, [row for row, _ in rows]), []
        kept, failed = [], []
        for i, (row, matcher) in enumerate(rows):
            try:
                matcher.fill_next_token_bitmask(bitmask, len(kept))
            except Exception as exc:
                failed.append((i, exc))
                continue
            kept.append(row)
        return (StepMask(bitmask[: len(kept)], kept) if kept else None), failed

    def _bitmask(self, num_rows: int) -> torch.Tensor:
        # A fresh (pinned) buffer each step: torch's host allocator reuses it only once the copy to the
        # device that reads it has run, and the step's refused() check reads it after sampling.
        return torch.empty((num_rows, self._width), dtype=torch.int32, pin_memory=self._pin)

    def start(self, work: GrammarWork) -> Future[GrammarDone]:
        """Run `work` on the grammar thread; the caller must not use its matchers until the result is in."""
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, _SWITCH_INTERVAL_S))
        return self._worker.submit(self._run_then_restore, work, interval)

    def _run_then_restore(self, work: GrammarWork, interval: float) -> GrammarDone:
        try:
            return self.run(work)
        finally:
            sys.setswitchinterval(interval)

    def run(self, work: GrammarWork) -> GrammarDone:
        """Do `work` here: in xgrammar's batch calls, and where one raises, one matcher at a time, so that
        only the matchers that raise fail. xgrammar takes every matcher's handle before its batch call
        begins, so a batch that raised for an object that is no working matcher has advanced none. (A token
        a grammar cannot take is refused, not raised; the engine never gives one: it checks refused().)"""
        failed: list[tuple[object, str]] = []
        if work.accepts:
            try:
                self.accept([m for _, m, _ in work.accepts], [t for _, _, t in work.accepts])
            except Exception:
                for owner, matcher, token in work.accepts:
                    try:
                        matcher.accept_token(token)
                    except Exception as exc:
                        failed.append((owner, _error_text(exc)))
        broken = {id(owner) for owner, _ in failed}
        fills = [(owner, row, m) for owner, row, m in work.fills if id(owner) not in broken]
        mask, fill_failed = self._fill([(row, m) for _, row, m in fills])
        failed += [(fills[i][0], _error_text(exc)) for i, exc in fill_failed]
        return GrammarDone(mask, failed)


def apply_mask(logits: torch.Tensor, mask: StepMask) -> None:
    """Set the logits of every token a constrained row's grammar forbids to -inf, in place, in one call
    for the batch (a Triton kernel on CUDA, a C++ loop on the CPU)."""
    import xgrammar as xgr

    # Only the constrained rows travel to the device; xgrammar reads row i of the bitmask for logits
    # row i, so they are put in place in a batch-sized one there.
    compact = mask.bitmask.to(logits.device, non_blocking=True)
    if len(mask.rows) == logits.shape[0]:  # every row constrained (rows come in order): no scatter
        xgr.apply_token_bitmask_inplace(logits, compact, vocab_size=logits.shape[-1])
        return
    bitmask = torch.empty((logits.shape[0], compact.shape[1]), dtype=compact.dtype, device=logits.device)
    # non_blocking from a pageable array: staged at once, not after the forward still running (a plain
    # torch.tensor(..., device=cuda) would hold the host until the device reached the copy).
    rows = torch.from_numpy(np.asarray(mask.rows, dtype=np.int64)).to(logits.device, non_blocking=True)
    bitmask[rows] = compact
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=mask.rows)


def _choice_grammar(choices: list) -> str:
    # A JSON string literal is also an EBNF string literal: the same escapes.
    return "root ::= " + " | ".join(json.dumps(str(c), ensure_ascii=False) for c in choices)
