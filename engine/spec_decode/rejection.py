"""The acceptance rule of speculative decoding, for proposers whose draft is a fixed token sequence.

The target scores a speculating sequence's last token and its k draft tokens d_1..d_k in one forward,
which gives k + 1 next-token distributions p_0..p_k. Each position is sampled by the ordinary sampler
(engine/sampler.py), with that position's history: the same logit processing (bias, min_tokens,
penalties over the output so far plus the draft tokens before it), temperature and filters, and the
sampler's random stream for that output index and the sequence's seed. With t_i the token sampled from
p_i, the sequence takes d_1..d_m while t_{i-1} = d_i, then t_m: m + 1 tokens, k + 1 when every draft
token matches (t_k is the bonus token).

This is the standard rule (accept x with probability min(1, p(x)/q(x)); on rejection sample from
norm(max(0, p - q))) for a draft distribution q that is a point mass on d_i, which a deterministic
proposer such as n-gram lookup is: t_i = d_i happens with probability p_i(d_i) = min(1, p/q), and given
t_i != d_i, t_i is distributed as p_i with d_i removed and renormalized = norm(max(0, p_i - q)). So every
emitted token has exactly the target's distribution given the tokens before it. Greedy rows (argmax) reduce
to the longest prefix of the draft that equals the target's greedy tokens. A seeded request stays
reproducible: t_i depends only on the seed, the output index and the logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from engine.sampler import SamplerRow

if TYPE_CHECKING:
    from engine.sequence import Sequence

T = TypeVar("T")


def verify_row(seq: Sequence, draft: list[int], i: int) -> SamplerRow:
    """The sampler row of draft position i: output token num_output_tokens + i, after the draft's first i
    tokens (its penalties, min_tokens and random stream are those of that position)."""
    params = seq.request.params
    output = [*seq.output_token_ids, *draft[:i]] if params.reads_output_tokens else []
    return SamplerRow(params, seq.seed, seq.request.prompt_token_ids, output, seq.num_output_tokens + i)


def expand_rows(entries: list[T], drafts: list[list[int]]) -> list[T]:
    """One sampling row per scored position: entry i repeated len(drafts[i]) + 1 times."""
    return [entry for entry, draft in zip(entries, drafts) for _ in range(len(draft) + 1)]


def accepted_lengths(drafts: list[list[int]], sampled: list[int]) -> list[int]:
    """Per entry, how many of its draft tokens the target accepted: the length of the longest prefix of
    drafts[i] equal to the target's tokens sampled at the positions before each (`sampled`: every entry's
    len(drafts[i]) + 1 tokens, entry after entry)."""
    # Plain Python: it compares at most the accepted tokens + 1 of each entry, about what the scheduler's update
    # does per token anyway, where numpy's calls over a [entries, k] matrix cost ~50 us a step at batch 8.
    out = []
    first = 0
    for draft in drafts:
        n = 0
        for token in draft:
            if sampled[first + n] != token:
                break
            n += 1
        out.append(n)
        first += len(draft) + 1
    return out
