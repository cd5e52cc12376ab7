"""The expert-parallel layer's gathers in e4m3: half the bytes of 16-bit rows on the links.

With FP8 experts, jaxmlp.expert_parallel's all-gather exchange gathers the tokens (forward) and their
output gradients (backward, the transpose of the partial sums' reduce-scatter) as e4m3 bytes with their
scales: each row is quantized once, on the device that sends it, in the blockwise recipe's 1 x 128 blocks
with power-of-two scales (jaxmlp.fp8.blockwise.quantize_rows), and dequantized on arrival into its dtype,
exactly: an e4m3 value times a power of two, rounded from a bfloat16 or float32 value, is one again,
except where the rounding reaches the dtype's top: values from 1.9375 * 2^127 (3.3e38) arrive as
infinities. In float16 that band starts at 63488, within reach of 16-bit training's values: float16 rows
gather as they are. A block holding an infinity arrives non-finite (infinities and NaN), so an overflow
stays visible, where the recipes' own quantizers would clamp it to 448.

With the blockwise recipe, whose FC1 quantizes x in the same blocks, the forward's FC1 operand is then the
one-device layer's bit for bit (an exactly dequantized block quantizes again to the same values); the
weight gradients' 128 x 1 blocks and the tensorwise recipe quantize the dequantized rows once more. The
partial sums' reduce-scatter, forward and backward, stays in the computation dtype: sums of e4m3 terms
would lose what the accumulation keeps.

Gradients pass straight through the quantization, as through the recipes' own: the forward gather's
transpose is the plain reduce-scatter of the rows' gradients.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import blockwise

INFINITE = 256  # an exponent whose halves' powers of two overflow float32 (blockwise.times_pow2): 2^128 each


def _gathered_e4m3(v, axis):
  """The e4m3 gather: one all_gather of each row's bytes and exponents packed together (a collective of
  uint8: any NCCL), dequantized on arrival."""
  rows, columns = v.shape
  q, e = _quantized_rows(v)
  packed = jnp.concatenate([jax.lax.bitcast_convert_type(q, jnp.uint8),
                            jax.lax.bitcast_convert_type(e, jnp.uint8).reshape(rows, -1)], axis=1)
  packed = jax.lax.all_gather(packed, axis, tiled=True)
  q = jax.lax.bitcast_convert_type(packed[:, :columns], jnp.float8_e4m3fn)
  e = jax.lax.bitcast_convert_type(packed[:, columns:].reshape(packed.shape[0], -1, 4), jnp.int32)
  return blockwise.dequantize_rows(q, e).astype(v.dtype)


def _quantized_rows(v):
  """blockwise.quantize_rows(v), but for a block holding an infinity, whose exponent is INFINITE (its 2^e,
  an infinity, makes it non-finite again on arrival)."""
  q, e = blockwise.quantize_rows(v)
  return q, jnp.where(jnp.any(jnp.isinf(blockwise.row_blocks(v)), axis=2), INFINITE, e)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather(v: jax.Array, axis: str) -> jax.Array:
  """jax.lax.all_gather(v, axis, tiled=True) of bfloat16 or float32 v [R, C] (C a multiple of 16), its rows
  crossing the links in e4m3 with their blocks' exponents (module docstring)."""
  return _gathered_e4m3(v, axis)


def _gather_fwd(v, axis):
  return _gathered_e4m3(v, axis), None


def _gather_bwd(axis, _, ct):
  return (jax.lax.psum_scatter(ct, axis, tiled=True),)


gather.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def scatter_sum(v: jax.Array, axis: str) -> jax.Array:
  """jax.lax.psum_scatter(v, axis, tiled=True) in v's dtype, whose transpose (the backward's gather of
  the cotangent) crosses the links in e4m3 (module docstring), unless v is float16."""
  return jax.lax.psum_scatter(v, axis, tiled=True)


def _scatter_sum_fwd(v, axis):
  return scatter_sum(v, axis), None


def _scatter_sum_bwd(axis, _, ct):
  if ct.dtype == jnp.float16:  # float16's values from 63488 would arrive as infinities: gathered as they are
    return (jax.lax.all_gather(ct, axis, tiled=True),)
  return (_gathered_e4m3(ct, axis),)


scatter_sum.defvjp(_scatter_sum_fwd, _scatter_sum_bwd)
