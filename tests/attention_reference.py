"""Random paged batches and the plain float32 attention reference, shared by the kernel tests."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(ctx_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0, spare_blocks=3, device=DEVICE):
    """Random q, a random cache and shuffled block tables for sequences of ctx + q tokens."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    # Physical blocks in random order, so a sequence's blocks are neither contiguous nor sorted.
    physical = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(1, max(blocks_per_seq)), dtype=torch.int32)
    used = 0
    for s, nb in enumerate(blocks_per_seq):
        table[s, :nb] = physical[used : used + nb]
        used += nb
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(device, dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": table.to(device),
        "query_start": torch.tensor(starts, dtype=torch.int32, device=device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "scale": head_dim**-0.5,
    }


def reference(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, chunk=256):
    """Causal attention per sequence in float32, keys gathered slot by slot through the table."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for s, n in enumerate(lens):
        begin, end = starts[s], starts[s + 1]
        pos = torch.arange(n, device=q.device)
        slots = block_tables[s, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.reshape(-1, kv_heads, head_dim)[slots].float().repeat_interleave(group, dim=1)
        v = v_cache.reshape(-1, kv_heads, head_dim)[slots].float().repeat_interleave(group, dim=1)
        # Query chunks bound the score matrix at long contexts.
        for c in range(begin, end, chunk):
            qs = q[c : min(c + chunk, end)].float()
            q_pos = n - (end - begin) + (c - begin) + torch.arange(qs.shape[0], device=q.device)
            scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
            scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            out[c : c + qs.shape[0]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def poisoned_like(q):
    return torch.full_like(q, float("nan"))


def assert_close(out, ref, dtype):
    assert not out.isnan().any(), "unwritten or NaN output"
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-4 if dtype == torch.float32 else 1e-2), err


def verify_case(batch, q_lens, num_splits, k_cache=None, v_cache=None, ref_caches=None, **kwargs):
    """paged_decode over a make_batch case of Q query rows a sequence, laid out as a verify step's (the first
    q_lens[s] of sequence s's rows real, the rest padding) -> (its real rows, the reference's, the whole
    output). k_cache / v_cache replace the batch's (an fp8 cache, with k_scale / v_scale in kwargs), and the
    reference reads ref_caches instead (the dequantized ones)."""
    from engine.kernels.decode import paged_decode

    device = batch["q"].device
    queries = batch["q"].shape[0] // len(q_lens)
    context = batch["seq_lens"] - queries
    seq_lens = (context + torch.tensor(q_lens, device=device)).to(torch.int32)
    real = torch.cat([torch.arange(s * queries, s * queries + n) for s, n in enumerate(q_lens)]).to(device)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    k_cache = batch["k_cache"] if k_cache is None else k_cache
    v_cache = batch["v_cache"] if v_cache is None else v_cache
    out = paged_decode(
        batch["q"],
        k_cache,
        v_cache,
        batch["block_tables"],
        seq_lens,
        batch["scale"],
        out=poisoned_like(batch["q"]),
        num_splits=num_splits,
        queries=queries,
        query_lens=torch.tensor(q_lens, dtype=torch.int32, device=device),
        **kwargs,
    )
    ref_k, ref_v = ref_caches or (k_cache, v_cache)
    ref = reference(batch["q"][real], ref_k, ref_v, batch["block_tables"], starts, seq_lens, batch["scale"])
    return out[real], ref, out
