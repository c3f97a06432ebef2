"""Which steps speculate, which sequences speculate how far in them, and the n-gram drafts they verify (or,
with a draft model, the room its drafts get: engine/spec_decode/draft_model.py fills it after scheduling).

Per sequence. With a per-token acceptance probability a and k draft tokens, a verify step emits
E(a, k) = (1 - a^(k+1)) / (1 - a) tokens on average (Leviathan et al. 2023) and costs (1 + c k) plain
decode steps, c being the cost of one more scored token per sequence relative to a whole decode step
(small where a step is bound by reading the weights: batch 1 on a GPU, or a small model on the CPU; plus the
draft model's share of the weight bytes per draft token). Each sequence speculates with the k' in 0..k that
maximizes E(a, k') / (1 + c k'); k' = 0 (no draft) wins when its acceptance is too low to pay for the extra
tokens. a is estimated per sequence from its recent drafts: accepted tokens / (accepted tokens + rejections),
both decayed by 0.9 a draft, from a prior of the same counts over every sequence's recent drafts (at first
a = 0.5); an n-gram lookup that finds no match counts as a draft rejected at its first token. A sequence
held at k' = 0 in a speculative step drafts one token again every 16 such steps, so a text that turns
repetitive later is caught.

Per step. A speculative step runs synchronously: its drafts need the tokens of the step before on the host,
so the next step cannot be scheduled while it runs, and with async scheduling (a GPU) that overlap is worth
10-30% of a small model's step. So whether a step speculates at all is decided from measured times: the
engine times every step from its launch to the next launch (`StepTimes`, decayed averages per decode batch
size bucket) for plain decode steps in the engine's usual mode (pipelined where it pipelines) and for
speculative steps, with their drafted tokens. A step speculates when its expected tokens (E(a_i, k_i) of the
speculating sequences plus one of every other decoding sequence) per predicted speculative step time beat
the decoding sequences per measured decode step time. The speculative time is the measured one of the batch
size's bucket scaled by the cost model's (1 + c d / n) for d drafted tokens over n sequences, or, until
_MIN_MEASURED are, the decode step's time so scaled (optimistic: it ignores the lost overlap, so the first
speculative steps run and are measured). Until _MIN_MEASURED decode steps of the bucket are, steps do not
speculate.
A step that would not pay speculates anyway once in _PROBE_STEPS such steps (each sequence drafting at
least one token), which keeps the acceptance estimates and the speculative timing current and bounds what
probing costs. No step speculates with more than disable_by_batch_size decoding sequences (a big batch is
compute-bound already, and there c approaches 1), and none at all when no draft length would pay even at
a = 1 (c >= 1: a draft model about as costly as the model, such as the model drafting for itself): then every
step stays pipelined and the draft model never runs.

The guard. The cost model predicts; what a step costs and emits in the end also depends on what it does not
see (which sequences find a draft, runs of acceptance, the host work around a synchronous step, the pipeline
drained and refilled, a step with prompt tokens run synchronously after a speculative one). So per decode batch
size bucket the speculator also counts what its steps emitted per second, prompt steps included, in two modes:
"on" (the cost model and its probes decide, as above) and "off" (speculation held off, every step plain). The
bucket runs in cycles of _GUARD_CYCLE of its steps: the mode ahead, then _GUARD_EXPLORE steps of the mode
behind (each mode first runs until measured, on first). Every step of a run is counted, the ones at its edges
too, so a run's sums hold what switching modes cost. The mode behind costs what it loses over
_GUARD_EXPLORE / _GUARD_CYCLE of the steps (under 1% where speculation loses 20%), within the 3% speculation
may ever cost; a workload that turns repetitive is caught within a cycle (a few hundred steps). What neither
mode's sums can show is a cost that outlasts the mode: sequences that started and would finish together (a closed
loop of equal output lengths) drift apart once any step speculates, in either mode from then on, and their
successors' prompts then arrive one at a time, each in a step of its own (WRITEUP.md, "The 3% rule on the H200").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from engine.config import SpeculativeConfig
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode.ngram import NgramProposer

# c of the cost model for n-gram drafts: measured 0.14 for the default model at batch 1 on the CPU
# (bench/spec_decode.py, WRITEUP.md). It only shapes the draft lengths and the slope of the speculative step
# time in drafted tokens; whether a step speculates at all rests on the measured step times.
COST_RATIO = 0.15
_DECAY = 0.9  # per draft, of a sequence's acceptance counts: about its last 10 drafts
_PROBE_EVERY = 16  # speculative steps a sequence at k' = 0 waits before it drafts one token again
# One step in this many that the measured cost model turns down speculates anyway. A probe costs at most about
# one step's time (a synchronous step whose drafts are rejected), so probing costs under 1/64 < 2% of the
# throughput, within the 3% that speculation may ever cost; it still notices a turn to repetitive text, or a
# cheaper speculative step, within 64 steps.
_PROBE_STEPS = 64
# Of a step-time average, the weight of what was measured before the latest step: about the last 5 steps,
# enough to smooth the noise of one step's host work and quick to follow a change of context length.
_TIME_DECAY = 0.8
# Steps of a kind measured before their average is trusted: one step's time can be far off (a busy host, a
# first step of its shape), and a speculative step that looks slow by chance would stop speculation until the
# next probe.
_MIN_MEASURED = 3
# The step decision reads each sequence's k' and E(a, k') from a table over a in steps of 1/256 (numpy per step
# cost ~100 us on a busy host, a few % of a small model's GPU step); k' is flat near its optimum.
_RATE_STEPS = 256
# The guard's cycle, in steps of one bucket, and the steps of it in the mode behind (see the docstring).
_GUARD_CYCLE = 512
_GUARD_EXPLORE = 24
# Of a mode's sums of tokens and seconds, the weight of what came before the latest step: about the last 100
# steps, four runs of the mode behind, enough to average single steps' noise and the rare long prompt step.
_GUARD_DECAY = 0.99


@dataclass
class _Acceptance:
    """A sequence's recent drafts: decayed counts of accepted tokens and of rejections (prior: a = 0.5)."""

    accepted: float = 1.0
    rejected: float = 1.0
    idle: int = 0  # speculative steps it did not draft in because the cost model said k' = 0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass
