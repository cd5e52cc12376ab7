"""FP8 training of the grouped MLP: the recipes, and their semantics as an emulation in JAX.

`jaxmlp.grouped_mlp(..., fp8="tensorwise")` runs FC1 and FC2, forward and backward, as FP8 e4m3 products
with float32 accumulation. Every operand of a product is quantized with *current* scaling (stateless, no
amax history): its scale is computed from its own absolute maximum in the same call,

    scale = amax / 448      (1 where amax is 0: an all-zero tensor)
    q     = e4m3(v * (448 / amax))      round to nearest even, saturating at +-448, NaN kept

in float32 arithmetic (16-bit data puts many v * 448 / amax exactly on an e4m3 rounding tie, which the
float32 rounding of 448 / amax decides: it is part of the definition),

and a product of quantized operands is `(q_a @ q_b) * (scale_a * scale_b)`, rounded once to x's dtype.
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
to x's dtype, as the 16-bit path stores it), as in the 16-bit path: only the six products are FP8.

The backward reuses the forward's scales of x, w1, w2 and a (saved as their amaxes) and its quantized
q(x), q(w1) and q(w2) (saved in e4m3: half the bytes of x, and no second pass over the weights; q(x) in
the layout the weight gradient reads, transposed_padded). All FP8 data is
e4m3, gradients included: with per-tensor current scaling its 3 mantissa bits beat e5m2's range, which
current scaling does not need (the scale adapts every call).

This module's functions compute exactly that with dequantized float32 operands, around any grouped GEMM:
with `jax.lax.ragged_dot` it is the reference (jaxmlp.reference), with jaxmlp's grouped GEMM the CPU
backend. The CUDA backend computes the same in two custom calls (ffi/cuda/fp8_mlp_cuda.cu). The blockwise
recipe is defined in jaxmlp.fp8_blockwise.
"""
from __future__ import annotations

import dataclasses
import typing as tp

import jax
import jax.numpy as jnp

from . import _checks
from .activations import Activation

