"""Pooling for embedding requests: their prompt rows' final hidden states become one vector per request,
on the device, in the step that computes the prompt's last chunk."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.runner.step_inputs import upload
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence


@dataclass
class PooledRows:
    """The vectors of the embedding requests whose prompts completed in a launched step."""

    seqs: list[Sequence]
    vectors: torch.Tensor  # [len(seqs), hidden] float32; on CUDA a pinned host copy, landed once `event` fires
    event: torch.cuda.Event | None = None


class Pooler:
    """Pools hidden states, keeping a running sum (float32, on the device) for each mean-pooled prompt
    that spans several chunks."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums: dict[int, torch.Tensor] = {}  # seq_id -> [hidden] sum of its chunks so far

    def pool(
        self, hidden: torch.Tensor, scheduled: list[ScheduledSeq], ends: np.ndarray, rows: list[int]
    ) -> PooledRows | None:
        """Enqueue the pooling of a step's embedding rows (`rows`: their indices in `scheduled`; `ends`: index
        past each scheduled sequence's last row of `hidden`) and the copy of the finished vectors to the host.
        Called at launch, so each sequence's num_computed_tokens is still where its chunk starts."""
        seqs: list[Sequence] = []
        parts: list[torch.Tensor] = []
        mean = [i for i in rows if scheduled[i].seq.request.pooling.pooling_type == "mean"]
        last = [i for i in rows if i not in mean and scheduled[i].completes]
        if last:
            seqs += [scheduled[i].seq for i in last]
            parts.append(hidden[upload(ends[last] - 1, self.device)].float())
        if mean:
            done, means = self._mean(hidden, [scheduled[i] for i in mean], ends[mean])
            if done:
                seqs += done
                parts.append(means)
        if not seqs:
            return None
        vectors = torch.cat(parts) if len(parts) > 1 else parts[0]
        normalize = [s.request.pooling.normalize for s in seqs]
        if all(normalize):
            vectors = F.normalize(vectors, dim=-1)
        elif any(normalize):
            mask = upload(np.array(normalize), self.device).unsqueeze(1)
            vectors = torch.where(mask, F.normalize(vectors, dim=-1), vectors)
        return self._to_host(seqs, vectors)

    def _mean(
        self, hidden: torch.Tensor, items: list[ScheduledSeq], ends: np.ndarray
    ) -> tuple[list[Sequence], torch.Tensor]:
        """Add each chunk's hidden states to its prompt's running sum; the prompts this step completes and
        their means."""
        lengths = np.array([item.num_new_tokens for item in items])
        token_rows = np.concatenate([np.arange(end - n, end) for end, n in zip(ends, lengths)])
        owner = np.repeat(np.arange(len(items)), lengths)
        sums = torch.zeros(len(items), hidden.shape[1], dtype=torch.float32, device=self.device)
        sums.index_add_(0, upload(owner, self.device), hidden[upload(token_rows, self.device)].float())
        done, done_rows = [], []
        for j, item in enumerate(items):
            seq = item.seq
            # Popped whatever happens: a sequence preempted by recomputation starts again at token 0, and
            # its old sum must not count.
            earlier = self.sums.pop(seq.seq_id, None)
            if earlier is not None and seq.num_computed_tokens > 0:
                sums[j] += earlier
            if item.completes:
                done.append(seq)
                done_rows.append(j)
            else:
                self.sums[seq.seq_id] = sums[j]
        if not done:
            return [], sums
        counts = np.array([seq.num_prompt_tokens for seq in done], dtype=np.float32)
        return done, sums[upload(np.array(done_rows), self.device)] / upload(counts, self.device).unsqueeze(1)

    def _to_host(self, seqs: list[Sequence], vectors: torch.Tensor) -> PooledRows:
        if self.device.type != "cuda":
            return PooledRows(seqs, vectors)
        # Pinned and behind an event, as the sampled tokens: the host does not wait for the copy.
        host = torch.empty(vectors.shape, dtype=vectors.dtype, pin_memory=True)
        host.copy_(vectors, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PooledRows(seqs, host, event)

    def collect(self, pooled: PooledRows) -> list[tuple[Sequence, list[float]]]:
        """Wait for a step's pooled vectors and read them: (sequence, its embedding) per finished prompt."""
        if pooled.event is not None:
            pooled.event.synchronize()
        return list(zip(pooled.seqs, pooled.vectors.tolist()))

    def forget(self, seq_id: int) -> None:
        """Drop the running sum of a sequence that ended before its prompt did (an abort)."""
        self.sums.pop(seq_id, None)