class _Timing:
    """Decayed averages over one kind of step of its period (seconds) and of its drafted tokens."""

    seconds: float = 0.0
    drafted: float = 0.0
    weight: float = 0.0
    count: int = 0  # steps measured

    @property
    def measured(self) -> bool:
        return self.count >= _MIN_MEASURED

    def add(self, seconds: float, drafted: int) -> None:
        old = _TIME_DECAY * self.weight
        self.weight, self.count = old + 1.0, self.count + 1
        self.seconds = (old * self.seconds + seconds) / self.weight
        self.drafted = (old * self.drafted + drafted) / self.weight


@dataclass
class StepTimes:
    """Measured step periods (launch to next launch) of decode-only steps, per decode batch size bucket:
    plain steps in the engine's usual mode, and speculative steps."""

    decode: dict[int, _Timing] = field(default_factory=dict)
    spec: dict[int, _Timing] = field(default_factory=dict)

    @staticmethod
    def bucket(num_seqs: int) -> int:
        """The power of two at or above num_seqs: a decode step's time changes little within a factor of two."""
        return 1 << max(0, num_seqs - 1).bit_length()

    def add_decode(self, num_seqs: int, seconds: float) -> None:
        _bucket_entry(self.decode, self.bucket(num_seqs), _Timing).add(seconds, 0)

    def add_spec(self, num_seqs: int, drafted: int, seconds: float) -> None:
        _bucket_entry(self.spec, self.bucket(num_seqs), _Timing).add(seconds, drafted)


def _bucket_entry(table: dict, bucket: int, make: type):
    """table[bucket], made by make() on first use (not dict.setdefault: that would build one every step)."""
    entry = table.get(bucket)
    if entry is None:
        entry = table[bucket] = make()
    return entry


@dataclass
class _Throughput:
    """Decayed sums of the tokens steps emitted and of their periods."""

    tokens: float = 0.0
    seconds: float = 0.0
    count: int = 0  # steps counted

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = _GUARD_DECAY * self.tokens + tokens
        self.seconds = _GUARD_DECAY * self.seconds + seconds
        self.count += 1

    @property
    def rate(self) -> float:
        """Tokens per second."""
        return self.tokens / self.seconds if self.seconds > 0.0 else 0.0


@dataclass
class Guard:
    """One decode batch size bucket's guard (see the module's docstring): tokens per second with speculation
    on and held off, and the bucket's place in its cycle."""

    on: _Throughput = field(default_factory=_Throughput)
    off: _Throughput = field(default_factory=_Throughput)
    step: int = 0  # steps of the bucket decided since both modes were measured

    def allows(self) -> bool:
        """Whether the coming step of this bucket runs with speculation on (called once per step)."""
        if self.on.count < _GUARD_EXPLORE:
            return True
        if self.off.count < _GUARD_EXPLORE:
            return False
        ahead = self.on.rate > self.off.rate
        explore = self.step % _GUARD_CYCLE >= _GUARD_CYCLE - _GUARD_EXPLORE  # a cycle ends with it
        self.step += 1
        return ahead != explore


