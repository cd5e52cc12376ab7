"""The tensorwise recipe's delayed scaling (jaxmlp.fp8.delayed): every output and gradient against the float64
NumPy model quantizing by the history's amaxes (saturating past them), the history's update (the call's own
amaxes first, the older ones shifted), the history kept where a call runs in x's dtype, over a dispatch plan,
and the arguments' errors; on the CPU emulation and, where a GPU runs FP8, the CUDA path."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fp8_cases import (BLOCK_CASES, CASES, CUDA_TOLERANCE, DTYPES, check_against_model, inputs,
                       platform, run)  # noqa: F401 (a fixture)

import jaxmlp
import numpy_fp8_reference as fp8_ref
from jaxmlp import dispatch
from jaxmlp.fp8 import delayed

H = 3  # the histories' length
SEEN_TOLERANCE = 2e-2


def _delayed(**kw):
  return jaxmlp.Fp8Recipe("tensorwise", fast_accumulation=False, when="always", scaling="delayed", **kw)


# Past amaxes around each tensor's own (some below it: its largest elements saturate); none yet (zeros: the
# first call, each tensor by its own amax); or none for some tensors (x's and dh's rows empty).
HISTORIES = {
    "near": lambda own, rng: np.stack([own * rng.uniform(0.5, 1.5, 4) for _ in range(H)], axis=1),
    "zeros": lambda own, rng: np.zeros((4, H)),
    "some_empty": lambda own, rng: np.stack([own * rng.uniform(0.5, 1.5, 4) * [0, 1, 1, 0] for _ in range(H)],
                                            axis=1),
}


@pytest.mark.matrix
@pytest.mark.parametrize("case", ["uneven", pytest.param("skewed", marks=pytest.mark.full),
                                  pytest.param("all_empty", marks=pytest.mark.full),
                                  pytest.param("blocks", marks=pytest.mark.full)])
@pytest.mark.parametrize("history", list(HISTORIES))
@pytest.mark.parametrize("fp8_wgrad", [True, False])
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_delayed_scaling_follows_the_recipe(platform, rng, case, history, fp8_wgrad, act, dtype):
  """y and every gradient as the model computes them with x, a, dy and dh quantized by the largest of
  their past amaxes (their own where there is none); the history's gradient is the update: the call's own
  four amaxes, then the old ones."""
  check_follows_the_recipe(jaxmlp.grouped_mlp, platform, rng, case, history, fp8_wgrad, act, dtype)


@pytest.mark.parametrize("history", ["near", "some_empty"])
def test_the_reference_scales_by_the_history(rng, history):
  """jaxmlp.reference.grouped_mlp takes the history as jaxmlp.grouped_mlp does (the test above)."""
  with jax.default_device(jax.devices("cpu")[0]):
    check_follows_the_recipe(jaxmlp.reference.grouped_mlp, "cpu", rng, "uneven", history, True, "swiglu",
                             "bfloat16")


def check_follows_the_recipe(fn, platform, rng, case, history, fp8_wgrad, act, dtype):
  M, d, f, sizes = BLOCK_CASES[case]
  args, gs, dy = inputs(rng, M, d, f, sizes, act, jnp.dtype(dtype))
  n = {k: np.asarray(v, np.float64) for k, v in args.items() if v is not None}
  model = functools.partial(fp8_ref.grouped_mlp, n["x"], n["w1"], n["w2"], sizes, act, n.get("scales"),
                            np.asarray(dy, np.float64), DTYPES[dtype], fp8_weight_gradients=fp8_wgrad)
  own = model(delayed=np.zeros(4))[1]["seen"]
  past = HISTORIES[history](own, rng).astype(np.float32)
  given = past.max(axis=1)

  y, grads = run(fn, {**args, "fp8_history": jnp.asarray(past)}, gs, dy, act,
                 fp8=_delayed(fp8_weight_gradients=fp8_wgrad))
  new = np.asarray(grads.pop("fp8_history"))

  def without_seen(nudge):
    y, want = model(nudge=nudge, delayed=given)
    return y, {k: v for k, v in want.items() if k != "seen"}

  check_against_model(y, grads, without_seen, args, platform, M, sizes)
  np.testing.assert_array_equal(new[:, 1:], past[:, :-1])
  # a's, dy's and dh's amaxes come from h and da, whose elements sit on either side of a 16-bit rounding
  # boundary as the float32 sums fall (2^-8 of an element each, compounding through act'(h): seed 2696688901
  # put dh's 0.58% off on the CPU): SEEN_TOLERANCE; a wrong tensor's maximum is off by far more.
  tolerance = CUDA_TOLERANCE if platform == "cuda" else SEEN_TOLERANCE
  np.testing.assert_allclose(new[:, 0], model(delayed=given)[1]["seen"], rtol=tolerance, atol=1e-30)
  assert new[0, 0] == np.float32(own[0])  # x's amax: its own elements, exactly


def test_delayed_scaling_takes_the_own_amax_where_the_history_has_no_positive_one(platform, rng):
  """Rows of NaN or negative values (not an amax) count as empty: those tensors are quantized by their own
  amax, as with rows of zeros, on every platform."""
  M, d, f, sizes = CASES["uneven"]
  args, gs, dy = inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16)
  filled = jnp.asarray(rng.uniform(0.5, 4.0, (4, H)), jnp.float32)
  odd = filled.at[0].set(jnp.nan).at[3].set(-1.0)
  empty = filled.at[0].set(0.0).at[3].set(0.0)
  results = [run(jaxmlp.grouped_mlp, {**args, "fp8_history": h}, gs, dy, "swiglu", fp8=_delayed())
             for h in (odd, empty)]
  for k in {"y": 0, **results[0][1]}:
    if k == "fp8_history":
      continue
    got, want = ((r[0] if k == "y" else r[1][k]) for r in results)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), k)


def test_delayed_scaling_saturates_past_the_given_amax(platform, rng):
  """Every element past the history's amax quantizes to +-448: x's products equal those of x clipped to it."""
  M, d, f, sizes = CASES["uneven"]
  args, gs, _ = inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16, scales=False)
  x = args["x"]
  bound = float(np.float32(np.abs(np.asarray(x, np.float32)).max() / 4))
  past = jnp.zeros((4, 1), jnp.float32).at[:, 0].set(jnp.array([bound, 1e30, 1e30, 1e30]))
  call = lambda x, past: jaxmlp.grouped_mlp(x, args["w1"], args["w2"], gs, fp8=_delayed(), fp8_history=past)
  clipped = jnp.clip(x, -bound, bound).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(call(x, past), np.float32), np.asarray(call(clipped, past), np.float32))


def test_delayed_history_is_kept_where_the_call_runs_in_x_dtype(platform, rng):
  """when="faster" at a few rows per expert runs the call in x's dtype: x's dtype's results, and the history
  comes back as it went in (nothing was quantized, nothing observed)."""
  M, d, f, sizes = CASES["uneven"]
  args, gs, dy = inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16)
  recipe = jaxmlp.Fp8Recipe("tensorwise", when="faster", scaling="delayed")
  past = jnp.asarray(rng.uniform(0.5, 2.0, (4, H)), jnp.float32)
  y, grads = run(jaxmlp.grouped_mlp, {**args, "fp8_history": past}, gs, dy, "swiglu", fp8=recipe)
  want_y, want = run(jaxmlp.grouped_mlp, args, gs, dy, "swiglu")
  np.testing.assert_array_equal(np.asarray(grads.pop("fp8_history")), np.asarray(past))
  for k, got in {"y": y, **grads}.items():
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray({"y": want_y, **want}[k], np.float32), k)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_delayed_scaling_over_a_plan_equals_it_over_the_dispatched_rows(platform, rng, dtype):
  """Over a dispatch plan (on a GPU the forward's passes read the rows from the tokens and observe x's amax
  there): the results, the gradients and the updated history of the call over jaxmlp.dispatch's rows."""
  T, K, E, d, f = 200, 2, 4, 32, 64
  x = jnp.asarray(rng.standard_normal((T, d)), dtype)
  w1 = jnp.asarray(rng.standard_normal((E, d, 2 * f)) / np.sqrt(d), dtype)
  w2 = jnp.asarray(rng.standard_normal((E, f, d)) / np.sqrt(f), dtype)
  experts = jnp.asarray(np.stack([rng.choice(E, size=K, replace=False, p=[0.6, 0.0, 0.3, 0.1]) for _ in range(T)]),
                        jnp.int32)
  rows, sizes, plan = dispatch.dispatch(x, experts, E, capacity=90, pad_to=16)
  dy = jnp.asarray(rng.standard_normal(rows.shape), dtype)
  past = jnp.asarray(rng.uniform(0.5, 4.0, (4, H)), jnp.float32)

  def call(gathered):
    def fn(x, w1, w2, past):
      rows = x if gathered else dispatch.dispatch(x, experts, E, capacity=90, pad_to=16)[0]
      return jaxmlp.grouped_mlp(rows, w1, w2, sizes, fp8=_delayed(), fp8_history=past,
                                gather=plan if gathered else None)
    y, vjp = jax.vjp(fn, x, w1, w2, past)
    return (y, *vjp(dy))

  for got, want in zip(jax.jit(lambda: call(True))(), jax.jit(lambda: call(False))()):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_delayed_scaling_over_micro_batches_in_one_gradient(platform, rng):
  """Micro-batches mapped in one differentiated function, each given the same history as a row of its own
  (jaxmlp.fp8.delayed): the largest of their updates is the history updated by the largest amaxes any of
  them observed, and each micro-batch's results are those of its call alone."""
  M, d, f, sizes = CASES["uneven"]
  batches = [inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16, scales=False) for _ in range(3)]
  (w1, w2), gs = (batches[0][0]["w1"], batches[0][0]["w2"]), batches[0][1]
  xs, dys = jnp.stack([b[0]["x"] for b in batches]), jnp.stack([b[2] for b in batches])
  past = jnp.asarray(rng.uniform(0.5, 4.0, (4, H)), jnp.float32)
  call = lambda x, h: jaxmlp.grouped_mlp(x, w1, w2, gs, fp8=_delayed(), fp8_history=h)

  @jax.jit
  def mapped(xs, dys, past):
    def each(args):
      x, dy, h = args
      y, vjp = jax.vjp(call, x, h)
      return y, vjp(dy)[1]
    ys, updates = jax.lax.map(each, (xs, dys, jnp.broadcast_to(past, (len(batches), *past.shape))))
    return ys, jnp.max(updates, axis=0)

  ys, new = mapped(xs, dys, past)
  alone = [jax.jit(lambda x, dy: (lambda y, vjp: (y, vjp(dy)[1]))(*jax.vjp(call, x, past)))(x, dy)
           for x, dy in zip(xs, dys)]
  for y, (want, _) in zip(ys, alone):
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
  largest = np.max([np.asarray(update)[:, 0] for _, update in alone], axis=0)
  np.testing.assert_array_equal(np.asarray(new), np.concatenate([largest[:, None], np.asarray(past)[:, :-1]], 1))


