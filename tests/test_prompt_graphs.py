"""The prompt-step graphs' layout (engine/runner/cuda_graphs.py: PrefillGraphs), on the CPU: a mixed step staged
into the graphs' buffers as run() stages them, its forward run over the padded size with the fixed-grid prompt
attention (the tile map), gives the eager step's logits. tests/test_cuda.py replays the graphs themselves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention import Attention
from engine.attention.torch_ref import TorchBackend
from engine.llm import LLM
from engine.runner.cuda_graphs import prompt_metadata, stage_prompt_step
from engine.runner.step_inputs import attention_metadata

pytest.importorskip("triton")


@torch.inference_mode()
def eager_logits(runner, token_ids, positions, tables, num_new):
    """Every token's logits from the eager step (what the runner runs without graphs)."""
    meta = attention_metadata(runner.backend, runner.block_size, runner.device, num_new, positions, tables)
    return runner.model.compute_logits(runner.model(torch.from_numpy(token_ids), torch.from_numpy(positions), meta))


@torch.inference_mode()
def graph_layout_logits(runner, size, max_seqs, token_ids, positions, tables, num_new, select):
    """The forward a prompt-step graph of `size` tokens captures, run eagerly on inputs staged as run() stages them."""
    backend = runner.backend
    per_tile = backend.prefill_queries_per_tile(runner.model.attention_layers()[0])
    capacity = backend.prefill_tile_capacity(size, max_seqs, per_tile)
    host = np.full((3, size), 99, dtype=np.int64)  # stale values the staging must overwrite
    query_start = np.full(max_seqs + 1, 7, dtype=np.int32)
    seq_lens = np.full(max_seqs, 7, dtype=np.int32)
    tables_host = np.full((max_seqs, 64), 3, dtype=np.int32)
    tile_map = np.full((capacity, 2), 5, dtype=np.int32)
    bs = runner.block_size
    stage_prompt_step(host, query_start, seq_lens, tables_host, size, bs, token_ids, positions, num_new, tables)
    backend.prefill_tile_map(num_new, per_tile, tile_map)
    n = len(token_ids)
    assert (host[2, n:] == -1).all() and (host[1, n:] == 0).all(), "padding stores nothing, at position 0"
    buffers = (host[2], tables_host, seq_lens, query_start, tile_map)
    meta = prompt_metadata(size, *map(torch.from_numpy, buffers), 256)
    backend.plan(meta)
    hidden = runner.model(torch.from_numpy(host[0]), torch.from_numpy(host[1]), meta)
    return runner.model.compute_logits(hidden[torch.from_numpy(select)])


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="runs the kernels in Triton's interpreter, off on a GPU (tests/test_cuda.py)"
)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompt_graph_layout_gives_the_eager_steps_logits(arch, tiny_model_dir):
    """A step mixing a fresh prompt, a chunk after cached context, two decodes and a one-token chunk, padded
    from 60 to 96 tokens in a graph for up to 8 sequences: every token's logits equal the eager step's."""
    llm = LLM(
        str(tiny_model_dir(arch)), dtype="float32", device="cpu", attention_backend="triton", cpu_kv_cache_bytes=1 << 24
    )
    runner = llm.engine.runner
    gen = np.random.default_rng(9)
    contexts, num_new = [0, 37, 70, 5, 16], np.array([30, 20, 1, 1, 8])
    tables = [np.arange(10 * s + 9, 10 * s, -1, dtype=np.int32) for s in range(len(contexts))]  # descending
    cached = [i for i, c in enumerate(contexts) if c]
    prompt_pos = np.concatenate([np.arange(contexts[i]) for i in cached])
    ids = gen.integers(0, 500, size=len(prompt_pos))
    eager_logits(runner, ids, prompt_pos, [tables[i] for i in cached], [contexts[i] for i in cached])
    positions = np.concatenate([np.arange(c, c + m) for c, m in zip(contexts, num_new)])
    token_ids = gen.integers(0, 500, size=len(positions))
    select = np.arange(len(positions))
    got = graph_layout_logits(runner, 96, 8, token_ids, positions, tables, num_new, select)
    want = eager_logits(runner, token_ids, positions, tables, num_new)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_staged_prompt_step_equals_the_eager_metadata():
    """Random steps (1-8 sequences, contexts 0-90, 1-40 new tokens, blocks in any order), staged into buffers holding
    an earlier step's values: slots, query starts and lengths are the eager step's (attention_metadata), padding
    stores nothing at position 0, and each sequence's row of the tables begins with its blocks."""
    gen = np.random.default_rng(3)
    host = np.full((3, 512), 77, dtype=np.int64)
    query_start, seq_lens = np.full(9, 55, dtype=np.int32), np.full(8, 55, dtype=np.int32)
    tables_host = np.full((8, 16), 44, dtype=np.int32)
    for _ in range(50):
        num_seqs = int(gen.integers(1, 9))
        contexts, num_new = gen.integers(0, 91, num_seqs), gen.integers(1, 41, num_seqs)
        tables = [gen.permutation(200)[: -(-(c + m) // 16)].astype(np.int32) for c, m in zip(contexts, num_new)]
        positions = np.concatenate([np.arange(c, c + m) for c, m in zip(contexts, num_new)])
        size = -(-len(positions) // 16) * 16 + int(gen.integers(0, 2)) * 16
        tokens = gen.integers(0, 1000, len(positions))
        width = stage_prompt_step(
            host, query_start, seq_lens, tables_host, size, 16, tokens, positions, num_new, tables
        )
        meta = attention_metadata(TorchBackend(), 16, torch.device("cpu"), num_new, positions, tables)
        n = len(tokens)
        assert (host[0, :n] == tokens).all() and (host[1, :n] == positions).all()
        assert (host[2, :n] == meta.slot_mapping.numpy()).all()
        assert (host[:2, n:size] == 0).all() and (host[2, n:size] == -1).all()
        assert (query_start[: num_seqs + 1] == meta.query_start_tensor.numpy()).all()
        assert (seq_lens[:num_seqs] == meta.seq_lens_tensor.numpy()).all()
        longest = max(map(len, tables))
        assert width == -(-longest // 16) * 16
        for row, table in zip(tables_host, tables):  # past a row's blocks: an earlier step's ids, never read
            assert (row[: len(table)] == table).all()


def test_prompt_graph_backends():
    """Which backends the prompt-step graphs capture: flash_attn's varlen kernel sizes its grid from the step's
    lengths on the host, so it runs prompt steps eagerly; with flash-attn-4 for long prompts, a graph's launch of
    any captured size (even past fa4_prefill_min_tokens) stays on Triton's tile map (checked against the reference
    without flash-attn-4 installed: taking fa4's path would fail)."""
    from engine.attention.flash_attn import FlashAttnBackend, TritonFa4Backend
    from engine.attention.triton import TritonBackend
    from tests.attention_reference import make_batch, reference

    assert TritonBackend.supports_prompt_graphs and not FlashAttnBackend.supports_prompt_graphs
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = TritonFa4Backend(device, min_tokens=16)
    q_lens = [20, 1, 13]
    batch = make_batch([0, 9, 30], q_lens, 4, 2, 64, 16, torch.float32, device=device)
    layer = Attention(4, 2, 64, backend)
    layer.k_cache, layer.v_cache = batch["k_cache"], batch["v_cache"]
    per_tile = backend.prefill_queries_per_tile(layer)
    tile_map = np.empty((backend.prefill_tile_capacity(48, 4, per_tile), 2), dtype=np.int32)
    backend.prefill_tile_map(np.array(q_lens), per_tile, tile_map)
    tables, lens, starts = batch["block_tables"], batch["seq_lens"], batch["query_start"]
    no_slots = torch.zeros(0, dtype=torch.long, device=device)  # prefill() stores nothing
    # A graph of 48 tokens: its max_query_len (the captured size) is past min_tokens.
    meta = prompt_metadata(48, no_slots, tables, lens, starts, torch.from_numpy(tile_map).to(device), 256)
    out = backend.prefill(layer, batch["q"], None, None, meta)
    torch.testing.assert_close(out, reference(**batch), rtol=1e-4, atol=1e-4)
