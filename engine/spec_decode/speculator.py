"""Which sequences speculate how far in a step, and the n-gram drafts they verify (or, with a draft model,
the room its drafts get: engine/spec_decode/draft_model.py fills it after scheduling).

Cost model. With a per-token acceptance probability a and k draft tokens, a verify step emits
E(a, k) = (1 - a^(k+1)) / (1 - a) tokens on average (Leviathan et al. 2023) and costs (1 + c k) plain
decode steps, c being the cost of one more scored token per sequence relative to a whole decode step
(small where a step is bound by reading the weights: batch 1 on a GPU, or a small model on the CPU). Each
sequence speculates with the k' in 0..k that maximizes E(a, k') / (1 + c k'); k' = 0 (no draft) wins when
its acceptance is too low to pay for the extra tokens. a is estimated per sequence from its recent drafts:
accepted tokens / (accepted tokens + rejections), both decayed by 0.9 a draft, from a prior of a = 0.5.
A sequence held at k' = 0 probes again with one draft token every 16 steps, so a text that turns
repetitive later is caught (unless no k' > 0 would pay even at a = 1, when c >= 1). A step whose
decoding sequences are more than disable_by_batch_size does not
speculate at all: a big batch is compute-bound already, and there c approaches 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import SpeculativeConfig
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode.ngram import ngram_drafts

# c of the cost model, one value for every device for now: measured 0.14 for the default model at batch 1 on
# the CPU (bench/spec_decode.py, WRITEUP.md). A GPU's weight-bound small batches would give less, and the
# choice of k' is flat near the optimum, so this errs on the side of shorter drafts there.
COST_RATIO = 0.15
_DECAY = 0.9
_PROBE_EVERY = 16


@dataclass
class _Acceptance:
    """A sequence's recent drafts: decayed counts of accepted tokens and of rejections (prior: a = 0.5)."""

    accepted: float = 1.0
    rejected: float = 1.0
    idle: int = 0  # steps it did not speculate in because the cost model said k' = 0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


def best_num_tokens(rate: np.ndarray, k: int, cost_ratio: float) -> np.ndarray:
    """Per acceptance rate a, the k' in 0..k maximizing E(a, k') / (1 + c k') (see the module's docstring)."""
    ks = np.arange(k + 1)
    a = np.clip(rate, 0.0, 1.0 - 1e-9)[:, None]
    expected = (1.0 - a ** (ks + 1)) / (1.0 - a)
    return (expected / (1.0 + cost_ratio * ks)).argmax(axis=1)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, cost_ratio: float = COST_RATIO):
        self.config = config
        self.max_model_len = max_model_len
        self.cost_ratio = cost_ratio
        # No probes when no draft length pays even if every token were accepted (c >= 1: a draft model about
        # as costly as the model, such as the model drafting for itself).
        self.probes = best_num_tokens(np.ones(1), config.num_speculative_tokens, cost_ratio)[0] > 0
        self.stats: dict[int, _Acceptance] = {}  # seq_id -> its recent drafts (decoding sequences only)
        # The proposer, chosen once: n-gram lookup drafts now; a draft model drafts once the scheduler has
        # granted the blocks its forwards write to, so here it only reserves the room (placeholder tokens).
        self._propose = self._ngram if config.method == "ngram" else self._placeholders

    def num_decoding(self, running: list[Sequence]) -> int:
        return sum(s.num_uncomputed_tokens == 1 for s in running)

    def speculates(self, running: list[Sequence]) -> bool:
        """Whether a step over these running sequences may carry drafts (then it runs synchronously)."""
        return 0 < self.num_decoding(running) <= self.config.disable_by_batch_size

    def drafts(self, running: list[Sequence]) -> dict[int, list[int]]:
        """seq_id -> draft tokens, for the decoding sequences that speculate in the coming step."""
        if not self.speculates(running):
            return {}
        # Not a constrained sequence: its grammar matcher cannot take back rejected tokens yet. Not one with
        # a token still on the device (async scheduling): its history is not known.
        decoding = [
            s
            for s in running
            if s.status is SequenceStatus.RUNNING
            and s.num_uncomputed_tokens == 1
            and s.num_pending == 0
            and s.matcher is None
            and s.request.pooling is None
        ]
        self.stats = {s.seq_id: self.stats.get(s.seq_id) or _Acceptance() for s in decoding}
        stats = [self.stats[s.seq_id] for s in decoding]
        k = best_num_tokens(np.array([st.rate for st in stats]), self.config.num_speculative_tokens, self.cost_ratio)
        for i, st in enumerate(stats):
            if k[i] == 0:
                st.idle += 1
                if st.idle >= _PROBE_EVERY and self.probes:
                    k[i], st.idle = 1, 0
        # Room left: the step emits up to k + 1 tokens, which must stay within max_tokens and the context.
        room = np.array(
            [
                min(
                    (s.request.params.max_tokens or 1 << 62) - s.num_output_tokens,
                    self.max_model_len - len(s.token_ids),
                )
                - 1
                for s in decoding
            ]
        )
        k = np.minimum(k, room)
        chosen = np.flatnonzero(k > 0)
        if not len(chosen):
            return {}
        return self._propose([decoding[i] for i in chosen], k[chosen])

    def _ngram(self, seqs: list[Sequence], k: np.ndarray) -> dict[int, list[int]]:
        proposals = ngram_drafts(
            [s.token_array(0, len(s.token_ids)) for s in seqs],
            k,
            self.config.prompt_lookup_min,
            self.config.prompt_lookup_max,
        )
        return {s.seq_id: d.tolist() for s, d in zip(seqs, proposals) if len(d)}

    @staticmethod
    def _placeholders(seqs: list[Sequence], k: np.ndarray) -> dict[int, list[int]]:
        """k placeholder tokens per sequence, which the draft model replaces after scheduling."""
        return {s.seq_id: [0] * int(n) for s, n in zip(seqs, k)}

    def observe(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        """A draft of `seq` was verified: `num_accepted` of its `num_draft` tokens were taken."""
        st = self.stats.get(seq.seq_id)
        if st is None:
            return
        st.accepted = _DECAY * st.accepted + num_accepted
        st.rejected = _DECAY * st.rejected + (num_accepted < num_draft)
