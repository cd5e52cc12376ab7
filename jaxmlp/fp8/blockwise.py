"""The blockwise FP8 recipe (DeepSeek-V3's block scaling): its definition, its quantizers in JAX, and the
recipe over the primitives each platform provides.

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

Where each quantization happens (rounding to x's dtype as in the tensorwise recipe):

  forward   h  = round(qr(x) @ qb(w1)),   a = act(h) * scales (float32),   y = round(qr(a) @ qb(w2))
  backward  da = round(qr(dy) @ qb(w2)^T),  dh = da * scales * act'(h) (float32)
            dx = round(qr(dh) @ qb(w1)^T),  dw1 = round(qc(x)^T @ qc(dh)),  dw2 = round(qc(a)^T @ qc(dy))

With biases, h = round(h + b1[g]) before the activation and y = round(y + round(scales * b2[g])) (after the
product's own rounding, where the tensorwise recipe rounds once); their gradients and dscales are those of
the tensorwise recipe (jaxmlp.fp8.tensorwise): float32 sums of the unquantized dh and dy.

qr: 1 x 128 blocks, qc: 128 x 1 blocks in the groups, qb: 128 x 128 blocks. Between the directions the
backward keeps h, qc(x) and qc(a) with their scales and the quantized weights with theirs. All data is
e4m3: small blocks leave no range to protect with e5m2.

With 16-bit weight gradients (Fp8Recipe.fp8_weight_gradients False; by default below 1024 rows per expert,
where the step measured faster with them) the two weight gradients are those of fp8=None from this
recipe's h and da:

            dw1 = round(x^T @ round(dh)),  dw2 = round(round(a)^T @ dy)    (16-bit operands, float32 sums)

and no operand is quantized in 128 x 1 blocks: the backward keeps h, x and round(a) (which the quantizer of
a writes beside its e4m3 rows), and the quantizer of dh writes round(dh) beside its rows.

The recipe runs over `Primitives`, its quantizers and products. On a GPU (jaxmlp.fp8.cuda) the quantizers
are CUDA kernels that compute this module's quantizers bit for bit (those of a and dh compute the activation
on the way from h, up to the last bit of act and its derivative) and each product is an FP8 tensor-core
product with cuBLASLt's block scaling; elsewhere the quantizers are this module's JAX code and the products
their emulation (`emulation`): float32 sums of exactly dequantized operands on any grouped GEMM. The two
agree up to the order of the float32 sums (and act's last bits).
"""
from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp

from .._groups import Groups
from ..activations import Activation
from .quantize import (E4M3_MAX, Gemm, Implementation, Scheme, bias_and_scale_grads, bias_rows, fp8_weight_gradients,
                       group_sums, padded_length, rounded_first, scaled_bias, to_e4m3)

BLOCK = 128


def exponent(amax: jax.Array) -> jax.Array:
  """int32 e with 2^e the block scale of absolute maximum amax: the least power of two >= amax / 448."""
  # amax / 448 = mantissa 2^e with mantissa in [0.5, 1): 2^e, or 2^(e - 1) where amax / 448 is that power.
  mantissa, e = jnp.frexp(amax.astype(jnp.float32) / jnp.float32(E4M3_MAX))
  e = jnp.where(mantissa == 0.5, e - 1, e)
  return jnp.where(amax > 0, e, 0).astype(jnp.int32)


def times_pow2(v: jax.Array, e: jax.Array) -> jax.Array:
  """float32 v times 2^e (e int32, one exponent per block, broadcast against v), rounded as jnp.ldexp(v, e)
  rounds it wherever the result is a normal float32 (and e4m3 rounds every smaller value to 0 alike): two
  multiplies by powers of two made from e's halves, each a normal float32 for |e| <= 252 (the recipe's
  exponents lie in [-158, 120]; jaxmlp.fp8.exchange's INFINITE, 256, overflows on purpose). An ldexp of
  every element costs XLA's code far more; the CUDA quantizers multiply likewise
  (ffi/cuda/fp8/weight_tile.cuh, Unscale). (XLA:CPU flushes float32 subnormals: there
  `exponent` reads 0 for a block whose amax / 448 is subnormal, under 2^-126, where the CUDA kernels give
  its exponent; such a block's values quantize to e4m3 zeros there.)"""
  half = e // 2
  pow2 = lambda n: jnp.ldexp(jnp.ones(n.shape, jnp.float32), n)
  return v * pow2(half) * pow2(e - half)


