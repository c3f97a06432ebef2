"""Linear layers: weights prepacked for oneDNN (bfloat16 on the CPU), and the quantized linears engine/quant makes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.ops import Ops
from engine.quant import IntWeight, concat_outputs, pack_int32


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN prepacking pays for bfloat16 on a CPU with native bf16 instructions (AVX512_BF16, AMX)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Module):
    """nn.Linear whose weight is reordered once into oneDNN's blocked layout.

    Decode steps multiply a few rows by every weight; with the weight already in the layout the
    kernel reads, a matmul does not reorder it per call (2x faster at batch 1 to 16 on AVX512_BF16).
    Rounding is unchanged: the products accumulate in float32 and round to bf16 once, as in F.linear.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        # The layout hint is the expected number of rows: 1 gives the fastest decode steps, and
        # larger batches and prefills run no slower than with the plain weight.
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, 1), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def prepack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of a loaded model by a PackedLinear; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced


# ----- quantized linears (engine/quant makes them at load; each forward runs one path, chosen there) -----


def weight_only_linear(
    shards: list[IntWeight], bias: torch.Tensor | None, dtype: torch.dtype, fragment_copies: bool = True
) -> nn.Module:
    """The layer for a weight-only quantized matrix (its fused shards in output order): the Triton kernel on
    CUDA (with the fragment-layout copies MID_TABLE names for its shape, or none without `fragment_copies`);
    on the CPU, where no kernel of pagoda's reads packed integers, the weight dequantized once to a plain
    nn.Linear."""
    if shards[0].q.device.type == "cuda":
        return WeightOnlyLinear(concat_outputs(shards), bias, dtype, layouts=None if fragment_copies else set())
    weight = torch.cat([s.dequantize() for s in shards], dim=1)  # [K, N]
    k, n = weight.shape
    linear = nn.Linear(k, n, bias=bias is not None, dtype=dtype, device=weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


class WeightOnlyLinear(nn.Module):
    """x @ W for a W4A16 / W8A16 weight kept packed: int32 words of 32 // bits rows each ([K * bits / 32, N],
    the input dimension packed, as GPTQ packs it), dequantized in registers by engine/kernels/quant_gemm.py.

    Act-order weights (a g_idx that is not k // group_size) are stored with their rows sorted by group,
    so groups are contiguous for the kernel, and the input's columns are taken in the same order (the
    decode kernels read them through the permutation; prompt-sized batches gather them first)."""

    def __init__(
        self,
        weight: IntWeight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        layouts: set[tuple[int, bool]] | None = None,
    ):
        """`layouts`: the fragment layouts (kwidth, trans) to keep a copy in; None: those MID_TABLE's tiles for
        this shape read (quant_gemm.fragment_layouts)."""
        from engine.kernels.quant_gemm import fragment_layouts, fragment_pack

        super().__init__()
        q, perm = weight.q, None
        if weight.g_idx is not None:
            perm = torch.argsort(weight.g_idx, stable=True)
            groups = torch.arange(q.shape[0], device=q.device) // weight.group_size
            if not torch.equal(weight.g_idx[perm].long(), groups):
                raise ValueError("act-order g_idx whose groups are not all group_size rows is not supported")
            q = q[perm]
        self.bits, self.group_size = weight.bits, weight.group_size
        self.in_features, self.out_features = q.shape
        self.register_buffer("qweight", pack_int32(q, weight.bits, dim=0))
        # The decode tl.dot kernel's fragment-layout tiles (MID_TABLE) read the weight repacked: a copy in each
        # layout the table names for this shape, beside the packed one the GEMV and the prompt kernel read.
        self.fragment_keys = sorted(fragment_layouts(self.bits, *q.shape) if layouts is None else layouts)
        for kwidth, trans in self.fragment_keys:
            copy = fragment_pack(self.qweight, kwidth, trans)
            self.register_buffer(_fragment_name(kwidth, trans), copy, persistent=False)
        self.register_buffer("scales", weight.scales.to(dtype).contiguous())
        self.register_buffer("zeros", weight.zeros.to(dtype).contiguous())  # small integers: exact in bf16
        self.register_buffer("perm", perm)
        # The split decode kernels' arrival counters, one per slice of 16 outputs (the narrowest tile):
        # zeroed here once, left zeroed by every launch.
        counters = torch.zeros(-(-self.out_features // 16), dtype=torch.int32, device=q.device)
        self.register_buffer("counters", counters, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from engine.kernels.quant_gemm import weight_only_matmul

        x2 = x.reshape(-1, self.in_features)
        out = weight_only_matmul(
            x2,
            self.qweight,
            self.scales,
            self.zeros,
            self.bits,
            self.group_size,
            counters=self.counters,
            perm=self.perm,
            fragments=self.fragments(),
        )
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def fragments(self) -> dict[tuple[int, bool], torch.Tensor]:
        """The weight's fragment-layout copies by (kwidth, trans), as weight_only_matmul takes them."""
        return {key: getattr(self, _fragment_name(*key)) for key in self.fragment_keys}


def _fragment_name(kwidth: int, trans: bool) -> str:
    return f"qweight_fragment{kwidth}{'_trans' if trans else ''}"


FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_per_row(x: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of [M, K] to fp8 E4M3 or int8: (values, float32 [M, 1] scales)."""
    qmax = FP8_MAX if qdtype == FP8 else 127.0
    # The divisor is a tensor on x's device: CUDA divides by a Python number as a multiply by its float32
    # reciprocal (an ulp off the quotient at times), and the scale must be the IEEE quotient that the CPU and
    # engine/kernels/w8a8.py compute, else values at a rounding tie quantize differently.
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / amax.new_full((), qmax)  # filled on the device: no host copy, no sync
    scaled = x.float() / scale
    q = scaled.clamp(-qmax, qmax).to(FP8) if qdtype == FP8 else scaled.round().clamp(-128, 127).to(torch.int8)
    return q, scale


def block_scaled_matmul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_k: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """The torch reference of engine/kernels/w8a8.py fused_scaled_matmul: x [M, K] quantized per row and per
    block of block_k inputs to the weight's type (scale amax / qmax; values times qmax / amax, clamped, rounded
    as quantize_per_row rounds), each block's 8-bit product with the weight [N, K] times its row scales added
    in float32, then times the channel scales [1, N]."""
    qmax = FP8_MAX if weight.dtype == FP8 else 127.0
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for k0 in range(0, x.shape[1], block_k):
        block = x[:, k0 : k0 + block_k].float()
        amax = block.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
        qmax_t = amax.new_full((), qmax)  # a tensor divisor: IEEE division on CUDA too (see quantize_per_row)
        scaled = (block * (qmax_t / amax)).clamp(-qmax, qmax)
        xq = scaled.to(FP8) if weight.dtype == FP8 else scaled.round().to(torch.int8)
        acc += (xq.float() @ weight[:, k0 : k0 + block_k].float().t()) * (amax / qmax_t)
    return (acc * weight_scale).to(out_dtype)


@dataclass
class QuantizedActivation:
    """A linear's input quantized per row by the Triton kernel that produced it (engine/kernels/norm.py,
    engine/kernels/activation.py), exactly as engine/kernels/w8a8.py quantize_rows would quantize it:
    contiguous [M, K] fp8 E4M3 or int8 values, float32 [M, 1] scales. Only a ScaledLinear takes one."""

    q: torch.Tensor
    scale: torch.Tensor


def fused_input_quant(ops: Ops, linear: nn.Module, rows: int) -> torch.dtype | None:
    """The 8-bit type in which the kernel of `ops` that produces `linear`'s input (`rows` of them) should hand
    it over, quantized per row; None where it hands over the plain activations: kernels other than pagoda's
    Triton ones (the CPU keeps the torch reference), a linear that is not W8A8 with dynamic input scales, or
    tiles that quantize inside the GEMM (ScaledLinear.input_quant)."""
    if ops.name != "triton" or not isinstance(linear, ScaledLinear):
        return None
    return linear.input_quant(rows)


class ScaledLinear(nn.Module):
    """W8A8: weight [N, K] in fp8 E4M3 or int8 with per-output-channel float32 scales; activations quantized
    per token at run time (or with one static scale a checkpoint gives). On CUDA up to INT8_TRITON_MAX_M /
    FP8_TRITON_MAX_M rows (engine/kernels/quant_tiles.py) take the Triton 8-bit GEMM (engine/kernels/w8a8.py)
    with the scales in its epilogue: fused (the activations quantized inside it per row and K step) where its
    tiles say so and the input scale is dynamic, else after quantize_rows (one Triton launch). More rows are
    quantized so and go through torch._int_mm / torch._scaled_mm. The CPU runs the torch reference, which
    rounds the same way as quantize_rows and multiplies in float32.

    The input may also come quantized already (a QuantizedActivation: the RMSNorm or SwiGLU kernel before the
    layer quantized it as quantize_rows would, see fused_input_quant): then only the product runs, the
    same one as after quantize_rows, so the output is bit for bit the same."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        input_scale: torch.Tensor | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().reshape(1, -1).contiguous())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(1, 1))
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        # The split 8-bit GEMM's arrival counters, one per slice of 16 outputs (the narrowest tile): zeroed
        # here once, left zeroed by every launch.
        counters = torch.zeros(-(-self.out_features // 16), dtype=torch.int32, device=weight.device)
        self.register_buffer("counters", counters, persistent=False)

    def _quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference of engine/kernels/w8a8.py quantize_rows."""
        if self.input_scale is None:
            return quantize_per_row(x, self.weight.dtype)
        qmax = FP8_MAX if self.weight.dtype == FP8 else 127.0
        scaled = (x.float() / self.input_scale).clamp(-qmax, qmax)
        q = scaled.to(FP8) if self.weight.dtype == FP8 else scaled.round().to(torch.int8)
        return q, self.input_scale.expand(x.shape[0], 1)

    def _reference_product(self, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        out = (xq.float() @ self.weight.float().t()) * xs * self.weight_scale
        return out.to(self.dtype)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return self._reference_product(*self._quantize_input(x))

    def _tiles(self, rows: int):
        """The Triton 8-bit GEMM's tiles (a W8A8Tiles) for `rows` rows."""
        from engine.kernels.quant_gemm import _num_sms
        from engine.kernels.w8a8 import w8a8_tiles

        kind = "fp8" if self.weight.dtype == FP8 else "int8"
        return w8a8_tiles(kind, rows, self.out_features, self.in_features, _num_sms(self.weight.device))

    def _triton_rows(self, rows: int) -> bool:
        """Whether `rows` rows take the Triton 8-bit GEMM: on CUDA, up to the kind's limit."""
        from engine.kernels import quant_tiles

        limit = quant_tiles.FP8_TRITON_MAX_M if self.weight.dtype == FP8 else quant_tiles.INT8_TRITON_MAX_M
        return self.weight.device.type == "cuda" and rows <= limit

    def input_quant(self, rows: int) -> torch.dtype | None:
        """The 8-bit type this layer takes `rows` inputs in when their producer quantizes them per row (a
        QuantizedActivation); None where it must see the plain activations: a static input scale, or tiles
        that quantize inside the GEMM (per K step, finer than per row)."""
        if self.input_scale is not None or (self._triton_rows(rows) and self._tiles(rows).fused):
            return None
        return self.weight.dtype

    def _product(self, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """Quantized rows times the weight, scaled: the Triton GEMM, torch's 8-bit GEMMs, or the CPU reference."""
        if self.weight.device.type != "cuda":
            return self._reference_product(xq, xs)
        if self._triton_rows(xq.shape[0]):
            from engine.kernels.w8a8 import scaled_matmul

            tiles = self._tiles(xq.shape[0])
            return scaled_matmul(xq, xs, self.weight, self.weight_scale, self.dtype, tiles, self.counters)
        if self.weight.dtype == FP8:
            # The weight's transpose is column-major, the layout _scaled_mm wants for its second operand.
            w = self.weight.t()
            return torch._scaled_mm(xq, w, scale_a=xs, scale_b=self.weight_scale, out_dtype=self.dtype)
        return (torch._int_mm(xq, self.weight.t()).float() * xs * self.weight_scale).to(self.dtype)

    def _triton(self, x: torch.Tensor) -> torch.Tensor:
        """The Triton 8-bit GEMM, fused or after quantize_rows as its tiles (and a static input scale) say."""
        from engine.kernels.w8a8 import fused_scaled_matmul, quantize_rows, scaled_matmul

        config = self._tiles(x.shape[0])
        if config.fused and self.input_scale is None:
            return fused_scaled_matmul(x, self.weight, self.weight_scale, self.dtype, config, self.counters)
        xq, xs = quantize_rows(x, self.weight.dtype, self.input_scale)
        return scaled_matmul(xq, xs, self.weight, self.weight_scale, self.dtype, config, self.counters)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Plain [M, K] activations: the CPU reference, the Triton GEMM, or quantize_rows and torch's GEMM."""
        if self.weight.device.type != "cuda":
            return self._reference(x)
        x = x.contiguous()
        if self._triton_rows(x.shape[0]):
            return self._triton(x)
        from engine.kernels.w8a8 import quantize_rows

        return self._product(*quantize_rows(x, self.weight.dtype, self.input_scale))

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            assert self.input_scale is None and x.q.dtype == self.weight.dtype, "quantized as input_quant says"
            out, lead = self._product(x.q, x.scale), x.q.shape[:-1]
        else:
            out, lead = self._matmul(x.reshape(-1, self.in_features)), x.shape[:-1]
        if self.bias is not None:
            out += self.bias
        return out.view(*lead, self.out_features)
