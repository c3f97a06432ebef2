"""Prompt lookup (n-gram) proposals: find the latest earlier place where the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min, longest first) occurred, and propose the tokens that
followed it there. Whole batches at once, over a right-aligned token matrix: no Python loop per token."""

from __future__ import annotations

import numpy as np

_PAD = -1  # left padding of the token matrix; never a token id, so it matches nothing


def ngram_drafts(sequences: list[np.ndarray], max_tokens: np.ndarray, min_n: int, max_n: int) -> list[np.ndarray]:
    """Per sequence (its token ids), up to max_tokens[i] proposed next tokens (possibly none).

    The match chosen is the longest (up to max_n tokens, at least min_n), and among equally long ones the
    latest, whose continuation is the text most like what comes next."""
    width = max((len(s) for s in sequences), default=0)
    if width < 2:  # nothing earlier to match
        return [np.zeros(0, dtype=np.int64) for _ in sequences]
    tokens = np.full((len(sequences), max_n + width), _PAD, dtype=np.int64)  # max_n more pad columns on the left
    for row, seq in enumerate(sequences):
        tokens[row, tokens.shape[1] - len(seq) :] = seq
    real = tokens[:, max_n:]  # [B, W]: sequence row, right-aligned
    # Candidate ends e = 1 .. W-1 (a match is real[e - n : e]; e = W is the suffix itself). run[b, e-1]
    # stays true while the tokens before e equal those before W, i tokens back; length counts them.
    run = np.ones((len(sequences), width - 1), dtype=bool)
    length = np.zeros((len(sequences), width - 1), dtype=np.int64)
    for i in range(max_n):  # max_n is small (a handful): the loop is over match lengths, not tokens
        before_e = tokens[:, max_n - i : max_n - i + width - 1]  # real[e - 1 - i] for each e
        before_w = real[:, width - 1 - i : width - i]  # real[W - 1 - i]
        run &= (before_e == before_w) & (before_w != _PAD)
        length += run
    ok = length >= min_n
    # Longest first, then latest: one argmax over length * W + e.
    score = np.where(ok, length * width + np.arange(1, width), -1)
    best = score.argmax(axis=1)
    found = score[np.arange(len(sequences)), best] >= 0
    starts = best + 1  # the continuation begins at e
    kmax = int(max_tokens.max(initial=0))
    index = starts[:, None] + np.arange(max(kmax, 1))[None, :]
    taken = np.take_along_axis(real, np.minimum(index, width - 1), axis=1)
    lengths = np.where(found, np.minimum(max_tokens, width - starts), 0)
    return [taken[row, : lengths[row]] for row in range(len(sequences))]
