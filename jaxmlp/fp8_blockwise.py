"""The blockwise FP8 recipe (DeepSeek-V3's block scaling) and its semantics as an emulation in JAX.

`jaxmlp.grouped_mlp(..., fp8="blockwise")` quantizes every operand of the six products in blocks, each
block with its own scale from its own absolute maximum (current scaling, stateless):

    scale = 2^ceil(log2(amax / 448))   (1 where amax is 0), amax / 448 in float32
    q     = e4m3(v / scale)            round to nearest even; v / scale is exact, and |v / scale| <= 448

Power-of-two scales, as TransformerEngine's blockwise recipe on Hopper: scaling and dequantizing are exact,
so a result depends on no rounding of a scale or its inverse, and a block loses at most one of e4m3's
binades at its bottom (values under 2^-6 of its amax fall into e4m3's subnormals).

The blocks follow each product's reduction dimension:
  - activations and gradients as the left operand of the forward and data-gradient products (x, a, dy, dh):
    1 x 128 along their row (128 consecutive columns of one row; the last block of a row may be shorter);
  - the weights w1, w2: 128 x 128 blocks of each expert's [k, n] matrix; the same quantized weights serve the
    forward and the data gradients (a block's transpose is a block of the transpose);
  - the operands of the weight gradients (x, a, dy, dh again, reduced over the tokens): 128 x 1, 128
    consecutive rows of one column within one group, counted from the group's first row (a group of 300
    rows has blocks of 128, 128 and 44 rows): no block spans two experts, whatever the group sizes.

Where each quantization happens (rounding to x's dtype as in the tensorwise recipe, jaxmlp.fp8):

  forward   h  = round(qr(x) @ qb(w1)),   a = act(h) * scales (float32),   y = round(qr(a) @ qb(w2))
  backward  da = round(qr(dy) @ qb(w2)^T),  dh = da * scales * act'(h) (float32)
            dx = round(qr(dh) @ qb(w1)^T),  dw1 = round(qc(x)^T @ qc(dh)),  dw2 = round(qc(a)^T @ qc(dy))

qr: 1 x 128 blocks, qc: 128 x 1 blocks in the groups, qb: 128 x 128 blocks. Between the directions the
emulation keeps h, qc(x) with its scales and the quantized weights with theirs. All data is e4m3: small
blocks leave no range to protect with e5m2. The products here are float32 sums of exactly dequantized
operands (the emulation of a GEMM that applies the block scales with float32 accumulation).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _checks
from .activations import Activation
from .fp8 import E4M3_MAX, Gemm, to_e4m3

BLOCK = 128


def exponent(amax: jax.Array) -> jax.Array:
  """int32 e with 2^e the block scale of absolute maximum amax: the least power of two >= amax / 448."""
  # amax / 448 = mantissa 2^e with mantissa in [0.5, 1): 2^e, or 2^(e - 1) where amax / 448 is that power.
  mantissa, e = jnp.frexp(amax.astype(jnp.float32) / jnp.float32(E4M3_MAX))
  e = jnp.where(mantissa == 0.5, e - 1, e)
  return jnp.where(amax > 0, e, 0).astype(jnp.int32)


def _quantize(v: jax.Array, e: jax.Array) -> jax.Array:
  """v / 2^e rounded to e4m3 (float8_e4m3fn), saturating at +-448 and keeping NaN."""
  return to_e4m3(jnp.ldexp(v.astype(jnp.float32), -e))


def _dequantize(q: jax.Array, e: jax.Array) -> jax.Array:
  return jnp.ldexp(q.astype(jnp.float32), e)


def _pad_to_blocks(v: jax.Array, axis: int) -> jax.Array:
  pad = [(0, 0)] * v.ndim
  pad[axis] = (0, -v.shape[axis] % BLOCK)
  return jnp.pad(v.astype(jnp.float32), pad)


def quantize_rows(v: jax.Array) -> tuple[jax.Array, jax.Array]:
  """1 x 128 blocks along the last axis of v [R, C]: (q [R, C] e4m3, exponents [R, ceil(C / 128)])."""
  R, C = v.shape
  blocks = _pad_to_blocks(v, 1).reshape(R, -1, BLOCK)
  e = exponent(jnp.max(jnp.abs(blocks), axis=2))
  return _quantize(blocks, e[:, :, None]).reshape(R, -1)[:, :C], e


def dequantize_rows(q: jax.Array, e: jax.Array) -> jax.Array:
  return _dequantize(q, jnp.repeat(e, BLOCK, axis=1)[:, :q.shape[1]])


def quantize_weights(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """128 x 128 blocks of each w[g] [K, N]: (q [E, K, N] e4m3, exponents [E, ceil(K / 128), ceil(N / 128)])."""
  E, K, N = w.shape
  blocks = _pad_to_blocks(_pad_to_blocks(w, 1), 2).reshape(E, -1, BLOCK, (N + BLOCK - 1) // BLOCK, BLOCK)
  e = exponent(jnp.max(jnp.abs(blocks), axis=(2, 4)))
  return _quantize(blocks, e[:, :, None, :, None]).reshape(E, -1, blocks.shape[3] * BLOCK)[:, :K, :N], e


def dequantize_weights(q: jax.Array, e: jax.Array) -> jax.Array:
  K, N = q.shape[1:]
  return _dequantize(q, jnp.repeat(jnp.repeat(e, BLOCK, axis=1), BLOCK, axis=2)[:, :K, :N])


def token_blocks(sizes: jax.Array, m: int) -> tuple[jax.Array, int]:
  """(the 128 x 1 block of each of m rows, the number of blocks): block b of group g holds its rows
  128 b .. 128 b + 127, counted from the group's first row. Rows past the groups take block 0 (they are
  zero wherever this is used). At most m // 128 + E blocks: sum(ceil(s / 128)) <= sum(s // 128) + E."""
  sizes = _checks.clamp_group_sizes(sizes, m)
  E = sizes.shape[0]
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  first_block = jnp.cumsum((sizes + BLOCK - 1) // BLOCK) - (sizes + BLOCK - 1) // BLOCK
  row = jnp.arange(m, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), E - 1)
  block = first_block[group] + (row - starts[group]) // BLOCK
  return jnp.where(row < ends[-1], block, 0), m // BLOCK + E


