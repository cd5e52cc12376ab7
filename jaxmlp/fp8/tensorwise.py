"""The tensorwise FP8 recipe: its definition, as an emulation in JAX.

`jaxmlp.grouped_mlp(..., fp8="tensorwise")` runs FC1 and FC2, forward and backward, as FP8 e4m3 products
with float32 accumulation. Every operand of a product is quantized with *current* scaling (stateless, no
amax history): its scale is computed from its own absolute maximum in the same call,

    scale = amax / 448      (1 where amax is 0: an all-zero tensor)
    q     = e4m3(v * (448 / amax))      round to nearest even, saturating at +-448, NaN kept

    where 448 / amax overflows float32 (amax < 448 / FLOAT32_MAX, 1.3e-36): 448 / amax is clamped to the
    float32 maximum, as TransformerEngine does, and scale is its float32 reciprocal 2^-128

in float32 arithmetic (16-bit data puts many v * 448 / amax exactly on an e4m3 rounding tie, which the
float32 rounding of 448 / amax decides: it is part of the definition),

and a product of quantized operands is `(q_a @ q_b) * (scale_a * scale_b)`, rounded once to x's dtype.
With delayed scaling (Fp8Recipe(scaling="delayed"), jaxmlp.fp8.delayed) the activations x, a, dy and dh are
quantized by the same formulas with a given amax in place of their own (saturating past it; their own where
the given one is 0: an empty history), and their own amaxes are what the call reports.
Activations (x, the activation output, the output gradient dy and the FC1 gradient dh) take one scale per
tensor over the rows in groups (padding rows are ignored); the weights one scale per tensor.

Where each quantization happens, which is what makes a result bit-reproducible:

  forward   h  = round((q(x) @ q(w1)) * sx sw1)               h: the saved FC1 output, x.dtype
                 (with b1: h = round(h + b1[g]), as the 16-bit path)
            a  = act(h) * scales                              float32, then q(a) for FC2
            y  = round((q(a) @ q(w2)) * sa sw2 + round(scales * b2[g]))     (without b2: no second term)
  backward  da = round((q(dy) @ q(w2)^T) * sdy sw2)           x.dtype
            dh = da * scales * act'(h)                         float32, then q(dh)
            dw2 = round((q(a)^T @ q(dy)) * sa sdy), dx = round((q(dh) @ q(w1)^T) * sdh sw1),
            dw1 = round((q(x)^T @ q(dh)) * sx sdh), dscales = round(sum_j da * act(h) + sum_j dy * b2[g])
            db1[g] = round(sum over g's rows of round(dh)), db2[g] = round(sum over g's rows of scales * dy)

The biases stay in x's dtype and their gradients are float32 sums of unquantized 16-bit operands (dh rounded
to x's dtype, as the 16-bit path stores it), as in the 16-bit path: only the products are FP8.

With 16-bit weight gradients (Fp8Recipe.fp8_weight_gradients False; by default below
recipe.MIN_ROWS_FP8_WEIGHT_GRADIENTS rows per expert, where the step measured faster with them) the two
weight gradients are those of fp8=None from this recipe's h and da, as in the blockwise recipe:

            dw1 = round(x^T @ round(dh)),  dw2 = round(round(a)^T @ dy)    (16-bit operands, float32 sums)

and the backward keeps x itself in place of q(x) (no transposed copies of x, a, dy or dh are written).

The backward reuses the forward's scales of x, w1, w2 and a (saved as their amaxes) and its quantized
q(x), q(w1) and q(w2) (saved in e4m3: half the bytes of x, and no second pass over the weights; q(x) in the
layout the weight gradient reads, transposed_padded; with 16-bit weight gradients x itself). All FP8 data is
e4m3, gradients included: with per-tensor current scaling its 3 mantissa bits beat e5m2's range, which current
scaling does not need (the scale adapts every call; docs/fp8.md).

The emulation computes exactly that with dequantized float32 operands around any grouped GEMM: with
jax.lax.ragged_dot it is the reference (jaxmlp.reference), with jaxmlp's grouped GEMM the CPU backend. The
CUDA kernels compute the same in two custom calls (jaxmlp.fp8.cuda).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._groups import Groups
from ..activations import Activation
from .quantize import (E4M3_MAX, Gemm, Implementation, Scheme, amax, bias_and_scale_grads, bias_rows,
                       fp8_weight_gradients, padded_length, rounded_first, scaled_bias, to_e4m3)

# The weight gradients' operands on FP8 tensor cores: transposed (contiguous along the tokens), each group's
# rows from a multiple of PAD.
PAD = 16


# An amax below 448 / FLOAT32_MAX (1.3e-36: denormals, and the smallest normal floats) makes 448 / amax
# infinite, and 0 x inf = NaN: the inverse scale is then clamped to the float32 maximum, as TransformerEngine
# does (compute_scale_from_amax), and the dequantization scale is its float32 reciprocal, 2^-128 (a / 448
# would no longer undo it). Every larger amax keeps a / 448 and 448 / amax bit for bit.
FLOAT32_MAX = float(np.finfo(np.float32).max)
SCALE_AT_CLAMP = 2.0**-128  # float32(1 / FLOAT32_MAX)


def scale_of(a: jax.Array) -> jax.Array:
  """The dequantization scale of a tensor with absolute maximum a: a / 448, 2^-128 where 448 / a overflows
  (the inverse clamped), or 1 where a is 0."""
  a = jnp.asarray(a, jnp.float32)
  clamped = jnp.isinf(jnp.float32(E4M3_MAX) / a)
  return jnp.where(a > 0, jnp.where(clamped, jnp.float32(SCALE_AT_CLAMP), a / E4M3_MAX), 1.0).astype(jnp.float32)


def inverse_scale(a: jax.Array) -> jax.Array:
  """What quantization multiplies by at absolute maximum a: 448 / a, clamped to the float32 maximum, or 1
  where a is 0."""
  a = jnp.asarray(a, jnp.float32)
  inverse = jnp.float32(E4M3_MAX) / a
  return jnp.where(a > 0, jnp.minimum(inverse, jnp.float32(FLOAT32_MAX)), 1.0).astype(jnp.float32)


def by_history(given: jax.Array, own: jax.Array) -> jax.Array:
  """The amax delayed scaling quantizes a tensor by: the history's, or where that is 0 (an empty history: the
  first call) the tensor's own."""
  return jnp.where(given > 0, given, own)


