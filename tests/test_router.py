"""jaxmlp.moe.router_logits against float64: bfloat16 tokens through split bfloat16 products."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmlp.moe import router_logits


def product_error(got, a, b):
  """The largest error of got against the float64 product a @ b, each element's relative to the sum of its
  terms' magnitudes (|a| @ |b|): a product's rounding bound, which cancellation does not inflate."""
  return np.max(np.abs(np.asarray(got, np.float64) - a @ b) / (np.abs(a) @ np.abs(b)))


@pytest.mark.parametrize("T,d,E", [(512, 256, 64), (100, 72, 5), (1, 8, 1)])
def test_router_logits_of_bfloat16_tokens_hold_16_bits(rng, T, d, E):
  x = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
  kernel = jnp.asarray(rng.standard_normal((d, E)) * 0.05, jnp.float32)
  g = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
  # Under jit, where XLA may drop a rounding round trip (jaxmlp.moe._halves).
  logits, (dx, dkernel) = jax.jit(lambda x, w, g: (router_logits(x, w), jax.vjp(router_logits, x, w)[1](g)))(
      x, kernel, g)
  assert logits.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dkernel.dtype == jnp.float32
  X, W, G = (np.asarray(a, np.float64) for a in (x, kernel, g))
  # At most ~2^-17 measured (200 seeds of the tiny case); a bfloat16 kernel (or a lost low half) gives
  # ~2^-10.5 at the larger cases.
  assert product_error(logits, X, W) < 2**-14
  assert product_error(dkernel, X.T, G) < 2**-14
  # dx is rounded to bfloat16: nearly every element is float64's rounded (half of them with the gradient or
  # the kernel in bfloat16), counted where there are enough elements for a share (on an H200 the 8 of the
  # tiny case lay within one bfloat16 step, 6 of them float64's rounded).
  want_dx = G @ W.T
  assert product_error(dx, G, W.T) < 2**-8
  if dx.size >= 1000:
    assert np.mean(np.asarray(dx, np.float64) == np.asarray(jnp.asarray(want_dx, jnp.bfloat16), np.float64)) > 0.97


def test_router_logits_of_other_dtypes_are_one_float32_product(rng):
  x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
  np.testing.assert_array_equal(router_logits(x, kernel), jnp.dot(x, kernel))
  x16 = x.astype(jnp.float16)
  np.testing.assert_array_equal(router_logits(x16, kernel), jnp.dot(x16.astype(jnp.float32), kernel))


def test_router_logits_rejects_bad_shapes():
  x = jnp.zeros((4, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match=re.escape("tokens: got shape (4, 8, 1), expected [T, d]")):
    router_logits(x[..., None], jnp.zeros((8, 2)))
  with pytest.raises(ValueError, match=re.escape("kernel: got shape (7, 2), expected [d, E] = [8, E]")):
    router_logits(x, jnp.zeros((7, 2)))
