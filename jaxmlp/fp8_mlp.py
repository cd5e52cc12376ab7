"""grouped_mlp with an FP8 recipe: the custom_vjp, on the CUDA handlers or the emulation.

On a GPU, the tensorwise recipe (jaxmlp.fp8) quantizes each weight tensor in one custom call
(jaxmlp_fp8_tensor_weights) and runs each direction as one custom call (jaxmlp_mlp_fp8_fwd / _bwd,
ffi/cuda/fp8_mlp_cuda.cu); the blockwise recipe (jaxmlp.fp8_blockwise) runs each quantization and
each of its six products as a custom call (ffi/cuda/fp8_block_quantize.cu, fp8_block_gemm_cuda.cu), the
activation and its derivative inside the quantizers of a and dh. Elsewhere a recipe is emulated:
quantize-dequantize in JAX around float32 grouped products, which grouped_mlp computes on jaxmlp's grouped
GEMM of bfloat16 operands (exact for
dequantized FP8 values) and jaxmlp.reference on jax.lax.ragged_dot. Both directions carry the same
residuals on every platform: for tensorwise the FC1 output h, the forward's four amaxes and its e4m3 copies
of x (transposed for the weight gradient, written by the pass that quantizes x), w1 and w2 (not x itself:
the backward needs only q(x), at half the bytes); for blockwise h, x's and
a's 128 x 1 blocks and the quantized weights. The weights are quantized in the call, or once by the caller
(jaxmlp.fp8_weights, Fp8Weights) and reused over several calls.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _ffi, fp8, fp8_blockwise
from .activations import Activation


def grouped_mlp(x, w1, w2, group_sizes, b1, b2, scales, act: Activation, recipe: fp8.Fp8Recipe,
                shape: _checks.MlpShape):
  """grouped_mlp's FP8 path for checked operands (see jaxmlp.grouped_mlp). w1 and w2: arrays, or Fp8Weights
  of this recipe."""
  (w1, w1q), (w2, w2q) = _split(w1, x.dtype), _split(w2, x.dtype)
  return _mlp(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, act, recipe, shape)


def reference_mlp(x, w1, w2, group_sizes, b1, b2, scales, act: Activation, recipe: fp8.Fp8Recipe):
  """The FP8 recipe's definition: the emulation around jax.lax.ragged_dot, with the same VJP."""
  (w1, w1q), (w2, w2q) = _split(w1, x.dtype), _split(w2, x.dtype)
  return _reference(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, act, recipe)


def fp8_weights(w, recipe: fp8.Fp8Recipe, dtype) -> fp8.Fp8Weights:
  """jaxmlp.fp8_weights for checked weights: w in `dtype`, quantized on this platform's kernels, which are
  not differentiated (the gradient reaches `w` through grouped_mlp)."""
  quantized = _quantize_weights(jax.lax.stop_gradient(w).astype(dtype), recipe)
  return fp8.Fp8Weights(w, *quantized, recipe=recipe.name)


def _split(w, dtype):
  """(weights in the call's dtype, their quantized form (q, scales, qt) or None where the call quantizes
  them). Fp8Weights' weights are cast (read by nothing when quantized: the cast is there for its
  transpose, which hands the gradient to the weights in their own dtype, float32 master weights too)."""
  return (w.weights.astype(dtype), w.quantized) if isinstance(w, fp8.Fp8Weights) else (w, None)


def _quantize_weights(w, recipe: fp8.Fp8Recipe):
  """(q, scales, qt) of weights [E, K, N] for the recipe, on this platform's kernels."""
  if recipe.name == "blockwise":
    return _blockwise_backend().quantize_weights(w)
  return jax.lax.platform_dependent(w, cpu=fp8.quantize_weights, cuda=_ffi.fp8_tensor_weights)