def _quantize(blocks: jax.Array, e: jax.Array) -> jax.Array:
  """blocks / 2^e rounded to e4m3 (float8_e4m3fn), saturating at +-448 and keeping NaN."""
  return to_e4m3(times_pow2(blocks, -e))


def _pad_to_blocks(v: jax.Array, axis: int) -> jax.Array:
  pad = [(0, 0)] * v.ndim
  pad[axis] = (0, -v.shape[axis] % BLOCK)
  return jnp.pad(v.astype(jnp.float32), pad)


def row_blocks(v: jax.Array) -> jax.Array:
  """v [R, C] as float32 1 x 128 blocks [R, ceil(C / 128), 128], zeros past C."""
  return _pad_to_blocks(v, 1).reshape(v.shape[0], -1, BLOCK)


def quantize_rows(v: jax.Array) -> tuple[jax.Array, jax.Array]:
  """1 x 128 blocks along the last axis of v [R, C]: (q [R, C] e4m3, exponents [R, ceil(C / 128)])."""
  blocks = row_blocks(v)
  e = exponent(jnp.max(jnp.abs(blocks), axis=2))
  return _quantize(blocks, e[:, :, None]).reshape(v.shape[0], -1)[:, :v.shape[1]], e


def dequantize_rows(q: jax.Array, e: jax.Array) -> jax.Array:
  return times_pow2(row_blocks(q), e[:, :, None]).reshape(q.shape[0], -1)[:, :q.shape[1]]


