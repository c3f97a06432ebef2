"""Programmatic dependent launch (engine/kernels/pdl.py): where it is on, and that a CUDA graph of PDL launches,
each kernel reading what the one before it wrote, computes what the same launches do one at a time."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import pdl
from engine.quant import pack_int32, quantize_rtn

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_pdl_is_off_on_the_cpu():
    """The interpreter's tensors are on the CPU: its kernels never take the griddepcontrol instructions."""
    cpu = torch.device("cpu")
    assert not pdl.enabled(cpu)
    with pdl.chained():
        assert pdl.launch(cpu, 1) == {"PDL": 0, "launch_pdl": False}


@cuda
def test_pdl_is_on_from_hopper_for_few_rows_within_chained_only():
    dev = torch.device("cuda")
    on = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.enabled(dev) == on
    off = {"PDL": 0, "launch_pdl": False}
    assert pdl.launch(dev, 1) == off  # eager steps, prompt graphs
    with pdl.chained():
        assert pdl.launch(dev, pdl.RELEASE_MAX_ROWS) == ({"PDL": 1, "launch_pdl": True} if on else off)
        assert pdl.launch(dev, pdl.RELEASE_MAX_ROWS + 1) == off
        with pdl.chained():
            pass
        assert pdl.launch(dev, 1)["launch_pdl"] == on  # a nested scope's exit leaves the outer one on
    assert pdl.launch(dev, 1) == off


@cuda
def test_the_decode_graphs_launch_their_kernels_with_pdl_at_few_rows(tiny_model_dir):
    """On Hopper the decode graphs' warm-up compiled the RMSNorm kernel with the launch attribute (its batch
    1, 2 and 4 graphs) and without it (the larger ones): Triton keeps launch_pdl in a variant's metadata."""
    from engine import LLM
    from engine.kernels.norm import _rms_norm_kernel

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0 or later")
    llm = LLM(str(tiny_model_dir("llama")), dtype="bfloat16", device="cuda", attention_backend="triton",
              num_gpu_blocks_override=256, max_num_seqs=16)  # fmt: skip
    assert llm.engine.runner.graphs is not None
    variants = [k for cache in _rms_norm_kernel.device_caches.values() for k in cache[0].values()]
    assert {bool(k.metadata.launch_pdl) for k in variants} == {True, False}


def _layer_chain(x, residual, weights: list, norm_w: torch.Tensor, sync: bool = False) -> torch.Tensor:
    """A decode layer's kernels in a row, each reading the output of the one before: RMSNorm with the residual
    added in place, a split-K 4-bit matmul (the GEMV at one row, the decode tl.dot kernel at more: partials,
    counters and the last program's reduction), SwiGLU, another split-K matmul; repeated over `weights`.
    `sync`: a device synchronization after every launch, so that no two kernels overlap."""
    from engine.kernels.activation import silu_and_mul
    from engine.kernels.norm import rms_norm
    from engine.kernels.quant_gemm import weight_only_matmul

    def done(out):
        if sync:
            torch.cuda.synchronize()
        return out

    for up, down in weights:
        h, residual = done(rms_norm(x, norm_w, 1e-5, residual=residual))
        gate_up = done(weight_only_matmul(h, *up))
        x = done(weight_only_matmul(done(silu_and_mul(gate_up)), *down))
    return done(rms_norm(x, norm_w, 1e-5, residual=residual))[0]


@cuda
@pytest.mark.parametrize("rows", [1, pdl.RELEASE_MAX_ROWS, 16])
def test_a_graph_of_pdl_launches_equals_the_launches_one_at_a_time(rows):
    """Bit for bit: a kernel that read its input before the kernel before it had written all of it would
    differ. The reference synchronizes after every launch."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(rows)
    hidden, inter, layers = 1024, 2048, 8

    def packed(k: int, n: int) -> tuple:
        w = quantize_rtn(torch.randn(n, k, generator=g) / k**0.5, 4, 128)
        counters = torch.zeros(n // 16, dtype=torch.int32, device=dev)
        parts = (pack_int32(w.q, 4, dim=0), w.scales.half(), w.zeros.half())
        return (*(t.to(dev) for t in parts), 4, 128, None, counters)

    weights = [(packed(hidden, 2 * inter), packed(inter, hidden)) for _ in range(layers)]
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).half().to(dev)
    x0 = torch.randn(rows, hidden, generator=g).half().to(dev)
    r0 = torch.randn(rows, hidden, generator=g).half().to(dev)
    ref = _layer_chain(x0.clone(), r0.clone(), weights, norm_w, sync=True)

    x, r = x0.clone(), r0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with pdl.chained():  # as the decode graphs capture: PDL at up to RELEASE_MAX_ROWS rows
        with torch.cuda.stream(stream):
            _layer_chain(x.clone(), r.clone(), weights, norm_w)  # compiled before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _layer_chain(x, r, weights, norm_w)
    for _ in range(3):
        x.copy_(x0)
        r.copy_(r0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