def test_a_shared_history_takes_the_largest_update(rng):
  """delayed.shared(h, n): n copies of h forward; backward, the element-wise maximum of the n cotangents (the
  calls' updates), where a broadcast's would be their sum."""
  h = jnp.asarray(rng.uniform(0.5, 2.0, (4, H)), jnp.float32)
  updates = jnp.asarray(rng.uniform(0.0, 4.0, (3, 4, H)), jnp.float32)
  rows, vjp = jax.vjp(lambda h: delayed.shared(h, 3), h)
  np.testing.assert_array_equal(rows, np.broadcast_to(np.asarray(h), (3, 4, H)))
  np.testing.assert_array_equal(vjp(updates)[0], np.asarray(updates).max(axis=0))


def test_an_empty_problem_keeps_the_history(rng):
  """No rows (M 0): nothing is quantized or observed, in jaxmlp.grouped_mlp and the reference alike; the
  history comes back unchanged."""
  w1, w2 = jnp.ones((2, 16, 64), jnp.bfloat16), jnp.ones((2, 32, 16), jnp.bfloat16)
  past = jnp.asarray(rng.uniform(0.5, 2.0, (4, H)), jnp.float32)
  for fn in (jaxmlp.grouped_mlp, jaxmlp.reference.grouped_mlp):
    call = lambda x, h: fn(x, w1, w2, jnp.zeros((2,), jnp.int32), fp8=_delayed(), fp8_history=h)
    y, vjp = jax.vjp(call, jnp.zeros((0, 16), jnp.bfloat16), past)
    assert y.shape == (0, 16)
    np.testing.assert_array_equal(vjp(y)[1], past)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(fp8=jaxmlp.Fp8Recipe("tensorwise", scaling="delayed")), ValueError, "fp8_history: the recipe's scaling"),
    (dict(fp8="tensorwise", fp8_history=jnp.zeros((4, 2), jnp.float32)), ValueError, "does not scale by an amax"),
    (dict(fp8_history=jnp.zeros((4, 2), jnp.float32)), ValueError, "does not scale by an amax"),
    (dict(fp8=_delayed(), fp8_history=jnp.zeros((4, 2), jnp.bfloat16)), TypeError, "fp8_history: dtype bfloat16"),
    (dict(fp8=_delayed(), fp8_history=jnp.zeros((3, 2), jnp.float32)), ValueError, r"fp8_history: shape \[3, 2\]"),
    (dict(fp8=_delayed(), fp8_history=jnp.zeros((4, 0), jnp.float32)), ValueError, r"fp8_history: shape \[4, 0\]"),
])
def test_delayed_scaling_bad_arguments(kwargs, error, match):
  x, w1, w2 = jnp.zeros((32, 16), jnp.bfloat16), jnp.zeros((2, 16, 32), jnp.bfloat16), jnp.zeros((2, 16, 16),
                                                                                                 jnp.bfloat16)
  with pytest.raises(error, match=match):
    jaxmlp.grouped_mlp(x, w1, w2, jnp.array([16, 16], jnp.int32), **kwargs)


def test_delayed_scaling_is_the_tensorwise_recipes():
  with pytest.raises(ValueError, match="scaling='delayed' is the tensorwise recipe's"):
    jaxmlp.Fp8Recipe("blockwise", scaling="delayed")
  with pytest.raises(ValueError, match="scaling='late'; expected one of current, delayed"):
    jaxmlp.Fp8Recipe("tensorwise", scaling="late")
  with pytest.raises(ValueError, match="length must be a positive integer"):
    jaxmlp.fp8_history(0)
  assert jaxmlp.fp8_history(5).shape == (4, 5) and jaxmlp.fp8_history().dtype == jnp.float32
