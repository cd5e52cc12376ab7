"""Delayed scaling of the tensorwise recipe's activations: the amax history a call scales by and updates.

With `Fp8Recipe("tensorwise", scaling="delayed")` a grouped_mlp call quantizes x, a = act(h) * scales, dy and
dh with the scales of amaxes known before it starts, the largest of each tensor's last H observed amaxes
(TransformerEngine's DelayedScaling with amax_compute_algo="max"), rather than with their own: the passes that
quantize them then observe their amaxes as they go, and the amax passes that current scaling runs before each
quantization are gone (two of the forward's passes over x and h, two of the backward's over dy, h and da).
An element past the delayed scale's range saturates at +-448 (e4m3's largest).

The state is one float32 array [4, H], the rows x, a, dy, dh and the columns the last H calls' amaxes, newest
first (`history(H)`: zeros). A tensor whose row holds no amax yet (all 0: the first call) is quantized by
its own, as current scaling does, in two passes (TransformerEngine's first step quantizes by scale 1, which
flushes small gradients to zero). A call reads the history and its gradient is the updated history: the
call's four observed amaxes in column 0, the older ones shifted right, the oldest dropped. That is the
convention of Flax's `_overwrite_with_gradient` collection and of TransformerEngine's JAX FP8 metadata: the
new state is taken as the gradient, not added to the old one. One history per call: reused by two calls of
one differentiated function, JAX would add their two updates. Calls that share one history (micro-batches
mapped in one differentiated function, the chunks or devices of an expert-parallel layer) each take a row of
`shared(h, n)`, whose gradient is the largest of their n updates: the same older columns, and in column 0 the
largest amax any of them observed. A call that runs in x's dtype (the recipe's `when`) gives the history
back unchanged.

The weights keep their own scales (jaxmlp.fp8_weights: current; jaxmlp.fp8_adam_step: delayed by one step).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

TENSORS = ("x", "a", "dy", "dh")  # the history's rows


def history(length: int = 16) -> jax.Array:
  """A new amax history of `length` calls for one grouped_mlp call site: zeros, float32 [4, length]."""
  if not isinstance(length, (int, np.integer)) or isinstance(length, bool) or length < 1:
    raise ValueError(f"fp8 history: length must be a positive integer, got {length!r}")
  return jnp.zeros((len(TENSORS), int(length)), jnp.float32)


def amaxes(h: jax.Array) -> jax.Array:
  """The amaxes [4] a call scales x, a, dy and dh by: each row's largest, or 0 (the tensor's own amax) where
  that is not a positive number (an empty row, or one a caller filled with NaN or negative values)."""
  m = jnp.max(h, axis=1)
  return jnp.where(m > 0, m, 0.0).astype(jnp.float32)


def given(h: jax.Array | None) -> dict:
  """The recipes' implementations' keyword for a history: the amaxes to scale by (`delayed`), or nothing
  (current scaling)."""
  return {} if h is None else dict(delayed=amaxes(h))


def updated(h: jax.Array, seen: jax.Array) -> jax.Array:
  """The history after a call that observed the amaxes `seen` [4]: newest first, the oldest dropped."""
  return jnp.concatenate([seen.astype(jnp.float32)[:, None], h[:, :-1]], axis=1)


def check(fp8_history, scaling: str | None) -> None:
  """grouped_mlp's fp8_history for a call whose recipe scales its activations by `scaling` (None: no FP8
  recipe): given exactly where the scaling is delayed, float32 [4, H] with H >= 1."""
  if scaling != "delayed":
    if fp8_history is not None:
      raise ValueError("fp8_history: given, but the call's FP8 recipe does not scale by an amax history; pass "
                       "fp8=jaxmlp.Fp8Recipe('tensorwise', scaling='delayed')")
    return
  if fp8_history is None:
    raise ValueError("fp8_history: the recipe's scaling is 'delayed', which scales by an amax history: pass "
                     "fp8_history=jaxmlp.fp8_history() (float32 [4, H]) and take its gradient as the next one")
  shape, dtype = np.shape(fp8_history), jnp.result_type(fp8_history)
  if dtype != jnp.float32:
    raise TypeError(f"fp8_history: dtype {dtype} is not supported; expected float32 [4, H]")
  if len(shape) != 2 or shape[0] != len(TENSORS) or shape[1] < 1:
    raise ValueError(f"fp8_history: shape {list(shape)}, expected [4, H] with H >= 1 (rows x, a, dy, dh)")


@jax.custom_vjp
def unchanged(y: jax.Array, h: jax.Array) -> jax.Array:
  """y, with the history h beside it: h's gradient is h itself (a call that runs without FP8 observes
  nothing and leaves the history as it was)."""
  return y


def _unchanged_fwd(y, h):
  return y, h


def _unchanged_bwd(h, dy):
  return dy, h


unchanged.defvjp(_unchanged_fwd, _unchanged_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def shared(h: jax.Array, n: int) -> jax.Array:
  """The history h for n calls that each observe a part of the tensors: n copies [n, 4, H], one a call,
  whose gradient is the largest of their n updates (each call's amaxes are those of its part; the largest
  is the amax of the whole). Its sum, JAX's transpose of a broadcast, would add the older columns n times.
  The n calls run alike, all in FP8 or all in x's dtype (calls of one shape do): the maximum of a shifted
  update and an unchanged history would mix their columns."""
  return jnp.broadcast_to(h, (n, *h.shape))


def _shared_fwd(h, n):
  return shared(h, n), None


def _shared_bwd(n, _, updates):
  return (jnp.max(updates, axis=0),)


shared.defvjp(_shared_fwd, _shared_bwd)
