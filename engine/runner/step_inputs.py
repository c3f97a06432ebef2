"""A step's flat inputs: token ids, positions, the attention metadata (slots, block tables, lengths),
and the placeholders async scheduling leaves for tokens still on the device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.scheduler import ScheduledSeq
from engine.sequence import PLACEHOLDER, Sequence


@dataclass
class StepInputs:
    """Host arrays of one step, sequence after sequence."""

    seqs: list[Sequence]
    num_new: np.ndarray  # [S] tokens each sequence computes this step
    token_ids: np.ndarray  # [T] int64 (PLACEHOLDERs zeroed; `fill` supplies them on the device)
    positions: np.ndarray  # [T] int64
    ends: np.ndarray  # [S] index past each sequence's last new token
    tables: list[np.ndarray]  # [S] block tables, int32 (Sequence.block_table_array)

    @property
    def decode_only(self) -> bool:
        return len(self.token_ids) == len(self.seqs)


def new_token_ids(scheduled: list[ScheduledSeq]) -> np.ndarray:
    """The token ids the scheduled sequences compute this step, one after another, as int64."""
    # Decodes' tokens and drafts (a few each) are gathered in one list and converted together, at once in a step
    # of decodes and verifies only; prompt chunks come as arrays, put between the list's pieces.
    ids: list[int] = []
    chunks: list[tuple[int, np.ndarray]] = []  # (where in `ids` a chunk goes, its tokens)
    for item in scheduled:
        seq, start = item.seq, item.seq.num_computed_tokens
        if item.num_new_tokens == 1 or item.draft:  # its last token, then the draft it verifies
            ids.append(seq.token_ids[start])
            ids += item.draft
        else:
            chunks.append((len(ids), seq.token_array(start, start + item.num_new_tokens)))
    if not chunks:
        return np.array(ids, dtype=np.int64)
    pieces, done = [], 0
    for at, chunk in chunks:
        pieces += [np.array(ids[done:at], dtype=np.int64), chunk]
        done = at
    pieces.append(np.array(ids[done:], dtype=np.int64))
    return np.concatenate(pieces)


def step_inputs(scheduled: list[ScheduledSeq]) -> StepInputs:
    seqs = [s.seq for s in scheduled]
    num_new = np.array([s.num_new_tokens for s in scheduled])
    num_computed = np.array([s.num_computed_tokens for s in seqs])
    token_ids = new_token_ids(scheduled)
    # Positions: each sequence's new tokens continue from its computed ones.
    ends = np.cumsum(num_new)
    positions = np.repeat(num_computed - (ends - num_new), num_new) + np.arange(len(token_ids))
    return StepInputs(seqs, num_new, token_ids, positions, ends, [s.block_table_array() for s in seqs])


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    # non_blocking: a copy from pageable memory is staged at once, without waiting for the GPU
    # to finish earlier work (a blocking copy would, and the host would idle until it does).
    return torch.from_numpy(array).to(device, non_blocking=True)


def placeholders(
    inputs: StepInputs,
    previous_rows: dict[int, int] | None,
    previous_tokens: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(input indices, their tokens on the device) for PLACEHOLDER inputs, taken from the previous
    step's sampled tokens (`previous_rows`: seq_id -> its row there); zeroes them in `token_ids`.

    A placeholder is always the last token of its sequence, so only the last input of each
    sequence is looked at."""
    if previous_rows is None:
        return None
    last = inputs.ends - 1
    waiting = np.flatnonzero(inputs.token_ids[last] == PLACEHOLDER)
    if not len(waiting):
        return None
    dst = last[waiting]
    inputs.token_ids[dst] = 0
    src = np.array([previous_rows[inputs.seqs[i].seq_id] for i in waiting])
    return upload(dst, device), previous_tokens[upload(src, device)]


def block_table_array(
    tables: list[list[int]] | list[np.ndarray], out: np.ndarray | None = None, multiple: int = 16
) -> np.ndarray | int:
    """Rows of block ids, zero-padded to a common width that is a multiple of `multiple`.

    The width is a stride of the attention kernels' block-table argument (AttentionBackend.pad_block_tables
    says why a backend pads it). Without `out`: a new [rows, width] int32 array. With `out` (a
    [max_rows, max_width] buffer): fills its top-left corner, returns the width. The tables are put in
    place in one masked assignment, not a row at a time (256 decode rows a step); given as int32 arrays
    (Sequence.block_table_array), nothing is converted from Python ints.
    """
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    longest = int(lengths.max())
    width = -(-longest // multiple) * multiple
    array = np.zeros((len(tables), width), dtype=np.int32) if out is None else out
    array[: len(tables), :longest][np.arange(longest) < lengths[:, None]] = np.concatenate(tables)
    # In `out`, entries past a row's length keep an earlier step's block ids: harmless, since the
    # kernels that read it (graphs run only graph-capable backends) stop at seq_len.
    return array if out is None else width


def token_slots(tables: np.ndarray, seq_index: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot (int64) of each token at `positions`, token i of sequence seq_index[i] whose block table is
    row seq_index[i] of `tables`: block_table[seq, pos // block_size] * block_size + pos % block_size, one gather."""
    return tables[seq_index, positions // block_size].astype(np.int64) * block_size + positions % block_size


def attention_metadata(
    backend: AttentionBackend,
    block_size: int,
    device: torch.device,
    num_new: list[int] | np.ndarray,
    positions: np.ndarray,
    tables: list[list[int]] | list[np.ndarray],
) -> AttentionMetadata:
    """The metadata of a step whose sequences compute `num_new` tokens each at `positions` (every new
    token's position, sequence after sequence), planned by `backend`."""
    num_new = np.asarray(num_new)  # converted once for the three uses below
    query_start = np.zeros(len(num_new) + 1, dtype=np.int32)
    np.cumsum(num_new, out=query_start[1:])
    seq_lens = positions[query_start[1:] - 1] + 1
    block_tables = block_table_array(tables, multiple=backend.pad_block_tables)
    slots = token_slots(block_tables, np.repeat(np.arange(len(num_new)), num_new), positions, block_size)
    meta = AttentionMetadata(
        slot_mapping=upload(slots, device),
        query_start=query_start.tolist(),
        seq_lens=seq_lens.tolist(),
        block_tables=upload(block_tables, device),
        seq_lens_tensor=upload(seq_lens.astype(np.int32), device),
        query_start_tensor=upload(query_start, device),
        max_query_len=int(num_new.max()),
        max_seq_len=int(seq_lens.max()),
        fresh=bool((seq_lens == np.diff(query_start)).all()),
    )
    backend.plan(meta)
    return meta
