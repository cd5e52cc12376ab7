"""grouped_mlp(tokens, ..., fp8=..., gather=plan): an FP8 recipe over the rows a dispatch plan takes from the
tokens equals, bit for bit, the recipe over jaxmlp.dispatch's rows (values and every gradient, x's summed over
each token's rows), and lies within the recipe's tolerance of its float64 model, on every platform. On a GPU
the tensorwise forward with FP8 weight gradients reads the rows from the tokens in its quantization passes
(the lowered call takes the T tokens); the other recipes take the rows first. Whatever a plan's slot_of_row
holds, a row is a token or zeros.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_cases import DTYPES, NUDGE, NUMPY_MODEL, platform, recipe_error  # noqa: F401  (the fixture)

import jaxmlp
from jaxmlp import dispatch

T, K, E = 300, 2, 5
RECIPES = {"tensorwise": jaxmlp.Fp8Recipe("tensorwise", fast_accumulation=False, when="always"),
           "tensorwise, 16-bit weight gradients": jaxmlp.Fp8Recipe("tensorwise", fast_accumulation=False,
                                                                   fp8_weight_gradients=False, when="always"),
           "blockwise": jaxmlp.Fp8Recipe("blockwise", when="always")}


def _operands(rng, dtype, d, f):
  cast = lambda a: jnp.asarray(a, dtype)
  p = np.array([0.5, 0.0, 0.25, 0.02, 0.23])  # expert 1 empty, expert 3 a few rows, expert 0 past 128 rows
  experts = jnp.asarray(np.stack([rng.choice(E, size=K, replace=False, p=p) for _ in range(T)]), jnp.int32)
  return (cast(rng.standard_normal((T, d))), cast(rng.standard_normal((E, d, 2 * f)) / np.sqrt(d)),
          cast(rng.standard_normal((E, f, d)) / np.sqrt(f)), experts)


def _reads_tokens(fn, operands, d, dtype) -> bool:
  """Whether fn's lowered FP8 forward call takes the T tokens (and not the M rows) as its first operand."""
  text = jax.jit(fn).lower(*operands).as_text()
  calls = [line for line in text.splitlines() if "jaxmlp_mlp_fp8_fwd" in line and "custom_call" in line]
  return any(f"tensor<{T}x{d}x{jnp.dtype(dtype).name.replace('float', 'f')}>" in call for call in calls)