def quantize_columns(v: jax.Array, blocks: tuple[jax.Array, int]) -> tuple[jax.Array, jax.Array]:
  """128 x 1 blocks of v [M, C] in the groups (token_blocks): (q [M, C] e4m3, exponents [blocks, C])."""
  block, n = blocks
  e = exponent(jax.ops.segment_max(jnp.abs(v.astype(jnp.float32)), block, num_segments=n))
  return _quantize(v, e[block]), e


def dequantize_columns(q: jax.Array, e: jax.Array, blocks: tuple[jax.Array, int]) -> jax.Array:
  return _dequantize(q, e[blocks[0]])


def emulated_forward(gemm: Gemm, x, w1, w2, sizes, scales, valid, act: Activation):
  """(y, residuals) of the blockwise forward; `valid` marks the rows in groups. The residuals: h, x in
  128 x 1 blocks (the weight gradient's operand) and the quantized weights, each with its exponents."""
  dtype, rows = x.dtype, valid[:, None]
  x = jnp.where(rows, x, 0)
  w1q, ew1 = quantize_weights(w1)
  w2q, ew2 = quantize_weights(w2)
  h = gemm("nn", dequantize_rows(*quantize_rows(x)), dequantize_weights(w1q, ew1), sizes)
  h = jnp.where(rows, h, 0).astype(dtype)
  a = act(h.astype(jnp.float32))
  if scales is not None:
    a = a * scales.astype(jnp.float32)[:, None]
  a = jnp.where(rows, a, 0)
  y = gemm("nn", dequantize_rows(*quantize_rows(a)), dequantize_weights(w2q, ew2), sizes)
  xq, ex = quantize_columns(x, token_blocks(sizes, x.shape[0]))
  return jnp.where(rows, y, 0).astype(dtype), (h, xq, ex, w1q, ew1, w2q, ew2)


def emulated_backward(gemm: Gemm, residuals, sizes, scales, valid, act: Activation, dy):
  """(dx, dw1, dw2, dscales or None) of the blockwise backward, from the forward's residuals."""
  h, xq, ex, w1q, ew1, w2q, ew2 = residuals
  dtype, rows = h.dtype, valid[:, None]
  blocks = token_blocks(sizes, h.shape[0])
  dy = jnp.where(rows, dy.astype(jnp.float32), 0)
  da = gemm("nt", dequantize_rows(*quantize_rows(dy)), dequantize_weights(w2q, ew2), sizes).astype(dtype)
  da = jnp.where(rows, da.astype(jnp.float32), 0)
  value, vjp = jax.vjp(act, h.astype(jnp.float32))
  s = scales.astype(jnp.float32)[:, None] if scales is not None else 1.0
  a = jnp.where(rows, value * s, 0)
  dh = jnp.where(rows, vjp(da * s)[0], 0)
  dx = gemm("nt", dequantize_rows(*quantize_rows(dh)), dequantize_weights(w1q, ew1), sizes)
  column = lambda v: dequantize_columns(*quantize_columns(v, blocks), blocks)
  dw2 = gemm("tn", column(a), column(dy), sizes)
  dw1 = gemm("tn", dequantize_columns(xq, ex, blocks), column(dh), sizes)
  dscales = None if scales is None else jnp.sum(da * value, axis=1).astype(dtype)
  return jnp.where(rows, dx, 0).astype(dtype), dw1.astype(dtype), dw2.astype(dtype), dscales
