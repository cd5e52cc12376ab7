"""The PyTorch FP8 comparison: the SwiGLU expert MLP of torch_mlp.py with every grouped product (FC1,
FC2, forward, dgrad and wgrad) an e4m3 torch._scaled_grouped_mm, row-wise dynamically scaled, in an
autograd function of its own; eager, or under torch.compile (--compile: inductor fuses the scaling,
padding and activation; eager runs them as separate torch ops, as a model without torchao's Triton
kernels would).

The recipe is torchao's FP8 "rowwise" grouped-GEMM training recipe (torchao/prototype/moe_training,
_Float8GroupedMM), applied to both FCs. Every scale is float32, 448 / amax rounded down to a power of
two, and every product runs with use_fast_accum=True, as torchao's do (Hopper's FP8 tensor-core
accumulation without the periodic promotion of partial sums to float32 registers):
  forward  x and the activation: one scale per row (amax over the contraction dimension); w1 and w2:
           one per expert and output column (amax over the contraction dimension)
  dgrad    the output gradient: one per row; the weights, quantized again from bf16: one per expert and
           column of the transposed weight (amax over the weight's other dimension)
  wgrad    the 2D x 2D form, groups along the token dimension: both operands one scale per expert and
           column (amax over that expert's rows)

Run by bench.py as torch_fp8 and torch_fp8_compile, one process per case; prints torch_mlp.py's JSON,
its check against the same float32 reference. CUDA only (sm90/sm100), bf16.

  python benchmarks/torch_fp8_mlp.py --E 8 --d 1024 --f 2048 --group-sizes 512,512,512,512,512,512,512,512
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import torch_mlp

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
AMAX_FLOOR = 1e-12  # a zero row (padding, an empty expert) still gets a finite scale
# torch._scaled_grouped_mm moves each group's pointer along the 2D x 2D product's contraction (token)
# dimension, and TMA wants 16-byte aligned addresses: every group but the last must hold a multiple of
# 16 fp8 rows (a device-side assert otherwise). So the layer pads each expert's rows to a multiple of
# 16 with zero rows, as torchao and Megatron do for FP8, and drops the padded rows' outputs.
ALIGN = 16


def fp8_mlp(x, w1, w2, offs):
  """torch_mlp.mlp's signature and result: x [M, d] bf16 in expert order, w1 [E, d, 2f], w2 [E, f, d],
  offs = cumsum(group sizes) int32 with offs[-1] == M; d and f multiples of 16."""
  E, d, f2 = w1.shape
  if d % ALIGN or f2 % (2 * ALIGN):
    raise ValueError(f"torch._scaled_grouped_mm needs d and f divisible by {ALIGN}, got d={d}, f={f2 // 2}")
  return _FP8MLP.apply(x, w1, w2, offs)


class _FP8MLP(torch.autograd.Function):

  @staticmethod
  def forward(ctx, x, w1, w2, offs):
    f = w2.shape[1]
    dest, pad_offs, block_group = _padded_layout(offs, x.shape[0], w1.shape[0])
    x_pad = _scatter_rows(x, dest, block_group.shape[0] * ALIGN)
    h = _product(*_rowwise(x_pad), *_weight(w1), pad_offs)
    a = F.silu(h[:, :f]) * h[:, f:]  # bf16, as torch_mlp.mlp
    y_pad = _product(*_rowwise(a), *_weight(w2), pad_offs)
    ctx.save_for_backward(x_pad, h, a, w1, w2, dest, pad_offs, block_group)
    return y_pad.index_select(0, dest)

  @staticmethod
  def backward(ctx, dy):
    x_pad, h, a, w1, w2, dest, pad_offs, block_group = ctx.saved_tensors
    dy_pad = _scatter_rows(dy, dest, x_pad.shape[0])
    da = _product(*_rowwise(dy_pad), *_weight(w2.mT), pad_offs)
    dw2 = _weight_grad(a, dy_pad, block_group, pad_offs)
    dh = _swiglu_grad(h, da)
    dx_pad = _product(*_rowwise(dh), *_weight(w1.mT), pad_offs)
    dw1 = _weight_grad(x_pad, dh, block_group, pad_offs)
    return dx_pad.index_select(0, dest), dw1, dw2, None


def _padded_layout(offs, M: int, E: int):
  """Where each token's row goes once every group is padded to a multiple of ALIGN rows, computed on the
  device (no host sync), into a buffer of a size fixed by M and E alone: M + (ALIGN - 1) E rounded up.
  Returns dest [M] (int64 row in the padded buffer), the padded groups' ends (int32, for the products)
  and the group of each block of ALIGN padded rows ([rows / ALIGN] int64; a padded group is a whole
  number of blocks; E for the blocks past the last group, which no product reads)."""
  sizes = torch.diff(offs, prepend=offs.new_zeros(1))
  pad_sizes = (sizes + ALIGN - 1) // ALIGN * ALIGN
  pad_offs = torch.cumsum(pad_sizes, 0, dtype=torch.int32)
  token_group = torch.searchsorted(offs, torch.arange(M, device=offs.device, dtype=offs.dtype), right=True)
  shift = (pad_offs - pad_sizes) - (offs - sizes)  # each group's padded start minus its start
  dest = torch.arange(M, device=offs.device) + shift[token_group.clamp(max=E - 1)]
  rows = -(-(M + (ALIGN - 1) * E) // ALIGN) * ALIGN
  block_starts = torch.arange(0, rows, ALIGN, device=offs.device, dtype=torch.int32)
  return dest, pad_offs, torch.searchsorted(pad_offs, block_starts, right=True)


def _scatter_rows(t, dest, rows: int):
  """t's rows at `dest` of a zeroed [rows, n] buffer: padding rows are exact zeros, so they add nothing
  to any product or amax."""
  return t.new_zeros(rows, t.shape[1]).index_copy_(0, dest, t)


def _scale(amax):
  """E4M3_MAX / amax rounded down to a power of two: t * scale fits e4m3, and 1 / scale (exact), the
  dequantization factor, is what _scaled_grouped_mm multiplies back in."""
  return torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.float().clamp_min(AMAX_FLOOR))))


def _cast(t, scale):
  """t * scale (float32: scale is) saturated to e4m3; in place where it can, for eager's sake."""
  return (t * scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _rowwise(t):
  """A row-major left operand [rows, K] with one scale per row: (data, 1 / scales [rows])."""
  scale = _scale(t.abs().amax(-1, keepdim=True))
  return _cast(t, scale), scale.reciprocal().squeeze(-1)


def _weight(b):
  """The right operand b [E, K, N] (any strides) with one scale per expert and output column: (data as
  the transposed view of a contiguous [E, N, K], which _scaled_grouped_mm requires; 1 / scales [E, N])."""
  scale = _scale(b.abs().amax(1, keepdim=True))
  return _cast(b, scale).mT.contiguous().mT, scale.reciprocal().squeeze(1).contiguous()


def _product(a, scale_a, b, scale_b, pad_offs):
  return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=pad_offs, out_dtype=torch.bfloat16,
                                  use_fast_accum=True)