E4M3_MAX = 448.0
RECIPES = ("tensorwise", "blockwise")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
  """An FP8 recipe of the grouped MLP.

  name: "tensorwise" (one scale per tensor, current scaling; see the module docstring) or "blockwise" (one
    scale per 1 x 128 block of activations and gradients, per 128 x 128 block of weights: jaxmlp.fp8_blockwise).
  fast_accumulation: the forward's products accumulate in the tensor cores' faster, less precise FP8
    accumulator (cuBLASLt's FAST_ACCUM), as TransformerEngine's recipes do. Only the CUDA kernels of the
    tensorwise recipe have it; their results then differ from the emulation by ~1e-2 (tests/test_fp8.py).
  backward_fast_accumulation: the same for the backward's four products (data and weight gradients). Off by
    default, as in TransformerEngine, which keeps the precise accumulator for gradients; on, the weight
    gradients' products run faster (README: FP8).
  """

  name: str = "tensorwise"
  fast_accumulation: bool = True
  backward_fast_accumulation: bool = False

  def __post_init__(self):
    if self.name not in RECIPES:
      raise ValueError(f"fp8: unknown recipe {self.name!r}; expected None or one of {', '.join(RECIPES)}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weights:
  """Expert weights quantized once for an FP8 recipe (jaxmlp.fp8_weights), which grouped_mlp takes in place
  of w1 or w2: quantize the weights once per optimizer step and reuse them over the step's micro-batches
  (TransformerEngine's weight caching on the first micro-batch), instead of once per call.

  weights: the weights [E, K, N] they were quantized from, as the optimizer holds them (float32 master
    weights too): grouped_mlp's gradient of w1 or w2 flows to this field, in its dtype (so gradients of
    micro-batches add up in float32 there); the quantized fields take none (constants of the step).
  q: [E, K, N] float8_e4m3fn.
  scales: the recipe's scales: tensorwise, the float32 absolute maximum of the weights (a scalar);
    blockwise, the int32 exponents [E, ceil(K / 128), ceil(N / 128)] of the 128 x 128 blocks.
  qt: q transposed, [E, N, K]: the layout FP8 tensor cores read in the forward.
  recipe: the recipe's name.
  """

  weights: jax.Array
  q: jax.Array
  scales: jax.Array
  qt: jax.Array
  recipe: str = dataclasses.field(metadata=dict(static=True))

  @property
  def quantized(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    return self.q, self.scales, self.qt


def resolve(fp8: str | Fp8Recipe | None) -> Fp8Recipe | None:
  """None, a recipe name or an Fp8Recipe; raises a clear error for anything else."""
  if fp8 is None or isinstance(fp8, Fp8Recipe):
    return fp8
  if isinstance(fp8, str):
    return Fp8Recipe(fp8)
  raise TypeError(f"fp8: expected None, a recipe name ({', '.join(RECIPES)}) or jaxmlp.Fp8Recipe, "
                  f"got {type(fp8).__name__}")


def resolve_with_weights(fp8: str | Fp8Recipe | None, w1, w2) -> Fp8Recipe | None:
  """The recipe of a grouped_mlp call: `fp8`, or where it is None the recipe w1 and w2 were quantized for
  (Fp8Weights); an Fp8Weights of another recipe raises ValueError naming it."""
  recipe = resolve(fp8)
  for name, w in (("w1", w1), ("w2", w2)):
    if isinstance(w, Fp8Weights):
      if recipe is None:
        recipe = Fp8Recipe(w.recipe)
      elif w.recipe != recipe.name:
        raise ValueError(f"{name}: Fp8Weights quantized for fp8={w.recipe!r}, but the call runs "
                         f"fp8={recipe.name!r}; quantize it with jaxmlp.fp8_weights(w, {recipe.name!r})")
  return recipe


def weights_of(w):
  """The weights array of w: Fp8Weights' `weights`, or w itself."""
  return w.weights if isinstance(w, Fp8Weights) else w


def checked_as(w, dtype):
  """What grouped_mlp's operand checks see of w: an Fp8Weights as its weights' shape in the call's dtype
  (its weights may be wider: the products read only the quantized fields)."""
  return jax.ShapeDtypeStruct(w.weights.shape, dtype) if isinstance(w, Fp8Weights) else w


def amax(v: jax.Array, valid_rows: jax.Array | None = None) -> jax.Array:
  """float32 absolute maximum of v, over the rows where valid_rows is true (all rows if None)."""
  a = jnp.abs(v.astype(jnp.float32))
  if valid_rows is not None:
    a = jnp.where(valid_rows.reshape((-1,) + (1,) * (v.ndim - 1)), a, 0)
  return jnp.max(a, initial=0.0)


def scale_of(a: jax.Array) -> jax.Array:
  """The dequantization scale of a tensor with absolute maximum a: a / 448, or 1 where a is 0."""
  return jnp.where(a > 0, a / E4M3_MAX, 1.0).astype(jnp.float32)


def to_e4m3(v: jax.Array) -> jax.Array:
  """float32 v rounded to e4m3 (float8_e4m3fn): to nearest even, saturating at +-448, NaN kept."""
  return jnp.clip(v, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def quantize_e4m3(v: jax.Array, a: jax.Array) -> jax.Array:
  """v quantized to e4m3 (float8_e4m3fn) with the scale of amax a."""
  inverse = jnp.where(a > 0, E4M3_MAX / a, 1.0).astype(jnp.float32)
  return to_e4m3(v.astype(jnp.float32) * inverse)


def quantize(v: jax.Array, a: jax.Array) -> jax.Array:
  """v quantized to e4m3 with the scale of amax a, returned as the float32 values of the e4m3 numbers."""
  return quantize_e4m3(v, a).astype(jnp.float32)


class Gemm(tp.Protocol):
  """A float32 grouped product under the group_sizes policy (see GemmOp in ffi/common.h): "nn" lhs @
  rhs[g], "nt" lhs @ rhs[g].T, "tn" out[g] = lhs[rows of g].T @ rhs[rows of g]."""

  def __call__(self, op: str, lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array: ...


# The weight gradients' operands on FP8 tensor cores: transposed (contiguous along the tokens), each group's
# rows from a multiple of PAD (ffi/cuda/grouped_gemm.h PaddedRows).
PAD = 16


def padded_length(m: int, groups: int) -> int:
  """Columns of transposed_padded for m rows in `groups` groups (at most m + 15 groups, rounded to 16)."""
  return (m + (PAD - 1) * groups + PAD - 1) // PAD * PAD


def _padded_positions(sizes: jax.Array, m: int) -> jax.Array:
  """Each of the m rows' column in transposed_padded's layout, or padded_length for the rows past the groups."""
  sizes = _checks.clamp_group_sizes(sizes, m)
  spans = (sizes + PAD - 1) // PAD * PAD
  groups = _checks.row_groups(sizes, m)
  g = jnp.minimum(groups, sizes.shape[0] - 1)
  position = (jnp.cumsum(spans) - spans)[g] + jnp.arange(m) - (jnp.cumsum(sizes) - sizes)[g]
  return jnp.where(groups < sizes.shape[0], position, padded_length(m, sizes.shape[0]))


def transposed_padded(q: jax.Array, sizes: jax.Array) -> jax.Array:
  """q [M, C] transposed into the weight gradients' layout [C, L] (L = padded_length): each group's rows from
  a multiple of 16, zeros between and after."""
  m, c = q.shape
  out = jnp.zeros((padded_length(m, sizes.shape[0]), c), q.dtype)
  return out.at[_padded_positions(sizes, m)].set(q, mode="drop").T


def rows_of_transposed_padded(qt: jax.Array, sizes: jax.Array, m: int) -> jax.Array:
  """The [m, C] rows of transposed_padded's qt, zeros past the groups."""
  return jnp.take(qt.T, _padded_positions(sizes, m), axis=0, mode="fill", fill_value=0)


def quantize_weights(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Weights [E, K, N] with one scale per tensor: (q [E, K, N] e4m3, amax float32 [], q transposed [E, N, K])."""
  a = amax(w)
  q = quantize_e4m3(w, a)
  return q, a, jnp.swapaxes(q, 1, 2)


def _activation_and_grads(act: Activation, h: jax.Array):
  """act(h) and its partial derivatives d act / d h (float32 [M, F1]) for a unit output gradient."""
  value, vjp = jax.vjp(act, h)
  return value, vjp


def bias_rows(b: jax.Array, sizes: jax.Array, valid: jax.Array) -> jax.Array:
  """Bias b [E, n] of each row's group: [M, n] float32, 0 in the rows past the groups (`valid` false)."""
  m = valid.shape[0]
  groups = jnp.minimum(_checks.row_groups(_checks.clamp_group_sizes(sizes, m), m), b.shape[0] - 1)
  return jnp.where(valid[:, None], b.astype(jnp.float32)[groups], 0)


def group_sums(v: jax.Array, weights: jax.Array | None, sizes: jax.Array) -> jax.Array:
  """float32 sums over each group's rows of weights * v (v [M, n], weights [M] or None): [E, n]."""
  m = v.shape[0]
  groups = _checks.row_groups(_checks.clamp_group_sizes(sizes, m), m)  # E past the groups: dropped
  v = v.astype(jnp.float32)
  if weights is not None:
    v = v * weights.astype(jnp.float32)[:, None]
  return jax.ops.segment_sum(v, groups, num_segments=sizes.shape[0], indices_are_sorted=True)


def emulated_forward(gemm: Gemm, x, w1, w2, sizes, scales, valid, act: Activation, b1=None, b2=None):
  """(y, residuals) of the FP8 forward for w1 and w2 quantized by quantize_weights ((q, amax, qt) each);
  `valid` marks the rows in groups. The residuals: h, the amaxes [4] of x, w1, w2 and a, and q(x)
  (transposed_padded), q(w1), q(w2) in e4m3."""
  dtype = x.dtype
  (w1q, aw1, _), (w2q, aw2, _) = w1, w2
  ax = amax(x, valid)
  xq = quantize_e4m3(x, ax)
  h = gemm("nn", xq.astype(jnp.float32), w1q.astype(jnp.float32), sizes) * (scale_of(ax) * scale_of(aw1))
  h = jnp.where(valid[:, None], h, 0).astype(dtype)
  if b1 is not None:
    h = (h.astype(jnp.float32) + bias_rows(b1, sizes, valid)).astype(dtype)
  a = act(h.astype(jnp.float32))
  if scales is not None:
    a = a * scales.astype(jnp.float32)[:, None]
  a = jnp.where(valid[:, None], a, 0)
  aa = amax(a)
  y = gemm("nn", quantize(a, aa), w2q.astype(jnp.float32), sizes) * (scale_of(aa) * scale_of(aw2))
  if b2 is not None:
    y = y + scaled_bias(b2, scales, sizes, valid, dtype)
  residuals = (h, jnp.stack([ax, aw1, aw2, aa]), transposed_padded(xq, sizes), w1q, w2q)
  return jnp.where(valid[:, None], y, 0).astype(dtype), residuals


def scaled_bias(b2, scales, sizes, valid, dtype) -> jax.Array:
  """round(scales * b2[g]) per row, float32 [M, d]: the term FC2's product is summed with."""
  b = bias_rows(b2, sizes, valid)
  if scales is not None:
    b = b * scales.astype(jnp.float32)[:, None]
  return b.astype(dtype).astype(jnp.float32)


def emulated_backward(gemm: Gemm, residuals, sizes, scales, valid, act: Activation, dy, b1=None, b2=None):
  """(dx, dw1, dw2, db1, db2, dscales; None where absent) of the FP8 backward, from the forward's
  residuals."""
  h, amaxes, xt, w1q, w2q = residuals
  dtype = h.dtype
  xq = rows_of_transposed_padded(xt, sizes, h.shape[0])
  ax, aw1, aw2, aa = amaxes[0], amaxes[1], amaxes[2], amaxes[3]
  rows = valid[:, None]
  dy = jnp.where(rows, dy.astype(jnp.float32), 0)
  ady = amax(dy)
  qdy = quantize(dy, ady)
  da = (gemm("nt", qdy, w2q.astype(jnp.float32), sizes) * (scale_of(ady) * scale_of(aw2))).astype(dtype)
  da = jnp.where(rows, da.astype(jnp.float32), 0)
  value, vjp = _activation_and_grads(act, h.astype(jnp.float32))
  s = scales.astype(jnp.float32)[:, None] if scales is not None else 1.0
  qa = quantize(jnp.where(rows, value * s, 0), aa)
  dh = jnp.where(rows, vjp(da * s)[0], 0)
  adh = amax(dh)
  qdh = quantize(dh, adh)
  dw2 = gemm("tn", qa, qdy, sizes) * (scale_of(aa) * scale_of(ady))
  dx = gemm("nt", qdh, w1q.astype(jnp.float32), sizes) * (scale_of(adh) * scale_of(aw1))
  dw1 = gemm("tn", xq.astype(jnp.float32), qdh, sizes) * (scale_of(ax) * scale_of(adh))  # xq: 0 past the groups
  return (dx.astype(dtype), dw1.astype(dtype), dw2.astype(dtype),
          *bias_and_scale_grads(da, dh, dy, value, dtype, scales, sizes, valid, b1, b2))


def bias_and_scale_grads(da, dh, dy, act_h, dtype, scales, sizes, valid, b1, b2, group_sums=group_sums):
  """(db1, db2, dscales; None where absent) in dtype, from da (float32, zero past the groups), dh and dy,
  and act_h = act(h) in float32 (read only with scales; both recipes; group_sums: the platform's, which
  takes dh and dy in dtype or float32)."""
  db1 = None if b1 is None else group_sums(dh.astype(dtype), None, sizes).astype(dtype)
  db2 = None if b2 is None else group_sums(dy, scales, sizes).astype(dtype)
  dscales = None
  if scales is not None:  # a = act(h) * scales and y = scales * (... + b2)
    ds = jnp.sum(da * act_h, axis=1)
    if b2 is not None:
      ds = ds + jnp.sum(dy * bias_rows(b2, sizes, valid), axis=1)
    dscales = ds.astype(dtype)
  return db1, db2, dscales
