"""grouped_mlp with an FP8 recipe: one custom_vjp over every recipe, on the CUDA kernels or the emulation.

  jaxmlp.grouped_mlp(fp8=...) -> grouped_mlp -> _mlp (custom_vjp) -> the recipe's Implementation for the
  platform: jaxmlp.fp8.cuda on a GPU, the recipe's emulation (jaxmlp.fp8.tensorwise, .blockwise) elsewhere,
  around jaxmlp's grouped GEMM of bfloat16 operands (exact for dequantized FP8 values).

Both platforms carry the same residuals (see each recipe). The weights are quantized in the call, or once
by the caller (jaxmlp.fp8_weights, Fp8Weights) and reused over several calls. The group sizes are clamped
once per call (Groups) and travel to the backward with the residuals. Over a dispatch plan (`gather`) x
holds the tokens: the tensorwise recipe's CUDA forward with FP8 weight gradients reads the rows from them in
its quantization passes (jaxmlp.fp8.cuda.reads_tokens), every other implementation takes the rows first
(jaxmlp.plan.take_rows); the rows' gradients are combined into the tokens'.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import _checks, dispatch
from .._autodiff import gathered, integer_cotangent
from .._groups import Groups
from .._library import on_platforms
from ..activations import Activation
from ..gemm import grouped_gemm
from ..plan import Plan, take_rows
from . import cuda, delayed
from .quantize import Implementation
from .recipe import Fp8Recipe, Fp8Weights, check_weights_args, split_weights


def grouped_mlp(x, w1, w2, group_sizes, b1, b2, scales, act: Activation, recipe: Fp8Recipe,
                shape: _checks.MlpShape, zero_padding: bool = True, gather: Plan | None = None, history=None):
  """grouped_mlp's FP8 path for checked operands (see jaxmlp.grouped_mlp). w1 and w2: arrays, or Fp8Weights
  of this recipe. gather: a plan of k >= 1 choices a token, x then the tokens it takes its M rows from.
  history: the amax history [4, H] of delayed scaling (jaxmlp.fp8.delayed), whose gradient is its update."""
  (w1, w1q), (w2, w2q) = split_weights(w1, x.dtype), split_weights(w2, x.dtype)
  return _mlp(x, gather, *gathered(w1, w2), w1q, w2q, group_sizes, b1, b2, scales, history, act, recipe, shape,
              zero_padding)


def fp8_weights(w, fp8: str | Fp8Recipe = "tensorwise", dtype=None) -> Fp8Weights:
  """Expert weights quantized for an FP8 recipe, once: grouped_mlp(..., fp8=...) takes them in place of w1
  or w2 and then skips their quantization (two passes over the weights per call).

  Quantize once per optimizer step and reuse over the step's micro-batches (gradient accumulation), as
  TransformerEngine caches FP8 weights on the first micro-batch: the results equal those of passing
  w.astype(dtype). The gradient of a grouped_mlp call for these weights flows to `w` (Fp8Weights.weights)
  in w's dtype; the quantization itself is not differentiated (the weights are constants of the step).

  Args:
    w: [E, K, N] weights (w1 [E, d, F1] or w2 [E, f, d]) as the optimizer holds them, float32 master
      weights too; K and N multiples of 16.
    fp8: the recipe: "tensorwise", "blockwise" or a jaxmlp.Fp8Recipe.
    dtype: the computation dtype the calls take (x's: bfloat16 or float16), which w is rounded to before
      it is quantized, as grouped_mlp would take it; default w's dtype.
  """
  recipe, dtype = check_weights_args(w, fp8, dtype)
  quantized = _quantize_weights(jax.lax.stop_gradient(w), recipe, dtype)
  return Fp8Weights(w, *quantized, recipe=recipe.name, amax=quantized[1] if recipe.name == "tensorwise" else None)


def _bfloat16_gemm(op, lhs, rhs, sizes):
  """A float32 grouped product of dequantized FP8 operands on jaxmlp's grouped GEMM, CPU or CUDA: an e4m3
  value, and its product with a power-of-two scale, is exact in bfloat16 (8 bits of exponent, 7 of
  mantissa), so the product of the bfloat16 operands with float32 accumulation and output is the float32
  product of the dequantized values (up to the order of the sums). 16-bit operands (the recipes' 16-bit
  weight gradients) go as they are."""
  if op == "tn":
    out_shape = (sizes.shape[0], lhs.shape[1], rhs.shape[1])
  else:
    out_shape = (lhs.shape[0], rhs.shape[2] if op == "nn" else rhs.shape[1])
  narrow = lambda v: v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v
  return grouped_gemm(op, narrow(lhs), narrow(rhs), sizes, out_shape, jnp.float32)


def _platforms(recipe: Fp8Recipe) -> dict[str, Implementation]:
  """The recipe's Implementation per platform, for _library.on_platforms."""
  return dict(cpu=recipe.scheme.emulation(_bfloat16_gemm), cuda=cuda.IMPLEMENTATIONS[recipe.name])


def _quantize_weights(w, recipe: Fp8Recipe, dtype):
  """(q, scales, qt) of weights [E, K, N] rounded to dtype, for the recipe, on this platform's kernels."""
  return on_platforms(w, **{p: functools.partial(i.quantize_weights, dtype=dtype)
                            for p, i in _platforms(recipe).items()})


# w1q and w2q: the weights quantized by the caller (Fp8Weights), or None to quantize them here; they take no
# gradient (the weights w1 and w2 do). gather, b1, b2, scales and history may be None; history's "gradient"
# is its update (jaxmlp.fp8.delayed).
@functools.partial(jax.custom_vjp, nondiff_argnums=(11, 12, 13, 14))
def _mlp(x, gather, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, history, act, recipe, shape, zero_padding):
  return _forward(x, gather, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, history, act, recipe, shape,
                  zero_padding, residuals=False)[0]


def _mlp_fwd(x, gather, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, history, act, recipe, shape, zero_padding):
  return _forward(x, gather, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, history, act, recipe, shape,
                  zero_padding, residuals=True)


def _forward(x, gather, w1, w2, w1q, w2q, group_sizes, b1, b2, scales, history, act, recipe, shape, zero_padding,
             residuals: bool):
  """(y, what the backward takes: the recipe's residuals, or None without `residuals`, and the operands it
  reads again)."""
  w1q = _quantize_weights(w1, recipe, x.dtype) if w1q is None else w1q
  w2q = _quantize_weights(w2, recipe, x.dtype) if w2q is None else w2q
  groups = Groups.of(group_sizes, shape.M)
  slots = () if gather is None else (gather.slot_of_row,)

  def on(implementation, reads_tokens: bool):
    def run(x, *a, history):
      kw = delayed.given(history)
      if slots and reads_tokens:
        kw["gather"] = (a[0], gather.row_of_slot.shape[1])
      elif slots:
        x = take_rows(x, a[0], gather.row_of_slot.shape[1])
      return implementation.forward(x, *a[len(slots):], act, recipe, shape, residuals, zero_padding, **kw)
    return lambda *a: run(*a[:-1], history=a[-1])

  platforms = _platforms(recipe)
  y, res = on_platforms(x, *slots, w1q, w2q, groups, b1, b2, scales, history, cpu=on(platforms["cpu"], False),
                        cuda=on(platforms["cuda"], cuda.reads_tokens(recipe, residuals)))
  return y, (res, groups, b1, b2, scales, gather, history)


def _mlp_bwd(act, recipe, shape, zero_padding, saved, dy):
  residuals, groups, b1, b2, scales, gather, history = saved

  def on(implementation):
    return lambda residuals, groups, b1, b2, scales, dy, history: implementation.backward(
        residuals, groups, b1, b2, scales, act, recipe, shape, dy, zero_padding, **delayed.given(history))

  dy = dy.astype(residuals[0].dtype)
  dx, dw1, dw2, db1, db2, dscales, *seen = on_platforms(
      residuals, groups, b1, b2, scales, dy, history, **{p: on(i) for p, i in _platforms(recipe).items()})
  if gather is not None:  # each token's rows' gradients summed
    dx, gather = dispatch.combine(dx, gather), Plan(None, None, None)
  new_history = None if history is None else delayed.updated(history, seen[0])
  return dx, gather, dw1, dw2, None, None, integer_cotangent(groups.given), db1, db2, dscales, new_history


_mlp.defvjp(_mlp_fwd, _mlp_bwd)