def _swiglu_grad(h, da):
  """d(silu(g) * u) for h = [g, u], in float32 (quantized from there: one rounding fewer)."""
  f = da.shape[1]
  g, u, da = h[:, :f].float(), h[:, f:].float(), da.float()
  sig = torch.sigmoid(g)
  return torch.cat([da * u * sig * (1 + g * (1 - sig)), da * g * sig], dim=1)


def _weight_grad(a, g, block_group, pad_offs):
  """dW[e] = a_e^T g_e over each expert's padded rows, [E, K, N] bf16, as the 2D x 2D product: the left
  operand a^T [K, rows] row-major, the right g [rows, N] column-major, each scaled per expert and column.
  (torchao computes g^T a and returns its transpose; a^T g gives the same product with dW contiguous.)"""
  E = pad_offs.shape[0]
  a_data, a_inv = _per_group_columns(a, block_group, E)
  g_data, g_inv = _per_group_columns(g, block_group, E)
  return _product(a_data.t().contiguous(), a_inv, g_data.t().contiguous().t(), g_inv, pad_offs)


def _per_group_columns(t, block_group, E: int):
  """t [rows, n] with one scale per expert and column, amax over the expert's rows: (data [rows, n],
  1 / scales [E * n], expert-major, as the 2D x 2D product takes them). Reduced per block of ALIGN rows
  first, a plain reduction, so that the scatter across groups sees 1/ALIGN of the rows. The blocks past
  the last group get a scale row of their own (index E), which is dropped."""
  rows, n = t.shape
  blocks = t.view(rows // ALIGN, ALIGN, n)
  amax = t.new_zeros(E + 1, n, dtype=torch.float32)
  scale = _scale(amax.index_reduce_(0, block_group, blocks.abs().amax(1).float(), "amax"))
  return _cast(blocks, scale[block_group, None, :]).view(rows, n), scale[:E].reciprocal().reshape(-1)


if __name__ == "__main__":
  torch_mlp.main(fp8_mlp, __doc__, cpu_skip="torch._scaled_grouped_mm runs on CUDA (sm90/sm100) only; "
                 "the CPU run is float32")
