"""Structured outputs: a request's output held to a JSON schema, a regex, a list of choices or a grammar.

Built on xgrammar. A Constraint (from SamplingParams) is compiled once per distinct spec into a
CompiledGrammar (xgrammar caches compiled grammars by their text, so a schema every request
repeats compiles once); each sequence of a constrained request gets its own GrammarMatcher, which
accepts the tokens the sequence is given. Before a constrained row is sampled, its matcher writes
the set of tokens the grammar allows next into one bit per token of a shared int32 bitmask (the
rows of a step are filled together, on xgrammar's threads), and the sampler sets every other
token's logit to -inf on the logits' device in one call for the whole batch.

A matcher that has terminated (it accepted an end-of-sequence token, which a sequence with
ignore_eos outlives) constrains nothing more.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

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


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary, and fills the bitmask of a step's rows."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: frozenset[int], max_rows: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        # The model's vocabulary (its logits' width), which may be padded past the tokenizer's: ids
        # past the tokenizer's are never allowed. The stop tokens are the engine's (generation_config's too).
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True, cache_limit_bytes=_CACHE_BYTES)
        self._batch = xgr.BatchGrammarMatcher("auto")
        # Two host buffers, used in turn: a step's bitmask may still be on its way to the device when
        # the next step's is filled. Pinned where a GPU copies from them.
        pin = torch.cuda.is_available()
        shape = xgr.get_bitmask_shape(max_rows, vocab_size)
        self._buffers = [torch.empty(shape, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._turn = 0

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

    def fill(self, matchers: list[tuple[int, object]]) -> StepMask | None:
        """The bitmask for (sampling row, matcher) pairs; rows whose matcher has terminated are left
        unconstrained. None when no row is constrained."""
        live = [(row, m) for row, m in matchers if not m.is_terminated()]
        if not live:
            return None
        buffer = self._buffers[self._turn]
        self._turn ^= 1
        bitmask = buffer[: len(live)]
        self._batch.batch_fill_next_token_bitmask([m for _, m in live], bitmask)
        return StepMask(bitmask, [row for row, _ in live])


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
    bitmask[torch.tensor(mask.rows, device=logits.device)] = compact
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=mask.rows)


def _choice_grammar(choices: list) -> str:
    # A JSON string literal is also an EBNF string literal: the same escapes.
    return "root ::= " + " | ".join(json.dumps(str(c), ensure_ascii=False) for c in choices)
