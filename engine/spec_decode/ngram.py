"""Prompt lookup (n-gram) proposals: find the latest earlier place where the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min, longest first) occurred, and propose the tokens that
followed it there.

The search is a byte search (bytes.rfind, in C) over the sequence's tokens as int32, at most
max_n - min_n + 1 of them per sequence and no Python loop over tokens. NgramProposer keeps each sequence's
int32 bytes between steps and appends only the tokens added since its last lookup: converting the whole
sequence every step cost more than the search (~20 us per 1,000 tokens per sequence).
"""

from __future__ import annotations

from array import array
from collections.abc import Set
from dataclasses import dataclass

from engine.sequence import Sequence

_ITEM = array("i").itemsize  # bytes per token in a search buffer (C int: 4)


def token_bytes(tokens: list[int]) -> bytearray:
    return bytearray(array("i", tokens))


def ngram_draft(
    tokens: list[int], max_tokens: int, min_n: int, max_n: int, data: bytearray | bytes | None = None
) -> list[int]:
    """Up to max_tokens proposed next tokens of a sequence (its `tokens`; `data`: the same as token_bytes(),
    when the caller keeps them), possibly none.

    The match chosen is the longest (up to max_n tokens, at least min_n), and among equally long ones the
    latest, whose continuation is the text most like what comes next. A match may overlap the suffix it
    matches, but not be it: it ends before the last token."""
    if data is None:
        data = token_bytes(tokens)
    width = len(tokens)
    end = (width - 1) * _ITEM
    # The first n (longest first) with a match gives the longest match: a longer one would have matched at n + 1.
    for n in range(min(max_n, width - 1), min_n - 1, -1):
        suffix = data[(width - n) * _ITEM :]
        stop = end
        # rfind gives the latest match; one that starts inside a token (its bytes straddle two) is no match of
        # tokens, so the search goes on before it.
        while (at := data.rfind(suffix, 0, stop)) >= 0 and at % _ITEM:
            stop = at + len(suffix) - 1
        if at >= 0:
            start = at // _ITEM + n  # the continuation begins where the match ends
            return tokens[start : start + min(max_tokens, width - start)]
    return []


@dataclass
class _Buffer:
    """A sequence's first `length` tokens as int32 bytes, the last of which is `last`."""

    data: bytearray
    length: int
    last: int


class NgramProposer:
    """n-gram drafts for a batch, keeping each sequence's search buffer from step to step."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._buffers: dict[int, _Buffer] = {}  # seq_id -> its tokens as of its last lookup

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> dict[int, list[int]]:
        """seq_id -> up to max_tokens[i] draft tokens, for the sequences with a match. Every token of a
        sequence must be known (none pending)."""
        out = {}
        for seq, k in zip(seqs, max_tokens):
            tokens = seq.token_ids
            draft = ngram_draft(tokens, k, self.min_n, self.max_n, self._synced(seq.seq_id, tokens).data)
            if draft:
                out[seq.seq_id] = draft
        return out

    def retain(self, seq_ids: Set[int]) -> None:
        """Drop the buffers of sequences other than these (finished, or no longer decoding)."""
        if len(self._buffers) > len(seq_ids) or not self._buffers.keys() <= seq_ids:
            self._buffers = {i: b for i, b in self._buffers.items() if i in seq_ids}

    def _synced(self, seq_id: int, tokens: list[int]) -> _Buffer:
        """The sequence's buffer, extended by the tokens added since its last lookup. Known tokens are never
        rewritten (only trailing placeholders are), so the buffer's tokens are still the sequence's first ones;
        the check of the last one catches a sequence whose tokens were cut back (then it is made again)."""
        buf = self._buffers.get(seq_id)
        n = len(tokens)
        if buf is None or buf.length > n or tokens[buf.length - 1] != buf.last:
            buf = self._buffers[seq_id] = _Buffer(token_bytes(tokens), n, tokens[-1])
        elif buf.length < n:
            buf.data += array("i", tokens[buf.length :])
            buf.length, buf.last = n, tokens[-1]
        return buf
