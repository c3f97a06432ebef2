"""Turns a batch of logits into next tokens, on the logits' device, with no per-row loops over the vocabulary.

Processing order for each row (all in float32):

1. logit_bias is added.
2. min_tokens: while fewer than min_tokens tokens have been generated, the eos ids (unless
   ignore_eos) and the stop_token_ids get -inf.
3. repetition_penalty (Hugging Face semantics) over prompt + output tokens: a positive logit is
   divided by the penalty, a negative one multiplied.
4. presence_penalty / frequency_penalty (OpenAI semantics) over output tokens only:
   logit -= presence * (count > 0) + frequency * count.
5. Structured outputs: a token the row's grammar does not allow gets -inf (engine/structured.py).
   Greedy rows (temperature ~ 0) take the argmax here. The other rows go on:
6. temperature: logits / T.
7. top-k, then top-p on what top-k kept, then min-p (the Hugging Face warper order). Each keeps
   the tokens whose logit is >= a per-row cutoff, so a token tied with a kept one is kept too;
   this makes the kept set independent of how a sort orders ties, hence of device and batch.
   top-p keeps the smallest prefix of the sorted distribution whose mass reaches p (at least one
   token); min-p drops tokens with prob < min_p * max prob.
8. Sampling by an exponential race driven by a counter-based hash of (seed, step, token): see
   `uniforms`. The draw for a row depends only on that row's seed, step and logits, never on
   the rest of the batch or the row's position in it.

logit_bias keys and stop_token_ids outside the vocabulary are ignored. Columns of `logits` past
vocab_size (a padded lm_head) are not tokens and are dropped first.

Logprobs are always those of the unmodified model distribution: log_softmax of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from engine.sampling_params import SamplingParams
from engine.structured import StepMask, apply_mask

_MASK64 = (1 << 64) - 1


def _int64(x: int) -> int:
    """Python int -> the int64 with the same low 64 bits (torch scalars must fit in int64)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


# SplitMix64 (Steele, Lea & Flood 2014; finalizer constants from Stafford's "Mix13"): the golden-ratio
# Weyl increment and the two multipliers, as int64 bit patterns.
_GAMMA = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """The SplitMix64 finalizer, in place on an int64 tensor, as if it held uint64.

    Multiplication wraps mod 2^64 in torch's int64 exactly as in uint64 (same low bits). Right
    shifts are arithmetic on int64, so each shifted value is masked to the bits a logical shift
    would keep.
    """
    z ^= (z >> 30) & ((1 << 34) - 1)
    z *= _MIX1
    z ^= (z >> 27) & ((1 << 37) - 1)
    z *= _MIX2
    z ^= (z >> 31) & ((1 << 33) - 1)
    return z


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, vocab_size] float64 uniforms in the open interval (0, 1), one per (row, token).

    Entry (r, v) is a pure function of (seeds[r], steps[r], v): a two-level SplitMix64. The step
    picks a stream key, key = SplitMix64 output number `step` of the generator seeded by `seed`;
    token v then reads output number v of the generator seeded by `key`. SplitMix64 output is a
    bijective mix of a Weyl sequence, so within a stream the values for distinct tokens are
    distinct and pass BigCrush; different (seed, step) give unrelated 64-bit keys, and two streams
    could only overlap if their keys landed within vocab_size Weyl steps of each other
    (probability ~ vocab_size / 2^64).
    """
    keys = _mix64_(seeds.to(torch.int64) + _GAMMA)
    keys = _mix64_(keys + (steps.to(torch.int64) + 1) * _GAMMA)
    token_offsets = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device) * _GAMMA
    z = _mix64_(keys[:, None] + token_offsets[None, :])
    # 52 random bits: (m + 0.5) / 2^52 is exact in float64 and lies in [2^-53, 1 - 2^-53], never 0
    # or 1 (53 bits would round the top value up to 1.0).
    mantissa = (z >> 12) & ((1 << 52) - 1)
    return (mantissa.to(torch.float64) + 0.5) * 2.0**-52


# Filtering and the race make several [rows, vocab] temporaries (sort indices, the int64 hash, its
# float64 uniforms); running them on slices of at most this many elements bounds those to a few
# hundred MiB whatever the batch size (256 rows x 152k vocab would otherwise need ~1.3 GiB).
_SAMPLE_SLICE = 1 << 23


def _race(x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of filtered logits `x` [R, V] by an exponential race.

    argmax_v p_v / E_v with E_v = -log(u_v) ~ Exp(1) independent picks v with probability exactly
    p_v. Taken in the log domain, log p_v - log E_v = x_v - log E_v - logsumexp(x), so no softmax
    is needed and tiny probabilities cannot underflow to 0; -inf logits never win.
    """
    log_e = uniforms(seeds, steps, x.shape[-1]).log_().neg_().log_()
    return (x - log_e.to(torch.float32)).argmax(dim=-1)


