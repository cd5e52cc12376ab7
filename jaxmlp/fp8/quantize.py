"""What the FP8 recipes share: e4m3 rounding, current scaling from an absolute maximum, the biases'
terms and gradients, and the interface every recipe and platform implements (Scheme, Implementation).

Pure JAX: the recipes' definitions (jaxmlp.fp8.tensorwise, jaxmlp.fp8.blockwise) are built from these, and
jaxmlp.reference runs them around jax.lax.ragged_dot.
"""
from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp

from .._groups import Groups

E4M3_MAX = 448.0


def amax(v: jax.Array, valid_rows: jax.Array | None = None) -> jax.Array:
  """float32 absolute maximum of v, over the rows where valid_rows is true (all rows if None)."""
  a = jnp.abs(v.astype(jnp.float32))
  if valid_rows is not None:
    a = jnp.where(valid_rows.reshape((-1,) + (1,) * (v.ndim - 1)), a, 0)
  return jnp.max(a, initial=0.0)


def to_e4m3(v: jax.Array) -> jax.Array:
  """float32 v rounded to e4m3 (float8_e4m3fn): to nearest even, saturating at +-448, NaN kept."""
  return jnp.clip(v, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def padded_length(m: int, groups: int, pad: int) -> int:
  """Rows of a weight-gradient operand whose groups each start at a multiple of `pad`: m rows in `groups`
  groups (at most m + (pad - 1) groups rows), rounded up to `pad`. ffi/cuda/gemm/grouped_gemm.h
  PaddedRows(m, groups, pad) is the same number."""
  return (m + (pad - 1) * groups + pad - 1) // pad * pad


class Gemm(tp.Protocol):
  """A float32 grouped product (ffi GemmOp) for clamped sizes (int32 [E], summing to at most the rows):
  "nn" lhs @ rhs[g], "nt" lhs @ rhs[g].T, "tn" out[g] = lhs[rows of g].T @ rhs[rows of g]; exact products
  of float32 operands that hold dequantized FP8 values, or of 16-bit operands, summed in float32."""

  def __call__(self, op: str, lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array: ...


class Implementation(tp.NamedTuple):
  """A recipe on one platform: its emulation around a Gemm, or its CUDA kernels. Every recipe provides
  the same three functions, with the same residuals on every platform, so one custom_vjp (jaxmlp.fp8.mlp)
  serves them all.

  quantize_weights(w, dtype) -> (q [E, K, N] e4m3, the recipe's scales, qt [E, N, K] e4m3) of
    w.astype(dtype), dtype the call's 16-bit dtype; w may be wider (float32 master weights), which a
    platform may round on its way in, with no copy (rounded_first: the emulation's);
  forward(x, w1q, w2q, groups, b1, b2, scales, act, recipe, shape, residuals, zero_padding) -> (y,
    residuals or None): w1q, w2q as quantize_weights gives them; b1, b2, scales may be None; without
    `residuals` (a call that is not differentiated) an implementation may skip what only the backward
    reads (the tensorwise CUDA forward also takes gather=(slot_of_row, k): x then holds the tokens a dispatch
    plan takes its rows from, jaxmlp.fp8.cuda.reads_tokens);
  backward(residuals, groups, b1, b2, scales, act, recipe, shape, dy, zero_padding) -> (dx, dw1, dw2, db1,
    db2, dscales), None where absent.
  The tensorwise recipe's forward and backward also take delayed=amaxes [4] (x, a, dy, dh: delayed scaling,
  jaxmlp.fp8.delayed): its activations are then quantized by those, and the backward returns a seventh
  result, the four amaxes as observed.
  y's and dx's rows past the groups are zeros with zero_padding, else any values (an implementation may
  leave them unwritten).
  """
  quantize_weights: tp.Callable
  forward: tp.Callable
  backward: tp.Callable


def fp8_weight_gradients(recipe) -> bool:
  """Whether the recipe's call runs FP8 weight gradients: a recipe as run (Fp8Recipe.as_run) says; one not
  decided (None: the forward of a call built by hand) runs FP8."""
  return recipe.fp8_weight_gradients is not False


def rounded_first(quantize_weights: tp.Callable) -> tp.Callable:
  """Implementation.quantize_weights(w, dtype) of a Scheme's quantize_weights(w): w rounded to dtype, then
  quantized."""
  return lambda w, dtype: quantize_weights(w.astype(dtype))


class Scheme(tp.NamedTuple):
  """What defines an FP8 recipe, the same fields for each (jaxmlp.fp8.tensorwise.SCHEME,
  jaxmlp.fp8.blockwise.SCHEME).

  name: the recipe's name (Fp8Recipe.name).
  pad: each group's rows in the weight gradients' operands start at a multiple of pad.
  weight_scales(E, K, N): (shape, dtype) of the scales quantize_weights gives weights [E, K, N].
  quantize_weights(w): the weights' quantization, as every platform computes it.
  emulation(gemm): the recipe as an Implementation around any grouped product of float32 operands.
  """
  name: str
  pad: int
  weight_scales: tp.Callable[[int, int, int], tuple[tuple[int, ...], tp.Any]]
  quantize_weights: tp.Callable
  emulation: tp.Callable[[Gemm], Implementation]

  def padded_length(self, m: int, groups: int) -> int:
    return padded_length(m, groups, self.pad)


def bias_rows(b: jax.Array, groups: Groups) -> jax.Array:
  """Bias b [E, n] of each row's group: [M, n] float32, 0 in the rows past the groups."""
  rows = jnp.minimum(groups.row_group, b.shape[0] - 1)
  return jnp.where(groups.valid[:, None], b.astype(jnp.float32)[rows], 0)


def group_sums(v: jax.Array, weights: jax.Array | None, groups: Groups) -> jax.Array:
  """float32 sums over each group's rows of weights * v (v [M, n], weights [M] or None): [E, n]."""
  v = v.astype(jnp.float32)
  if weights is not None:
    v = v * weights.astype(jnp.float32)[:, None]
  # The rows past the groups have segment E: dropped.
  return jax.ops.segment_sum(v, groups.row_group, num_segments=groups.num_groups, indices_are_sorted=True)


def scaled_bias(b2, scales, groups: Groups, dtype) -> jax.Array:
  """round(scales * b2[g]) per row, float32 [M, d]: the term FC2's product is summed with."""
  b = bias_rows(b2, groups)
  if scales is not None:
    b = b * scales.astype(jnp.float32)[:, None]
  return b.astype(dtype).astype(jnp.float32)


def bias_and_scale_grads(da, dh, dy, act_h, dtype, scales, groups: Groups, b1, b2, group_sums=group_sums):
  """(db1, db2, dscales; None where absent) in dtype, from da (float32, zero past the groups), dh and dy,
  and act_h = act(h) in float32 (read only with scales; both recipes; group_sums: the platform's, which
  takes dh and dy in dtype or float32)."""
  db1 = None if b1 is None else group_sums(dh.astype(dtype), None, groups).astype(dtype)
  db2 = None if b2 is None else group_sums(dy, scales, groups).astype(dtype)
  dscales = None
  if scales is not None:  # a = act(h) * scales and y = scales * (... + b2)
    ds = jnp.sum(da * act_h, axis=1)
    if b2 is not None:
      ds = ds + jnp.sum(dy * bias_rows(b2, groups), axis=1)
    dscales = ds.astype(dtype)
  return db1, db2, dscales