def check(x, recipe: fp8.Fp8Recipe, shape: _checks.MlpShape, w1=None, w2=None) -> None:
  """Trace-time checks of an FP8 call, with the reason in the error; w1 and w2 as given (arrays or
  Fp8Weights, whose `weights` passed check_mlp)."""
  for name, w in (("w1", w1), ("w2", w2)):
    if isinstance(w, fp8.Fp8Weights):
      _check_quantized(name, w, recipe)
  if jnp.result_type(x) == jnp.float32:
    raise TypeError("fp8: x.dtype float32 is not supported; FP8 training takes bfloat16 or float16 operands")
  if shape.d % 16 or shape.f % 16:
    raise ValueError(f"fp8: d = {shape.d} and f = {shape.f} must be multiples of 16 (FP8 rows are 16-byte "
                     "aligned for the tensor cores)")
  # The weight gradients read transposed copies with every group's rows rounded up to 16 (tensorwise) or
  # 128 (blockwise), M + 15 E or M + 127 E rows in all (ffi/cuda/grouped_gemm.h PaddedRows), indexed with
  # int32.
  layout, pad = (fp8_blockwise, fp8_blockwise.BLOCK) if recipe.name == "blockwise" else (fp8, fp8.PAD)
  if layout.padded_length(shape.M, shape.E) >= _checks.INDEX_LIMIT:
    raise ValueError(f"fp8: x has M = {shape.M} rows and w1 E = {shape.E} experts; M + {pad - 1} E must stay "
                     f"below 2^31 (the weight gradients pad each group's rows to a multiple of {pad})")


def _check_quantized(name: str, w: fp8.Fp8Weights, recipe: fp8.Fp8Recipe) -> None:
  """An Fp8Weights holds what fp8_weights makes of its `weights` (one built by hand might not)."""
  E, K, N = np.shape(w.weights)
  blocks = (E, -(-K // fp8_blockwise.BLOCK), -(-N // fp8_blockwise.BLOCK))
  want = {"q": ((E, K, N), jnp.float8_e4m3fn), "qt": ((E, N, K), jnp.float8_e4m3fn),
          "scales": (blocks, jnp.int32) if recipe.name == "blockwise" else ((), jnp.float32)}
  for field, (shape, dtype) in want.items():
    got = getattr(w, field)
    if np.shape(got) != shape or jnp.result_type(got) != dtype:
      raise ValueError(f"{name}: Fp8Weights.{field} is {jnp.result_type(got).name} {list(np.shape(got))}, expected "
                       f"{jnp.dtype(dtype).name} {list(shape)} for weights {list(np.shape(w.weights))} "
                       "(make it with jaxmlp.fp8_weights)")


def _valid_rows(sizes, m: int):
  return jnp.arange(m) < jnp.sum(_checks.clamp_group_sizes(sizes, m))


def _emulation(recipe: fp8.Fp8Recipe):
  return fp8_blockwise if recipe.name == "blockwise" else fp8


# ---- the emulation's grouped products ---------------------------------------------------------------------
def _bfloat16_gemm(op, lhs, rhs, sizes):
  """A float32 grouped product of dequantized FP8 operands on jaxmlp's grouped GEMM, CPU or CUDA: an e4m3
  value, and its product with a power-of-two scale, is exact in bfloat16 (8 bits of exponent, 7 of
  mantissa), so the product of the bfloat16 operands with float32 accumulation and output is the float32
  product of the dequantized values (up to the order of the sums)."""
  if op == "tn":
    out_shape = (sizes.shape[0], lhs.shape[1], rhs.shape[1])
  else:
    out_shape = (lhs.shape[0], rhs.shape[2] if op == "nn" else rhs.shape[1])
  return _ffi.grouped_gemm(op, lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), sizes, out_shape, jnp.float32)


def _ragged_dot_gemm(op, lhs, rhs, sizes):
  hi = jax.lax.Precision.HIGHEST
  sizes = _checks.clamp_group_sizes(sizes, lhs.shape[0])
  if op == "nn":
    return jax.lax.ragged_dot(lhs, rhs, sizes, precision=hi, preferred_element_type=jnp.float32)
  if op == "nt":
    return jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2), sizes, precision=hi, preferred_element_type=jnp.float32)
  numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                              lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, rhs, sizes, numbers, precision=hi, preferred_element_type=jnp.float32)


# ---- the blockwise recipe on a GPU ----------------------------------------------------------------------------
def _scales(e):
  """float32 2^e of the recipe's exponents: the block scales cuBLASLt multiplies by."""
  return jnp.ldexp(jnp.ones(e.shape, jnp.float32), e)


def _cuda_rows(lhs, w, sizes, transposed, dtype):
  (q, e), (wq, we) = lhs, w[:2]
  if not transposed:  # FP8 tensor cores read w[g] contiguous along the reduction: the transposed copy [n, k]
    wq, we = w[2], jnp.swapaxes(we, 1, 2)
  we = jnp.pad(we, ((0, 0), (0, 0), (0, -we.shape[2] % 4)))  # cuBLASLt's 128x128 layout: blocks per row to 4
  return _ffi.gemm_fp8_blocks("nt", q, _scales(e), wq, _scales(we), sizes, q.shape[0], dtype)