def _upload_ids(ids: list[int], device: torch.device) -> torch.Tensor:
    # Non-blocking: torch.tensor(list, device=cuda) would wait for the step's forward before copying.
    return torch.from_numpy(np.asarray(ids, dtype=np.int64)).to(device, non_blocking=True)


# Speculative decoding with a draft model reads two more random streams per (seed, output index) besides the
# one a row samples from: the draft's own draw and the acceptance test's uniform. Offsetting the seed gives
# streams unrelated to the sampler's (uniforms() mixes the seed before use).
DRAFT_SALT = _int64(0x5EC0D1A7D2AF7001)
ACCEPT_SALT = _int64(0x5EC0D1A7ACCE9702)


@dataclass
class DraftedRows:
    """Sampling rows of a verify step that check a draft model's sampled token: `rows` (their batch
    indices; random-sampled rows only: greedy rows keep the argmax, the longest-prefix rule), the draft
    token each checks, and the draft's distribution q each was drawn from ([len(rows), vocab] float32)."""

    rows: list[int]
    tokens: list[int]
    q: torch.Tensor


@dataclass(slots=True)  # made for every sampled sequence every step: slots make it cheaper to build
class SamplerRow:
    """One sequence being sampled this step."""

    params: SamplingParams
    seed: int  # always resolved: the request's seed, or one drawn at random at admission
    prompt_token_ids: list[int]
    # Tokens generated so far; may be left empty when params.reads_output_tokens is False (a
    # slice per row per step is O(length) of host time) provided num_output_tokens is given.
    output_token_ids: list[int]
    num_output_tokens: int = -1  # the step being sampled; -1: len(output_token_ids)

    def __post_init__(self) -> None:
        if self.num_output_tokens < 0:
            self.num_output_tokens = len(self.output_token_ids)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, sampled token under log_softmax(raw logits); None if no row asked
    top_ids: torch.Tensor | None  # [B, K] int64, K = the largest `logprobs` asked; None if K == 0 or none asked
    top_logprobs: torch.Tensor | None  # [B, K] float32, sorted descending


@dataclass
class _Step:
    """One step's per-row data on the device; a tensor is None when no row needs it.

    Per-token data is ragged: `*_ids` holds every row's tokens back to back and `*_rows` the row
    each belongs to.
    """

    bias_rows: torch.Tensor | None = None  # logit_bias entries
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    ban_rows: torch.Tensor | None = None  # tokens silenced by min_tokens
    ban_ids: torch.Tensor | None = None
    seen_rows: torch.Tensor | None = None  # prompt + output tokens, for repetition_penalty
    seen_ids: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None  # [B]
    output_rows: torch.Tensor | None = None  # output tokens, for presence/frequency
    output_ids: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None  # [B]
    random: _RandomRows | None = None  # None when every row is greedy


@dataclass
class _RandomRows:
    """The non-greedy rows' sampling parameters on the device, in batch order."""

    index: torch.Tensor | None  # their batch indices; None when every row is random
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    sort_needed: bool  # some row has top-k or top-p
    min_p_needed: bool

    def slice(self, start: int, stop: int) -> _RandomRows:
        return replace(self, **{name: getattr(self, name)[start:stop] for name in _PER_ROW})

    def select(self, positions: list[int]) -> _RandomRows:
        """The rows at `positions` (among these rows, not batch indices), gathered on the device."""
        index = _upload_ids(positions, self.seeds.device)
        return replace(self, index=None, **{name: getattr(self, name)[index] for name in _PER_ROW})


_PER_ROW = ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")