def _weight_blocks(w: jax.Array) -> jax.Array:
  """w [E, K, N] as float32 128 x 128 blocks [E, ceil(K / 128), 128, ceil(N / 128), 128], zeros past K, N."""
  E, K, N = w.shape
  return _pad_to_blocks(_pad_to_blocks(w, 1), 2).reshape(E, -1, BLOCK, (N + BLOCK - 1) // BLOCK, BLOCK)


def _from_weight_blocks(blocks: jax.Array, K: int, N: int) -> jax.Array:
  return blocks.reshape(blocks.shape[0], -1, blocks.shape[3] * BLOCK)[:, :K, :N]


def quantize_weights(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """128 x 128 blocks of each w[g] [K, N]: (q [E, K, N] e4m3, exponents [E, ceil(K / 128), ceil(N / 128)],
  q transposed [E, N, K]: the layout the forward's FP8 products read)."""
  blocks = _weight_blocks(w)
  e = exponent(jnp.max(jnp.abs(blocks), axis=(2, 4)))
  q = _from_weight_blocks(_quantize(blocks, e[:, :, None, :, None]), *w.shape[1:])
  return q, e, jnp.swapaxes(q, 1, 2)


def dequantize_weights(q: jax.Array, e: jax.Array) -> jax.Array:
  return _from_weight_blocks(times_pow2(_weight_blocks(q), e[:, :, None, :, None]), *q.shape[1:])


def padded_sizes(groups: Groups) -> jax.Array:
  """Each group's rows in the padded layout: its (clamped) size rounded up to 128."""
  return (groups.sizes + BLOCK - 1) // BLOCK * BLOCK


def column_blocks(groups: Groups) -> tuple[jax.Array, jax.Array]:
  """The 128 x 1 blocks of the rows in groups, in the weight gradients' layout (quantize_columns): (first
  row, rows) of each of the padded_length(m, E, 128) / 128 blocks, int32. Each group's rows start at a
  multiple of 128, so block b of a group of 300 rows holds its rows 128 b .. 128 b + 127 (the last one 44
  rows) and no block spans two groups; the blocks past the groups hold no rows."""
  sizes = groups.sizes
  spans = padded_sizes(groups)
  span_ends = jnp.cumsum(spans)
  start = jnp.arange(padded_length(groups.num_rows, groups.num_groups, BLOCK) // BLOCK, dtype=jnp.int32) * BLOCK
  # compare_all: one fused comparison, where the default binary search is a chain of small kernels.
  group = jnp.minimum(jnp.searchsorted(span_ends, start, side="right", method="compare_all"), sizes.shape[0] - 1)
  within = start - (span_ends - spans)[group]
  first = jnp.cumsum(sizes)[group] - sizes[group] + within
  return first.astype(jnp.int32), jnp.clip(sizes[group] - within, 0, BLOCK).astype(jnp.int32)


def quantize_columns(v: jax.Array, groups: Groups) -> tuple[jax.Array, jax.Array]:
  """128 x 1 blocks of v [M, C] within the groups (column_blocks), laid out for the weight gradients:
  (q [C, L] e4m3, exponents [L / 128, C]) with L = padded_length(M, E, 128), zeros past each block's rows.
  Transposed: the products reduce over the tokens, and FP8 tensor cores read both operands contiguous
  along the reduction."""
  M, C = v.shape
  first, rows = column_blocks(groups)
  within = jnp.arange(BLOCK, dtype=jnp.int32)
  source = jnp.where(within < rows[:, None], first[:, None] + within, M).reshape(-1)
  padded = jnp.take(v, source, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
  blocks = padded.reshape(-1, BLOCK, C)
  e = exponent(jnp.max(jnp.abs(blocks), axis=1))
  return _quantize(blocks, e[:, None, :]).reshape(-1, C).T, e


def quantize_rows_and_columns(v: jax.Array, groups: Groups):
  """(quantize_rows(v), quantize_columns(v, groups)) of v with its rows past the groups taken as zeros: a
  tensor that is both a row and a column operand. The rows past the groups, and the column blocks past
  the groups' (no rows), are no product's operand: a kernel need not read nor write them."""
  v = jnp.where(groups.valid[:, None], v, 0)
  return quantize_rows(v), quantize_columns(v, groups)


def read_by_products(quantized, groups: Groups):
  """A rows-and-columns quantization's ((q, e), (qt, ec)) as [q, e, qt, ec] with what no product reads
  set to zeros: the rows past the groups and the column blocks past the groups' (a kernel may leave them
  unwritten, Primitives)."""
  (q, e), (qt, ec) = quantized
  in_rows = (jnp.arange(q.shape[0]) < jnp.sum(groups.sizes))[:, None]
  in_blocks = column_blocks(groups)[1] > 0
  zero = lambda a: jnp.zeros((), a.dtype)
  return [jnp.where(in_rows, q, zero(q)), jnp.where(in_rows, e, 0),
          jnp.where(jnp.repeat(in_blocks, BLOCK)[None, :], qt, zero(qt)), jnp.where(in_blocks[:, None], ec, 0)]


def quantize_rows_in_groups(v: jax.Array, groups: Groups) -> tuple[jax.Array, jax.Array]:
  """quantize_rows(v) with v's rows past the groups taken as zeros (no product reads them: a kernel need
  not write them): a row operand that is no column operand (16-bit weight gradients)."""
  return quantize_rows(jnp.where(groups.valid[:, None], v, 0))


def _activation(h, scales, act: Activation):
  """The forward's a = act(h) * scales in float32."""
  a = act(h.astype(jnp.float32))
  return a if scales is None else a * scales.astype(jnp.float32)[:, None]


def _activation_grad(h, da, scales, act: Activation):
  """The backward's dh = (da * scales) * act'(h) (the vjp of act) in float32."""
  s = scales.astype(jnp.float32)[:, None] if scales is not None else 1.0
  return jax.vjp(act, h.astype(jnp.float32))[1](da.astype(jnp.float32) * s)[0]


def activation_rows_and_columns(h, scales, groups: Groups, act: Activation):
  """quantize_rows_and_columns of the forward's a = act(h) * scales in float32 (the rows past the groups
  taken as zeros, as quantize_rows_and_columns takes them)."""
  return quantize_rows_and_columns(_activation(h, scales, act), groups)


def activation_grad_rows_and_columns(h, da, scales, groups: Groups, act: Activation):
  """quantize_rows_and_columns of the backward's dh = (da * scales) * act'(h) (the vjp of act) in float32
  (the rows past the groups taken as zeros)."""
  return quantize_rows_and_columns(_activation_grad(h, da, scales, act), groups)


def activation_rows(h, scales, groups: Groups, act: Activation):
  """(quantize_rows_in_groups of a = act(h) * scales in float32, a rounded to h's dtype): the forward's a
  with 16-bit weight gradients, whose dw2 reads round(a)."""
  a = _activation(h, scales, act)
  return quantize_rows_in_groups(a, groups), a.astype(h.dtype)


def activation_grad_rows(h, da, scales, groups: Groups, act: Activation):
  """(quantize_rows_in_groups of dh = (da * scales) * act'(h) in float32, dh rounded to h's dtype): the
  backward's dh with 16-bit weight gradients, whose dw1 (and db1) read round(dh)."""
  dh = _activation_grad(h, da, scales, act)
  return quantize_rows_in_groups(dh, groups), dh.astype(h.dtype)


def dequantize_columns(q: jax.Array, e: jax.Array) -> jax.Array:
  """[L, C] float32 of quantize_columns's (q, exponents): the padded rows, no longer transposed."""
  return times_pow2(q.T.astype(jnp.float32).reshape(-1, BLOCK, q.shape[0]), e[:, None, :]).reshape(-1, q.shape[0])


class Primitives(tp.NamedTuple):
  """The recipe's quantizers and products on one platform. The quantizers compute the functions of this
  module of the same names (the emulation: those functions; a kernel reads the tensor of
  quantize_rows_and_columns once), bit for bit, except the activations' up to the last bit of act and its
  derivative (a kernel computes them on the way from h, whose float32 result goes through no memory), and
  except what no product reads: the rows past the groups (of the 16-bit a and dh too) and the column
  blocks past the groups' hold any values (a kernel leaves them unwritten: over P devices the
  expert-parallel layer's buffers hold up to P times the groups' rows). The products take quantized
  operands (columns16: 16-bit ones), accumulate in float32 and round once to `dtype`:
    rows(lhs, w, groups, transposed, dtype, zero_padding): per group of rows, lhs [M, k] (quantize_rows) @
      w[g] for w [E, k, n], or with `transposed` @ w[g]^T for w [E, n, k] (quantize_weights; the
      transposed product reads only q and exponents): [M, n]; the rows past the groups zeros with
      zero_padding (as jax.lax.ragged_dot; no pass of masking after each product), else any values;
    columns(lhs, rhs, groups, dtype): per group, lhs^T @ rhs over its rows (quantize_columns of [m, K] and
      [m, N]): [E, K, N];
    columns16(lhs, rhs, groups, dtype): the same of 16-bit lhs [M, K] and rhs [M, N] over each group's rows
      (the 16-bit weight gradients).
  And the biases' gradients: group_sums(v, weights, groups), jaxmlp.fp8.quantize.group_sums of 16-bit v."""
  quantize_rows_and_columns: tp.Callable
  activation_rows_and_columns: tp.Callable
  activation_grad_rows_and_columns: tp.Callable
  quantize_rows_in_groups: tp.Callable
  activation_rows: tp.Callable
  activation_grad_rows: tp.Callable
  rows: tp.Callable
  columns: tp.Callable
  columns16: tp.Callable
  group_sums: tp.Callable


def emulated_primitives(gemm: Gemm) -> Primitives:
  """This module's quantizers, and products of exactly dequantized operands with float32 accumulation on
  any grouped GEMM."""
  def rows(lhs, w, groups, transposed, dtype, zero_padding):
    return gemm("nt" if transposed else "nn", dequantize_rows(*lhs), dequantize_weights(*w[:2]),
                groups.sizes).astype(dtype)

  def columns(lhs, rhs, groups, dtype):
    return gemm("tn", dequantize_columns(*lhs), dequantize_columns(*rhs), padded_sizes(groups)).astype(dtype)

  def columns16(lhs, rhs, groups, dtype):
    return gemm("tn", lhs, rhs, groups.sizes).astype(dtype)

  return Primitives(quantize_rows_and_columns, activation_rows_and_columns, activation_grad_rows_and_columns,
                    quantize_rows_in_groups, activation_rows, activation_grad_rows, rows, columns, columns16,
                    group_sums)


def forward(p: Primitives, x, w1q, w2q, groups: Groups, scales, act: Activation, b1=None, b2=None,
            zero_padding=True, fp8_wgrad=True):
  """(y, residuals) of the forward for weights quantized by quantize_weights. The residuals: h, x and a in
  128 x 1 blocks (the weight gradients' operands: a's from here, where it is quantized anyway, rather than
  from h again; without fp8_wgrad x and round(a) as they are) and the quantized weights, each with its
  exponents. y's rows past the groups: zeros with zero_padding, else any values; h's any values (no kernel
  reads them; XLA's passes mask them)."""
  dtype = x.dtype
  # *_wgrad: a weight gradient's operand, quantize_columns' (q, exponents) or with 16-bit weight gradients
  # the 16-bit tensor itself.
  if fp8_wgrad:
    x_rows, x_wgrad = p.quantize_rows_and_columns(x, groups)
  else:
    x_rows, x_wgrad = p.quantize_rows_in_groups(x, groups), x
  h = p.rows(x_rows, w1q, groups, False, dtype, False)
  if b1 is not None:
    h = (h.astype(jnp.float32) + bias_rows(b1, groups)).astype(dtype)
  activation = p.activation_rows_and_columns if fp8_wgrad else p.activation_rows
  a_rows, a_wgrad = activation(h, scales, groups, act)
  y = p.rows(a_rows, w2q, groups, False, dtype, zero_padding)
  if b2 is not None:
    y = (y.astype(jnp.float32) + scaled_bias(b2, scales, groups, dtype)).astype(dtype)
  return y, (h, x_wgrad, a_wgrad, w1q[:2], w2q[:2])


def backward(p: Primitives, residuals, groups: Groups, scales, act: Activation, dy, b1=None, b2=None,
             zero_padding=True, fp8_wgrad=True):
  """(dx, dw1, dw2, db1, db2, dscales; None where absent) of the backward, from the forward's residuals
  (of a forward with the same fp8_wgrad); dx's rows past the groups zeros with zero_padding, else any
  values."""
  h, x_wgrad, a_wgrad, w1q, w2q = residuals  # *_wgrad: as in forward
  dtype = h.dtype
  if fp8_wgrad:
    dy_rows, dy_wgrad = p.quantize_rows_and_columns(dy, groups)
  else:
    dy_rows, dy_wgrad = p.quantize_rows_in_groups(dy, groups), dy
  da = p.rows(dy_rows, w2q, groups, True, dtype, False)
  activation_grad = p.activation_grad_rows_and_columns if fp8_wgrad else p.activation_grad_rows
  dh_rows, dh_wgrad = activation_grad(h, da, scales, groups, act)
  dx = p.rows(dh_rows, w1q, groups, True, dtype, zero_padding)
  weight_gradient = p.columns if fp8_wgrad else p.columns16  # 16-bit: rows past the groups any values
  dw2 = weight_gradient(a_wgrad, dy_wgrad, groups, dtype)
  dw1 = weight_gradient(x_wgrad, dh_wgrad, groups, dtype)
  # The biases' and scales' gradients in XLA: h and da hold any values past the groups, taken as zeros.
  valid = groups.valid[:, None]
  h, da = jnp.where(valid, h, 0), jnp.where(valid, da.astype(jnp.float32), 0)
  dh = None
  if b1 is not None and not fp8_wgrad:  # round(dh) itself (group_sums reads only the groups' rows)
    dh = dh_wgrad
  elif b1 is not None:  # the quantizer's dh goes through no memory: db1 takes its own, rounded to x's dtype
    dh = _activation_grad(h, da, scales, act).astype(dtype)
  act_h = None if scales is None else act(h.astype(jnp.float32))
  db1, db2, dscales = bias_and_scale_grads(da, dh, dy, act_h, dtype, scales, groups, b1, b2,
                                           group_sums=p.group_sums)
  return dx, dw1, dw2, db1, db2, dscales


def implementation(p: Primitives, quantize_weights_on_platform) -> Implementation:
  """The recipe over a platform's primitives and weight quantizer."""
  def forward_(x, w1q, w2q, groups, b1, b2, scales, act, recipe, shape, residuals, zero_padding):
    return forward(p, x, w1q, w2q, groups, scales, act, b1, b2, zero_padding, fp8_weight_gradients(recipe))

  def backward_(residuals, groups, b1, b2, scales, act, recipe, shape, dy, zero_padding):
    return backward(p, residuals, groups, scales, act, dy, b1, b2, zero_padding, fp8_weight_gradients(recipe))

  return Implementation(quantize_weights_on_platform, forward_, backward_)


def emulation(gemm: Gemm) -> Implementation:
  return implementation(emulated_primitives(gemm), rounded_first(quantize_weights))


SCHEME = Scheme(name="blockwise", pad=BLOCK,
                weight_scales=lambda E, K, N: ((E, -(-K // BLOCK), -(-N // BLOCK)), jnp.int32),
                quantize_weights=quantize_weights, emulation=emulation)