def _cuda_columns(lhs, rhs, sizes, m, dtype):
  (lq, le), (rq, re) = lhs, rhs
  return _ffi.gemm_fp8_blocks("tn", lq, _scales(le), rq, _scales(re), sizes, m, dtype)


def _cuda_column_blocks(sizes, m):
  """(first, rows, total) of the CUDA quantizers: the column blocks and the rows in groups, [1] int32 (the
  kernels' own bound on the rows past the groups; `valid` marks the same rows)."""
  total = jnp.sum(_checks.clamp_group_sizes(sizes, m), keepdims=True).astype(jnp.int32)
  return (*fp8_blockwise.column_blocks(sizes, m), total)


def _cuda_quantize_rows_and_columns(v, sizes):
  return _ffi.fp8_block_rows_and_columns(v, *_cuda_column_blocks(sizes, v.shape[0]))


def _cuda_activation(h, scales, sizes, valid, act):
  return _ffi.fp8_block_activation(h, None, scales, *_cuda_column_blocks(sizes, h.shape[0]), act)


def _cuda_activation_grad(h, da, scales, sizes, valid, act):
  return _ffi.fp8_block_activation(h, da, scales, *_cuda_column_blocks(sizes, h.shape[0]), act)


def _cuda_group_sums(v, weights, sizes):
  """fp8.group_sums as a grouped product over the rows, [16, M] @ v per group, of a 16-bit lhs whose first
  column is the weights (or ones) and the others zero (16 columns: 16-byte rows for the tensor cores):
  exact 16-bit products, float32 sums in a fixed order (no atomics, as XLA's scatter-add would take)."""
  m = v.shape[0]
  column = jnp.ones((m,), v.dtype) if weights is None else weights.astype(v.dtype)
  lhs = jnp.pad(column[:, None], ((0, 0), (0, 15)))
  return _ffi.grouped_gemm("tn", lhs, v, sizes, (sizes.shape[0], 16, v.shape[1]), jnp.float32)[:, 0]


_CUDA_BLOCKWISE = fp8_blockwise.Backend(_cuda_quantize_rows_and_columns, _cuda_activation, _cuda_activation_grad,
                                        _ffi.fp8_block_weights, _cuda_rows, _cuda_columns, _cuda_group_sums)


def _blockwise_backend() -> fp8_blockwise.Backend:
  """The blockwise recipe's kernels: CUDA's on a GPU, the emulation elsewhere, chosen per platform at
  lowering (both compute the same quantized values)."""
  emulated = fp8_blockwise.emulation(_bfloat16_gemm)

  def per_platform(name, *static):
    cpu, cuda = getattr(emulated, name), getattr(_CUDA_BLOCKWISE, name)
    def call(*args):
      return jax.lax.platform_dependent(*args, cpu=lambda *a: cpu(*a, *static), cuda=lambda *a: cuda(*a, *static))
    return call

  return fp8_blockwise.Backend(
      quantize_rows_and_columns=per_platform("quantize_rows_and_columns"),
      activation_rows_and_columns=lambda h, scales, sizes, valid, act: per_platform(
          "activation_rows_and_columns", act)(h, scales, sizes, valid),
      activation_grad_rows_and_columns=lambda h, da, scales, sizes, valid, act: per_platform(
          "activation_grad_rows_and_columns", act)(h, da, scales, sizes, valid),
      quantize_weights=per_platform("quantize_weights"),
      rows=lambda lhs, w, sizes, transposed, dtype: per_platform("rows", transposed, dtype)(lhs, w, sizes),
      columns=lambda lhs, rhs, sizes, m, dtype: per_platform("columns", m, dtype)(lhs, rhs, sizes),
      group_sums=per_platform("group_sums"))


def _emulated_forward(gemm, recipe):
  def forward(x, w1q, w2q, sizes, b1, b2, scales, act):
    valid = _valid_rows(sizes, x.shape[0])
    return _emulation(recipe).emulated_forward(gemm, x, w1q, w2q, sizes, scales, valid, act, b1, b2)
  return forward


def _emulated_backward(gemm, recipe):
  def backward(residuals, sizes, b1, b2, scales, act, dy):
    valid = _valid_rows(sizes, dy.shape[0])
    return _emulation(recipe).emulated_backward(gemm, residuals, sizes, scales, valid, act, dy, b1, b2)
  return backward