def _random_positions(rows: list[SamplerRow], batch_rows: list[int]) -> list[int]:
    """The positions of random-sampled batch rows `batch_rows` among all the random-sampled rows of `rows`
    (the order _RandomRows holds their parameters in)."""
    position = np.cumsum([not r.params.greedy for r in rows]) - 1
    return position[batch_rows].tolist()


def _to_device(
    ints: dict[str, list[list[int]]], floats: dict[str, list[list[float]]], device: torch.device
) -> dict[str, torch.Tensor]:
    """Ships named columns, each given as a list of chunks, to the device in one int64 and one
    float32 copy, then splits them there. numpy builds the host buffer: torch.tensor on a long
    Python list is several times slower, and a prompt can be thousands of tokens per row."""
    out: dict[str, torch.Tensor] = {}
    for columns, dtype in ((ints, np.int64), (floats, np.float32)):
        if columns:
            sizes = [sum(map(len, chunks)) for chunks in columns.values()]
            values = chain.from_iterable(chain.from_iterable(columns.values()))
            flat = torch.from_numpy(np.fromiter(values, dtype=dtype, count=sum(sizes)))
            out.update(zip(columns.keys(), flat.to(device, non_blocking=True).split(sizes)))
    return out


def _counts_output(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = torch.device(device)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplerRow],
        mask: StepMask | None = None,
        drafted: DraftedRows | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of `logits` [B, >= vocab_size] (any float dtype), each constrained
        row (`mask`) among the tokens its grammar allows. `drafted`: rows that check a sampled draft token
        against its draft probabilities (speculative decoding with a draft model; see DraftedRows)."""
        step = self._upload(rows)
        x = self._process(logits, step)
        if mask is not None:
            apply_mask(x, mask)
        # Taken before the sampling below filters x in place.
        drafted_index = _upload_ids(drafted.rows, x.device) if drafted is not None else None
        held = x[drafted_index] if drafted is not None else None
        random = step.random
        if random is None:
            token_ids = x.argmax(dim=-1)
        elif random.index is None:
            token_ids = self._sample(x, random)
        else:
            token_ids = x.argmax(dim=-1)
            token_ids[random.index] = self._sample(x[random.index], random)
        if drafted is not None:
            token_ids[drafted_index] = self._accept(held, random.select(_random_positions(rows, drafted.rows)), drafted)
        return self._logprobs(logits, rows, token_ids)

    def propose(self, logits: torch.Tensor, rows: list[SamplerRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft model's tokens for `rows`, drawn from its logits processed exactly as the target's are,
        and the distributions q they were drawn from ([B, vocab] float32, zero rows for greedy rows, whose
        token is the argmax; None when every row is greedy). The draw uses its own random stream
        (DRAFT_SALT), independent of the streams the target's verification reads."""
        step = self._upload(rows)
        x = self._process(logits, step)
        token_ids = x.argmax(dim=-1)
        random = step.random
        if random is None:
            return token_ids, None
        picked = x if random.index is None else x[random.index]
        self._filter(picked, random)
        probs = picked.softmax(dim=-1)
        drawn = _race(picked, random.seeds + DRAFT_SALT, random.steps)
        if random.index is None:
            return drawn, probs
        q = torch.zeros_like(x)
        q[random.index] = probs
        token_ids[random.index] = drawn
        return token_ids, q

    def _accept(self, x: torch.Tensor, random: _RandomRows, drafted: DraftedRows) -> torch.Tensor:
        """The standard rule at sampled rows that check a draft token d drawn from q: with p the row's filtered
        distribution (x: its processed logits), d is kept with probability min(1, p(d) / q(d)); otherwise the
        token is drawn from norm(max(0, p - q)), which never holds d. Given the draft, each outcome then has
        probability exactly p's (Leviathan et al. 2023, Chen et al. 2023)."""
        self._filter(x, random)
        p = x.softmax(dim=-1)
        q = drafted.q
        # A draft whose logits were not finite proposed nothing meaningful: its row rejects (q(d) = inf) and
        # draws from p (q = 0), so a fault of the draft model costs speed, never the output's distribution.
        broken = ~q.sum(dim=-1).isfinite()
        q = torch.where(broken[:, None], 0.0, q)
        d = _upload_ids(drafted.tokens, x.device)[:, None]
        p_d, q_d = p.gather(1, d).squeeze(1), q.gather(1, d).squeeze(1)
        q_d = torch.where(broken, float("inf"), q_d)
        u = uniforms(random.seeds + ACCEPT_SALT, random.steps, 1)[:, 0]
        keep = u * q_d.double() <= p_d.double()
        residual = self.residual(p, q)
        resampled = _race(residual.log(), random.seeds, random.steps)
        return torch.where(keep, d.squeeze(1), resampled)

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """norm(max(0, p - q)) up to its scale (the race needs none); p itself in a row where p <= q
        everywhere, which a rejection leaves only through rounding (then p == q, and d is always kept)."""
        residual = (p - q).clamp_(min=0.0)
        return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)

    def process_logits(self, logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
        """Float32 logits after bias, min_tokens and penalties: what greedy rows take the argmax of."""
        return self._process(logits, self._upload(rows))

    def _upload(self, rows: list[SamplerRow]) -> _Step:
        vocab = self.vocab_size
        params = [r.params for r in rows]
        ints: dict[str, list[list[int]]] = {}
        floats: dict[str, list[list[float]]] = {}
        # Ragged per-token columns travel as token ids plus a count per row; the row index of each
        # token is rebuilt on the device.
        ragged: dict[str, list[list[int]]] = {}

        # Ids outside the vocabulary can neither be biased nor generated; dropping them keeps a bad
        # id from becoming an out-of-bounds index on the device.
        biases = (
            [[(t, v) for t, v in (p.logit_bias or {}).items() if 0 <= t < vocab] for p in params]
            if any(p.logit_bias for p in params)
            else []
        )
        if any(biases):
            ragged["bias"] = [[t for t, _ in b] for b in biases]
            floats["bias_values"] = [[v for _, v in b] for b in biases]
        bans = (
            [
                [t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids) if 0 <= t < vocab]
                if r.num_output_tokens < p.min_tokens
                else []
                for r, p in zip(rows, params)
            ]
            if any(p.min_tokens for p in params)
            else []
        )
        if any(bans):
            ragged["ban"] = bans
        if any(p.repetition_penalty != 1.0 for p in params):
            ragged["seen"] = [
                r.prompt_token_ids + r.output_token_ids if r.params.repetition_penalty != 1.0 else [] for r in rows
            ]
            floats["repetition_penalty"] = [[p.repetition_penalty for p in params]]
        if any(_counts_output(p) for p in params):
            ragged["output"] = [r.output_token_ids if _counts_output(r.params) else [] for r in rows]
            floats["presence_penalty"] = [[p.presence_penalty for p in params]]
            floats["frequency_penalty"] = [[p.frequency_penalty for p in params]]
        for name, per_row in ragged.items():
            ints[f"{name}_ids"] = per_row
            ints[f"{name}_counts"] = [[len(tokens) for tokens in per_row]]

        random_rows = [b for b, p in enumerate(params) if not p.greedy]
        if random_rows:
            random_params = [params[b] for b in random_rows]
            if len(random_rows) < len(rows):
                ints["index"] = [random_rows]
            # A disabled filter gets a value that filters nothing (top_k = vocab, top_p = inf), so
            # the device code needs no per-row "enabled" flags.
            ints["top_k"] = [[p.top_k if 0 < p.top_k < vocab else vocab for p in random_params]]
            ints["seeds"] = [[_int64(rows[b].seed) for b in random_rows]]
            ints["steps"] = [[rows[b].num_output_tokens for b in random_rows]]
            floats["temperature"] = [[p.temperature for p in random_params]]
            floats["top_p"] = [[p.top_p if p.top_p < 1.0 else float("inf") for p in random_params]]
            floats["min_p"] = [[p.min_p for p in random_params]]

        tensors = _to_device(ints, floats, self.device)
        for name in ragged:
            ids = tensors[f"{name}_ids"]
            # With output_size given, repeat_interleave needs no device -> host sync.
            tensors[f"{name}_rows"] = torch.repeat_interleave(tensors.pop(f"{name}_counts"), output_size=len(ids))
        random = None
        if random_rows:
            random = _RandomRows(
                index=tensors.pop("index", None),
                **{name: tensors.pop(name) for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")},
                sort_needed=any(0 < p.top_k < vocab or p.top_p < 1.0 for p in random_params),
                min_p_needed=any(p.min_p > 0.0 for p in random_params),
            )
        return _Step(**tensors, random=random)

    def _process(self, logits: torch.Tensor, step: _Step) -> torch.Tensor:
        # A copy, so the caller's logits (and the raw logprobs taken from them) stay untouched.
        x = logits[:, : self.vocab_size].to(torch.float32, copy=True)
        if step.bias_rows is not None:
            x.index_put_((step.bias_rows, step.bias_ids), step.bias_values, accumulate=True)
        if step.ban_rows is not None:
            x[step.ban_rows, step.ban_ids] = float("-inf")
        if step.seen_rows is not None:
            seen = torch.zeros_like(x, dtype=torch.bool)
            seen[step.seen_rows, step.seen_ids] = True
            penalty = step.repetition_penalty[:, None]
            x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
        if step.output_rows is not None:
            counts = torch.zeros_like(x)
            counts.index_put_(
                (step.output_rows, step.output_ids), torch.ones_like(step.output_ids, dtype=x.dtype), accumulate=True
            )
            x -= step.frequency_penalty[:, None] * counts + step.presence_penalty[:, None] * (counts > 0)
        return x

    def _sample(self, x: torch.Tensor, random: _RandomRows) -> torch.Tensor:
        """Filter and sample the non-greedy rows' processed logits `x` (modified in place)."""
        n = max(1, _SAMPLE_SLICE // x.shape[-1])  # rows per slice
        return torch.cat([self._sample_slice(x[i : i + n], random.slice(i, i + n)) for i in range(0, len(x), n)])

    def _sample_slice(self, x: torch.Tensor, random: _RandomRows) -> torch.Tensor:
        return _race(self._filter_slice(x, random), random.seeds, random.steps)

    def _filter(self, x: torch.Tensor, random: _RandomRows) -> torch.Tensor:
        """Temperature and filters on the non-greedy rows' processed logits `x`, in place, slice by slice."""
        n = max(1, _SAMPLE_SLICE // x.shape[-1])
        for i in range(0, len(x), n):
            self._filter_slice(x[i : i + n], random.slice(i, i + n))
        return x

    def _filter_slice(self, x: torch.Tensor, random: _RandomRows) -> torch.Tensor:
        x /= random.temperature[:, None]
        if random.sort_needed:
            x.masked_fill_(x < self._top_k_top_p_cutoff(x, random.top_k, random.top_p)[:, None], float("-inf"))
        if random.min_p_needed:
            # p_v < min_p * p_max  <=>  x_v < x_max + log(min_p), with no softmax; min_p = 0 gives -inf.
            floor = x.max(dim=-1, keepdim=True).values + random.min_p.log()[:, None]
            x.masked_fill_(x < floor, float("-inf"))
        return x

    @staticmethod
    def _top_k_top_p_cutoff(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Per row, the smallest logit that top-k and then top-p keep (one sort for all the rows)."""
        ordered = x.sort(dim=-1, descending=True).values
        kth = ordered.gather(1, (top_k - 1)[:, None])
        ordered.masked_fill_(ordered < kth, float("-inf"))
        probs = ordered.softmax(dim=-1)
        # Keep token i while the mass strictly before it is < p: the smallest prefix reaching p,
        # never empty since the mass before the first token is 0.
        mass_before = probs.cumsum(dim=-1) - probs
        # At least one: a top_p that is positive as the request gave it can round to 0 here (1e-50 in float32),
        # which would keep nothing and index -1.
        num_kept = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_(min=1)
        pth = ordered.gather(1, num_kept - 1)
        # Rounding can let top-p count tokens top-k already dropped (pth = -inf); top-k's cut holds then.
        return torch.maximum(kth, pth).squeeze(1)

    def _logprobs(self, logits: torch.Tensor, rows: list[SamplerRow], token_ids: torch.Tensor) -> SamplerOutput:
        asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        if not asked:
            return SamplerOutput(token_ids, None, None, None)
        logprobs = logits[:, : self.vocab_size].float().log_softmax(dim=-1)
        sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        k = min(max(asked), self.vocab_size)
        if k == 0:
            return SamplerOutput(token_ids, sampled, None, None)
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
        return SamplerOutput(token_ids, sampled, top_ids, top_logprobs)