def quantize_e4m3(v: jax.Array, a: jax.Array) -> jax.Array:
  """v quantized to e4m3 (float8_e4m3fn) with the scale of amax a."""
  return to_e4m3(v.astype(jnp.float32) * inverse_scale(a))


def quantize(v: jax.Array, a: jax.Array) -> jax.Array:
  """v quantized to e4m3 with the scale of amax a, returned as the float32 values of the e4m3 numbers."""
  return quantize_e4m3(v, a).astype(jnp.float32)


def _padded_positions(groups: Groups) -> jax.Array:
  """Each row's column in transposed_padded's layout, or its length for the rows past the groups."""
  sizes, m = groups.sizes, groups.num_rows
  spans = (sizes + PAD - 1) // PAD * PAD
  g = jnp.minimum(groups.row_group, groups.num_groups - 1)
  position = (jnp.cumsum(spans) - spans)[g] + jnp.arange(m) - (jnp.cumsum(sizes) - sizes)[g]
  return jnp.where(groups.valid, position, padded_length(m, groups.num_groups, PAD))


def transposed_padded(q: jax.Array, groups: Groups) -> jax.Array:
  """q [M, C] transposed into the weight gradients' layout [C, L] (L = padded_length): each group's rows from
  a multiple of 16, zeros between and after."""
  m, c = q.shape
  out = jnp.zeros((padded_length(m, groups.num_groups, PAD), c), q.dtype)
  return out.at[_padded_positions(groups)].set(q, mode="drop").T


def rows_of_transposed_padded(qt: jax.Array, groups: Groups) -> jax.Array:
  """The [m, C] rows of transposed_padded's qt, zeros past the groups."""
  return jnp.take(qt.T, _padded_positions(groups), axis=0, mode="fill", fill_value=0)