# ---- the custom_vjp of the op -------------------------------------------------------------------------------
# On a GPU the tensorwise recipe runs its own custom calls and the blockwise recipe its products'; elsewhere
# the emulation runs on jaxmlp's bfloat16 grouped GEMM. w1q and w2q: the weights quantized by the caller
# (Fp8Weights), or None to quantize them here; they take no gradient (the weights w1 and w2 do). b1, b2 and
# scales may be None.
@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def _mlp(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, act, recipe, shape):
  return _forward(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, act, recipe, shape, residuals=False)[0]


def _mlp_fwd(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, act, recipe, shape):
  return _forward(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, act, recipe, shape, residuals=True)


def _forward(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, act, recipe, shape, residuals: bool):
  """(y, what the backward takes, or None without `residuals`: a call that is not differentiated skips the
  tensorwise forward's transposed copy of x)."""
  w1q = _quantize_weights(w1, recipe) if w1q is None else w1q
  w2q = _quantize_weights(w2, recipe) if w2q is None else w2q

  def emulation(x, w1q, w2q, sizes, b1, b2, scales):
    y, res = _emulated_forward(_bfloat16_gemm, recipe)(x, w1q, w2q, sizes, b1, b2, scales, act)
    return y, res if residuals else None

  def cuda(x, w1q, w2q, sizes, b1, b2, scales):
    y, h, amaxes, xt = _ffi.mlp_fp8_forward(x, w1q, w2q, sizes, b1, b2, scales, act, recipe, shape, residuals)
    return y, (h, amaxes, xt, w1q[0], w2q[0]) if residuals else None

  args = (x, w1q, w2q, group_sizes, b1, b2, scales)
  if recipe.name == "blockwise":
    valid = _valid_rows(group_sizes, x.shape[0])
    y, res = fp8_blockwise.forward(_blockwise_backend(), x, w1q, w2q, group_sizes, scales, valid, act, b1, b2)
  else:
    y, res = jax.lax.platform_dependent(*args, cpu=emulation, cuda=cuda)
  return y, (res, group_sizes, b1, b2, scales)


def _mlp_bwd(act, recipe, shape, res, dy):
  residuals, group_sizes, b1, b2, scales = res

  def emulation(residuals, sizes, b1, b2, scales, dy):
    return _emulated_backward(_bfloat16_gemm, recipe)(residuals, sizes, b1, b2, scales, act, dy)

  def cuda(residuals, sizes, b1, b2, scales, dy):
    h, amaxes, xt, w1q, w2q = residuals
    return _ffi.mlp_fp8_backward(xt, w1q, w2q, sizes, b1, b2, scales, h, amaxes, dy, act, recipe, shape)

  dy = dy.astype(residuals[0].dtype)
  if recipe.name == "blockwise":
    valid = _valid_rows(group_sizes, dy.shape[0])
    grads = fp8_blockwise.backward(_blockwise_backend(), residuals, group_sizes, scales, valid, act, dy, b1, b2)
  else:
    grads = jax.lax.platform_dependent(residuals, group_sizes, b1, b2, scales, dy, cpu=emulation, cuda=cuda)
  dx, dw1, dw2, db1, db2, dscales = grads
  return dx, dw1, dw2, None, None, np.zeros(np.shape(group_sizes), jax.dtypes.float0), db1, db2, dscales


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10))
def _reference(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, act, recipe):
  return _reference_fwd(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, act, recipe)[0]


def _reference_fwd(x, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, act, recipe):
  quantize = _emulation(recipe).quantize_weights
  w1q = quantize(w1) if w1q is None else w1q
  w2q = quantize(w2) if w2q is None else w2q
  y, residuals = _emulated_forward(_ragged_dot_gemm, recipe)(x, w1q, w2q, group_sizes, b1, b2, scales, act)
  return y, (residuals, group_sizes, b1, b2, scales)


def _reference_bwd(act, recipe, res, dy):
  residuals, group_sizes, b1, b2, scales = res
  dx, dw1, dw2, db1, db2, dscales = _emulated_backward(_ragged_dot_gemm, recipe)(
      residuals, group_sizes, b1, b2, scales, act, dy.astype(residuals[0].dtype))
  return dx, dw1, dw2, None, None, np.zeros(np.shape(group_sizes), jax.dtypes.float0), db1, db2, dscales


_reference.defvjp(_reference_fwd, _reference_bwd)
