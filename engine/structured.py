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
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

import numpy as np
import torch

from engine.sampling_params import Constraint, InvalidParameter

log = logging.getLogger("pagoda.structured")

# Compiled grammars xgrammar keeps (LRU by bytes): thousands of typical schemas.
_CACHE_BYTES = 512 << 20

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
        """The mask of (sampling row, matcher) pairs, whose matchers have not terminated; None for none."""
        if not rows:
            return None
        # A fresh (pinned) buffer each step: torch's host allocator reuses it only once the copy to the
        # device that reads it has run, and the step's refused() check reads it after sampling.
        bitmask = torch.empty((len(rows), self._width), dtype=torch.int32, pin_memory=self._pin)
        self._batch.batch_fill_next_token_bitmask([m for _, m in rows], bitmask)
        return StepMask(bitmask, [row for row, _ in rows])


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