def quantize_weights(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Weights [E, K, N] with one scale per tensor: (q [E, K, N] e4m3, amax float32 [], q transposed [E, N, K])."""
  a = amax(w)
  q = quantize_e4m3(w, a)
  return q, a, jnp.swapaxes(q, 1, 2)


def forward(gemm: Gemm, x, w1, w2, groups: Groups, scales, act: Activation, b1=None, b2=None, fp8_wgrad=True,
            delayed=None):
  """(y, residuals) of the forward for w1 and w2 quantized by quantize_weights ((q, amax, qt) each). The
  residuals: h, the amaxes [4] x, w1, w2 and a were quantized by, and q(x) (transposed_padded; without fp8_wgrad
  x itself), q(w1), q(w2) in e4m3; with `delayed` (the amaxes [4] of x, a, dy, dh to scale by: delayed
  scaling, jaxmlp.fp8.delayed) x and a are quantized by its first two, and the residuals end with x's and a's
  own amaxes [2] as observed."""
  dtype, valid, sizes = x.dtype, groups.valid, groups.sizes
  (w1q, aw1, _), (w2q, aw2, _) = w1, w2
  seen_x = amax(x, valid)
  ax = seen_x if delayed is None else by_history(delayed[0], seen_x)
  xq = quantize_e4m3(x, ax)
  h = gemm("nn", xq.astype(jnp.float32), w1q.astype(jnp.float32), sizes) * (scale_of(ax) * scale_of(aw1))
  h = jnp.where(valid[:, None], h, 0).astype(dtype)
  if b1 is not None:
    h = (h.astype(jnp.float32) + bias_rows(b1, groups)).astype(dtype)
  a = act(h.astype(jnp.float32))
  if scales is not None:
    a = a * scales.astype(jnp.float32)[:, None]
  a = jnp.where(valid[:, None], a, 0)
  seen_a = amax(a)
  aa = seen_a if delayed is None else by_history(delayed[1], seen_a)
  y = gemm("nn", quantize(a, aa), w2q.astype(jnp.float32), sizes) * (scale_of(aa) * scale_of(aw2))
  if b2 is not None:
    y = y + scaled_bias(b2, scales, groups, dtype)
  residuals = (h, jnp.stack([ax, aw1, aw2, aa]), transposed_padded(xq, groups) if fp8_wgrad else x, w1q, w2q)
  if delayed is not None:
    residuals += (jnp.stack([seen_x, seen_a]),)
  return jnp.where(valid[:, None], y, 0).astype(dtype), residuals


def backward(gemm: Gemm, residuals, groups: Groups, scales, act: Activation, dy, b1=None, b2=None, fp8_wgrad=True,
             delayed=None):
  """(dx, dw1, dw2, db1, db2, dscales; None where absent) of the backward, from the forward's residuals (of a
  forward with the same fp8_wgrad and delayed); with `delayed` dy and dh are quantized by its last two, and a
  seventh result holds the amaxes [4] of x, a, dy and dh as observed."""
  h, amaxes, xt, w1q, w2q = residuals[:5]
  dtype, sizes = h.dtype, groups.sizes
  ax, aw1, aw2, aa = amaxes[0], amaxes[1], amaxes[2], amaxes[3]
  rows = groups.valid[:, None]
  dy = jnp.where(rows, dy.astype(jnp.float32), 0)
  seen_dy = amax(dy)
  ady = seen_dy if delayed is None else by_history(delayed[2], seen_dy)
  qdy = quantize(dy, ady)
  da = (gemm("nt", qdy, w2q.astype(jnp.float32), sizes) * (scale_of(ady) * scale_of(aw2))).astype(dtype)
  da = jnp.where(rows, da.astype(jnp.float32), 0)
  value, vjp = jax.vjp(act, h.astype(jnp.float32))
  s = scales.astype(jnp.float32)[:, None] if scales is not None else 1.0
  a = jnp.where(rows, value * s, 0)
  dh = jnp.where(rows, vjp(da * s)[0], 0)
  seen_dh = amax(dh)
  adh = seen_dh if delayed is None else by_history(delayed[3], seen_dh)
  qdh = quantize(dh, adh)
  dx = gemm("nt", qdh, w1q.astype(jnp.float32), sizes) * (scale_of(adh) * scale_of(aw1))
  if fp8_wgrad:
    xq = rows_of_transposed_padded(xt, groups)  # 0 past the groups
    dw2 = gemm("tn", quantize(a, aa), qdy, sizes) * (scale_of(aa) * scale_of(ady))
    dw1 = gemm("tn", xq.astype(jnp.float32), qdh, sizes) * (scale_of(ax) * scale_of(adh))
  else:  # 16-bit operands (rounded as the CUDA kernels store them), float32 sums; rows past the groups 0
    x16 = jnp.where(rows, xt, 0)
    dw2 = gemm("tn", a.astype(dtype), dy.astype(dtype), sizes)  # dy: 0 past the groups (above)
    dw1 = gemm("tn", x16, dh.astype(dtype), sizes)
  grads = (dx.astype(dtype), dw1.astype(dtype), dw2.astype(dtype),
           *bias_and_scale_grads(da, dh, dy, value, dtype, scales, groups, b1, b2))
  if delayed is None:
    return grads
  return (*grads, jnp.concatenate([residuals[5], jnp.stack([seen_dy, seen_dh])]))


def emulation(gemm: Gemm) -> Implementation:
  """The recipe around `gemm`, with float32 operands that are exactly the dequantized FP8 values."""
  def forward_(x, w1q, w2q, groups, b1, b2, scales, act, recipe, shape, residuals, zero_padding, delayed=None):
    # zeros past the groups, always
    y, res = forward(gemm, x, w1q, w2q, groups, scales, act, b1, b2, fp8_weight_gradients(recipe), delayed)
    return y, res if residuals else None

  def backward_(residuals, groups, b1, b2, scales, act, recipe, shape, dy, zero_padding, delayed=None):
    return backward(gemm, residuals, groups, scales, act, dy, b1, b2, fp8_weight_gradients(recipe), delayed)

  return Implementation(rounded_first(quantize_weights), forward_, backward_)


SCHEME = Scheme(name="tensorwise", pad=PAD, weight_scales=lambda E, K, N: ((), jnp.float32),
                quantize_weights=quantize_weights, emulation=emulation)