def expected_tokens(rate: np.ndarray, k: np.ndarray) -> np.ndarray:
    """E(a, k): the tokens a verify step emits on average for acceptance rate a and k draft tokens."""
    # Kept off 0: a rate decayed to 1e-16 and below would tie every k in floating point (E = 1), and with c = 0
    # a longer draft must still win. Off 1: the formula's 0 / 0. (np.clip's own checks cost more than this.)
    a = np.minimum(np.maximum(rate, 1e-6), 1.0 - 1e-9)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@functools.lru_cache(maxsize=8)
def _lengths(k: int, cost_ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """The draft lengths 0..k and their costs 1 + c k', made once (best_num_tokens runs every speculative step)."""
    ks = np.arange(k + 1)
    return ks, 1.0 + cost_ratio * ks


def best_num_tokens(rate: np.ndarray, k: int, cost_ratio: float) -> np.ndarray:
    """Per acceptance rate a, the k' in 0..k maximizing E(a, k') / (1 + c k') (see the module's docstring)."""
    ks, cost = _lengths(k, cost_ratio)
    return (expected_tokens(np.asarray(rate)[:, None], ks) / cost).argmax(axis=1)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, cost_ratio: float = COST_RATIO):
        self.config = config
        self.max_model_len = max_model_len
        self.cost_ratio = cost_ratio
        # Off for good when no draft length pays even if every token were accepted (c >= 1).
        self.can_pay = bool(best_num_tokens(np.ones(1), config.num_speculative_tokens, cost_ratio)[0] > 0)
        self.adaptive = True  # False: every step that may speculate does (speculate_always)
        self.times = StepTimes()
        self.declined = 0  # steps turned down by the measured cost model since the last speculative one
        self.stats: dict[int, _Acceptance] = {}  # seq_id -> its recent drafts (decoding sequences only)
        # Every sequence's recent drafts together: a new sequence's prior, as a workload's requests resemble
        # each other (without it, a new sequence of a repetitive workload would start at a = 0.5, which may not
        # pay, and a sequence that does not draft never learns better).
        self.overall = _Acceptance()
        self._table: tuple[float, list[int], list[float]] | None = None  # (c, k', E) per a (_RATE_STEPS)
        self._decision: bool | None = None  # the coming step's, once speculates() has made it
        self.guards: dict[int, Guard] = {}  # per decode batch size bucket (StepTimes.bucket)
        # The guard and its mode for the coming step (None: no guard decided it) and, once drafts() has taken
        # the decision, for the step being scheduled: its tokens and period count there (count_step).
        self._mode: tuple[Guard, bool] | None = None
        self.step_mode: tuple[Guard, bool] | None = None
        self._probing = False  # the coming step speculates as a probe
        # The proposer, chosen once: n-gram lookup drafts now; a draft model drafts once the scheduler has
        # granted the blocks its forwards write to, so here it only reserves the room (placeholder tokens).
        self._lookup = None
        self._propose = self._placeholders
        if config.method == "ngram":
            self._lookup = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            self._propose = self._lookup.propose

    def speculate_always(self) -> None:
        """Every step that may speculate does, each sequence with the full k where its room allows (c = 0):
        for tests and benchmarks that want the most drafts to verify."""
        self.cost_ratio, self.adaptive = 0.0, False
        self.can_pay = True

    def num_decoding(self, running: list[Sequence]) -> int:
        """The decoding sequences among `running`, counted up to one past disable_by_batch_size (beyond that no
        step speculates, and a large batch is not walked every step)."""
        limit, n = self.config.disable_by_batch_size, 0
        for s in running:
            if len(s.token_ids) - s.num_computed_tokens == 1:  # s.num_uncomputed_tokens, without a property call
                n += 1
                if n > limit:
                    break
        return n

    def speculates(self, running: list[Sequence]) -> bool:
        """Whether the coming step over these running sequences carries drafts (then it runs synchronously).
        Decided once per step: the next drafts() call keeps this decision."""
        if self._decision is None:
            self._decision = self._decide(running)
        return self._decision

    def drafts(self, running: list[Sequence]) -> dict[int, list[int]] | None:
        """seq_id -> draft tokens, for the decoding sequences that speculate in the coming step; None when the
        step does not speculate (a speculating step may still find no draft: {})."""
        go = self.speculates(running)
        probing, self._decision, self._probing = self._probing, None, False
        self.step_mode, self._mode = self._mode, None
        if not go:
            return None
        decoding = [s for s in self._candidates(running) if s.num_pending == 0]
        self.stats = {s.seq_id: self.stats.get(s.seq_id) or self._prior() for s in decoding}
        if self._lookup is not None:
            self._lookup.retain(self.stats.keys())
        stats = [self.stats[s.seq_id] for s in decoding]
        k = best_num_tokens(np.array([st.rate for st in stats]), self.config.num_speculative_tokens, self.cost_ratio)
        # Per sequence in plain Python (numpy's per-call cost is more than a batch of <= 16 takes here).
        seqs, lengths = [], []
        for s, st, n in zip(decoding, stats, k.tolist()):
            if n == 0:
                st.idle += 1
                if st.idle >= _PROBE_EVERY or probing:
                    n, st.idle = 1, 0
            # Room left: the step emits up to n + 1 tokens, which must stay within max_tokens and the context.
            max_tokens = s.request.params.max_tokens or 1 << 62
            n = min(n, max_tokens - s.num_output_tokens - 1, self.max_model_len - len(s.token_ids) - 1)
            if n > 0:
                seqs.append(s)
                lengths.append(n)
        if not seqs:
            return {}
        proposals = self._propose(seqs, lengths)
        for seq in seqs:
            if seq.seq_id not in proposals:  # no n-gram match: as good as a draft rejected at once
                self.observe(seq, 1, 0)
        return proposals

    @staticmethod
    def _candidates(running: list[Sequence]) -> list[Sequence]:
        """The decoding sequences that may draft. Not a constrained sequence: its grammar matcher cannot take
        back rejected tokens yet. (One with a token still on the device may not draft in this step either,
        drafts() drops it, but it may in the next: speculates() decides with it in.)"""
        return [
            s
            for s in running
            if s.status is SequenceStatus.RUNNING
            and s.num_uncomputed_tokens == 1
            and s.matcher is None
            and s.request.pooling is None
        ]

    def _decide(self, running: list[Sequence]) -> bool:
        """Whether the coming step speculates: see the module's docstring."""
        if not self.can_pay:  # off for good: no pass over the batch
            return False
        n = self.num_decoding(running)
        if not 0 < n <= self.config.disable_by_batch_size:
            return False
        if not self.adaptive:
            return True
        bucket = StepTimes.bucket(n)
        guard = _bucket_entry(self.guards, bucket, Guard)
        on = guard.allows()
        self._mode = (guard, on)
        if not on:
            return False
        if self._pays(n, self._candidates(running)):
            self.declined = 0
            return True
        self.declined += 1
        if self.declined >= _PROBE_STEPS:
            self.declined, self._probing = 0, True
            return True
        return False

    def _pays(self, n: int, candidates: list[Sequence]) -> bool:
        """Whether a speculative step over `n` decoding sequences, `candidates` of which may draft, is expected
        to emit more tokens per second than a plain decode step."""
        decode = self.times.decode.get(StepTimes.bucket(n))
        if decode is None or not decode.measured or not candidates:
            return False
        if self._table is None or self._table[0] != self.cost_ratio:
            rates = np.linspace(0.0, 1.0, _RATE_STEPS + 1)
            k = best_num_tokens(rates, self.config.num_speculative_tokens, self.cost_ratio)
            self._table = (self.cost_ratio, k.tolist(), expected_tokens(rates, k).tolist())
        _, table_k, table_e = self._table
        prior = self.overall.rate
        tokens, drafted = float(n - len(candidates)), 0
        for s in candidates:
            st = self.stats.get(s.seq_id)
            i = round((st.rate if st is not None else prior) * _RATE_STEPS)
            tokens += table_e[i]
            drafted += table_k[i]
        if drafted == 0:
            return False
        spec = self.times.spec.get(StepTimes.bucket(n))
        if spec is None or not spec.measured:
            seconds = decode.seconds * (1.0 + self.cost_ratio * drafted / n)
        else:
            scale = (1.0 + self.cost_ratio * drafted / n) / (1.0 + self.cost_ratio * spec.drafted / n)
            seconds = spec.seconds * scale
        return tokens / seconds > n / decode.seconds

    @staticmethod
    def count_step(mode: tuple[Guard, bool], tokens: int, seconds: float) -> None:
        """A step that `mode` (its step_mode) ran emitted `tokens` in a period of `seconds` (launch to next
        launch)."""
        guard, on = mode
        (guard.on if on else guard.off).add(tokens, seconds)

    @staticmethod
    def _placeholders(seqs: list[Sequence], k: list[int]) -> dict[int, list[int]]:
        """k placeholder tokens per sequence, which the draft model replaces after scheduling."""
        return {s.seq_id: [0] * n for s, n in zip(seqs, k)}

    def _prior(self) -> _Acceptance:
        """A new sequence's acceptance: the workload's recent rate, weighing as much as the first prior (2)."""
        rate = self.overall.rate
        return _Acceptance(accepted=2.0 * rate, rejected=2.0 * (1.0 - rate))

    def observe(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        """A draft of `seq` was verified: `num_accepted` of its `num_draft` tokens were taken."""
        st = self.stats.get(seq.seq_id)
        if st is None:
            return
        for acc in (st, self.overall):
            acc.accepted = _DECAY * acc.accepted + num_accepted
            acc.rejected = _DECAY * acc.rejected + (num_accepted < num_draft)