@pytest.mark.matrix
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("dtype, f", [("bfloat16", 64), ("float16", 192)])
@pytest.mark.parametrize("capacity, pad_to", [(None, 1), (130, 16)])
def test_fp8_over_a_plan_equals_fp8_over_the_dispatched_rows(platform, rng, recipe, dtype, f,  # noqa: F811
                                                             capacity, pad_to):
  d, fp8 = 64, RECIPES[recipe]
  x, w1, w2, experts = _operands(rng, jnp.dtype(dtype), d, f)
  rows, sizes, plan = dispatch.dispatch(x, experts, E, capacity=capacity, pad_to=pad_to)
  M = rows.shape[0]
  scales = jnp.asarray(rng.uniform(0.1, 1.0, M), dtype)
  dy = jnp.asarray(rng.standard_normal((M, d)), dtype)

  def gathered(x, w1, w2, scales):
    return jaxmlp.grouped_mlp(x, w1, w2, sizes, scales=scales, fp8=fp8, gather=plan)

  def dispatched(x, w1, w2, scales):
    rows = dispatch.dispatch(x, experts, E, capacity=capacity, pad_to=pad_to)[0]
    return jaxmlp.grouped_mlp(rows, w1, w2, sizes, scales=scales, fp8=fp8)

  def run(fn):
    y, vjp = jax.vjp(fn, x, w1, w2, scales)
    return (y, *vjp(dy))

  got, want = jax.jit(lambda: run(gathered))(), jax.jit(lambda: run(dispatched))()
  for name, a, b in zip(["y", "dx", "dw1", "dw2", "dscales"], got, want):
    assert a.dtype == b.dtype, name
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), name)
  if platform == "cuda":  # the differentiated forward reads the tokens where the recipe does
    grad = lambda *a: jax.grad(lambda *a: gathered(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))(*a)
    assert _reads_tokens(grad, (x, w1, w2, scales), d, dtype) == (recipe == "tensorwise")

  # The recipe's float64 model over the rows; x's gradient each token's rows' summed. As check_against_model,
  # the model at nudge 0 or +-NUDGE (elements on an e4m3 rounding boundary, which float32 sums may put on
  # either side: at nudge 0 alone, dw2's largest element failed the tolerance for seed 2479878044).
  n = lambda a: np.asarray(a, np.float64)
  model = NUMPY_MODEL[fp8.name]
  kw = {} if fp8.fp8_weight_gradients is not False else dict(fp8_weight_gradients=False)
  token = np.asarray(plan.slot_of_row) // K
  failed = {}
  for nudge in (0.0, NUDGE, -NUDGE):
    want_y, want_g = model(n(rows), n(w1), n(w2), np.asarray(sizes), "swiglu", n(scales), n(dy), DTYPES[dtype],
                           nudge=nudge, **kw)
    want_dx = np.zeros((T, d))
    np.add.at(want_dx, token[token >= 0], want_g["x"][token >= 0])
    failed[nudge] = {name: e for name, a, b in [("y", got[0], want_y), ("x", got[1], want_dx),
                                                ("w1", got[2], want_g["w1"]), ("w2", got[3], want_g["w2"]),
                                                ("scales", got[4], want_g["scales"])]
                     if (e := recipe_error(a, b, platform)) is not None}
    if not failed[nudge]:
      break
  else:
    raise AssertionError(f"(relative, largest element's) errors past the tolerance, by nudge: {failed}")


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("blockwise", marks=pytest.mark.full)])
def test_any_slot_of_row_gathers_a_token_or_zeros(platform, rng, recipe):  # noqa: F811
  """A plan whose slot_of_row holds anything (past T k, negative, the int32 extremes), with group sizes that
  overrun the rows: the rows are the tokens their slots name (0 <= slot < T k: token slot // k) or zeros, as
  jaxmlp.dispatch.gather takes them, in the forward and the backward."""
  d, f, M = 64, 64, 400
  x, w1, w2, _ = _operands(rng, jnp.bfloat16, d, f)
  slots = rng.integers(-5, T * K + 40, M).astype(np.int32)
  slots[::7] = np.iinfo(np.int32).max
  slots[3::11] = np.iinfo(np.int32).min
  plan = jaxmlp.dispatch.Plan(jnp.zeros((T, K), jnp.int32), jnp.asarray(slots), jnp.zeros((E,), jnp.int32))
  sizes = jnp.asarray([150, 0, 7, 2**30, 5], jnp.int32)
  dy = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16)

  def run(fn):
    y, vjp = jax.vjp(fn, x, w1, w2)
    return (y, *vjp(dy))

  fp8 = RECIPES[recipe]
  got = jax.jit(lambda: run(lambda x, w1, w2: jaxmlp.grouped_mlp(x, w1, w2, sizes, fp8=fp8, gather=plan)))()
  want = jax.jit(lambda: run(lambda x, w1, w2: jaxmlp.grouped_mlp(dispatch.gather(x, plan), w1, w2, sizes,
                                                                  fp8=fp8)))()
  for name, a, b in zip(["y", "dx", "dw1", "dw2"], got, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), name)
  valid = (slots >= 0) & (slots < T * K)
  rows = np.where(valid[:, None], np.asarray(x, np.float64)[np.where(valid, slots, 0) // K], 0)
  want_y, _ = NUMPY_MODEL[recipe](rows, np.asarray(w1, np.float64), np.asarray(w2, np.float64), np.asarray(sizes),
                                  "swiglu", None, np.asarray(dy, np.float64), DTYPES["bfloat16"])
  assert recipe_error(got[0], want_y, platform) is None


def test_a_plan_of_no_choices(platform, rng):  # noqa: F811
  """k = 0 (padding rows alone, pad_to): zeros through FP8, x's gradient zeros."""
  x, w1, w2, _ = _operands(rng, jnp.bfloat16, 64, 64)
  _, sizes, plan = dispatch.dispatch(x, jnp.zeros((T, 0), jnp.int32), E, pad_to=16)
  y, vjp = jax.vjp(lambda x: jaxmlp.grouped_mlp(x, w1, w2, sizes, fp8=RECIPES["tensorwise"], gather=plan), x)
  assert y.shape == (E * 15, 64) and not np.asarray(y, np.float32).any()
  dx = vjp(jnp.ones_like(y))[0]
  assert dx.shape == x.shape and not np.asarray(dx, np.float32).any()
