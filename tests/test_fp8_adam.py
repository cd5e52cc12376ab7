"""jaxmlp.fp8_adam_step: optax's adam (adamw) step of float32 master weights, and the new weights quantized for
the blockwise recipe or, by the last weights' maximum, the tensorwise one: against adam in float32 NumPy (each
operation rounded once), optax itself, and the recipes' quantizations in NumPy."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import gpus
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxmlp
import jaxmlp.linen
import jaxmlp.nnx
import numpy_fp8_reference as fp8_ref
from fp8_cases import DTYPES, fp8_reason, platform  # noqa: F401  (the fixture)

# (E, K, N): whole tiles, and tiles cut short by K and N (multiples of 16, not of 128; K 208 cuts the tensorwise
# kernel's third 32-row block of a tile in half).
SHAPES = {"whole": (2, 256, 128), "cut": (3, 208, 272)}
HYPER = {"adam": dict(learning_rate=1e-3),
         "adamw": dict(learning_rate=3e-4, b1=0.8, b2=0.95, eps=1e-6, eps_root=1e-12, weight_decay=0.1)}


def numpy_adam(w, g, mu, nu, t, learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.0):
  """optax.adam's (adamw's) step in float32 NumPy, each operation rounded once, the bias corrections as optax
  computes them, 1 - b^t of b^t in float32 (here its correct rounding): (w, mu, nu), and for each the
  magnitude of the terms it sums, to which an implementation's roundings are relative. An implementation
  may fuse a multiply and an add (XLA's CPU and GPU code do) and round b^t otherwise (XLA's power), which
  1 - b^t magnifies b^t / (1 - b^t) times (the square root halves b2's): the step's magnitude counts that."""
  f = np.float32
  terms_mu, terms_nu = np.abs(f(1 - b1) * g) + np.abs(f(b1) * mu), np.abs(f(1 - b2) * (g * g)) + np.abs(f(b2) * nu)
  powers = [f(np.float64(f(b)) ** t) for b in (b1, b2)]
  c1, c2 = (f(1) - p for p in powers)
  mu = f(1 - b1) * g + f(b1) * mu
  nu = f(1 - b2) * (g * g) + f(b2) * nu
  denominator = np.sqrt(nu / c2 + f(eps_root)) + f(eps)
  u, terms_u = (mu / c1) / denominator, (terms_mu / c1) / denominator  # u's error: relative to mu's terms
  if weight_decay:
    u, terms_u = u + f(weight_decay) * w, terms_u + np.abs(f(weight_decay) * w)
  step = u * f(-learning_rate)
  conditioning = 1 + powers[0] / c1 + powers[1] / c2 / 2
  terms_w = np.abs(w) + np.abs(step) + terms_u * f(learning_rate) * conditioning
  return (w + step, mu, nu), (terms_w, terms_mu, terms_nu)


def assert_rounded_alike(got, want, terms, roundings):
  """got equals want up to `roundings` float32 roundings (half an ulp each) of the magnitude `terms`."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  excess = np.abs(got - want) - roundings * 2.0**-24 * np.asarray(terms, np.float64)
  assert excess.max() <= 0, f"{np.sum(excess > 0)} elements past {roundings} roundings, worst at {np.argmax(excess)}"


# The roundings an implementation may differ from numpy_adam by, relative to the terms of w, mu and nu: a
# fused multiply-add skips one of the moments' three roundings; the step (against |w| + |step|) carries the
# moments' and its own seven (two divisions, a square root, two additions, a product, the bias corrections).
ROUNDINGS = (16, 4, 4)


def numpy_weight_blocks(w):
  """The blockwise recipe's 128 x 128 quantization of w (in the computation dtype) in NumPy: (dequantized
  values, exponents [E, K / 128, N / 128])."""
  E, K, N = w.shape
  B = fp8_ref.BLOCK
  exponents = np.zeros((E, -(-K // B), -(-N // B)), np.int32)
  for g in range(E):
    for i in range(0, K, B):
      for j in range(0, N, B):
        exponents[g, i // B, j // B] = np.log2(fp8_ref._block_scale(np.abs(w[g, i:i + B, j:j + B]).max()))
  return fp8_ref._weights_128x128(w), exponents


def adam_inputs(rng, shape, count):
  """Weights of magnitudes 2^-8 to 2^4 by 128 x 128 tile (each tile its own scale), a nonzero gradient, and
  moments as after some steps (nu >= 0); but the first tile all zeros, weights, gradient and first moment
  (its update is zero: a tile of amax 0)."""
  E, K, N = shape
  tiles = 2.0 ** rng.integers(-8, 5, (E, -(-K // 128), -(-N // 128)))
  w = rng.standard_normal(shape) * np.repeat(np.repeat(tiles, 128, axis=1), 128, axis=2)[:, :K, :N]
  g = rng.standard_normal(shape) * 1e-2 + 1e-3
  mu = rng.standard_normal(shape) * 1e-2
  nu = rng.uniform(0, 1e-4, shape)
  for v in (w, g, mu):
    v[0, :128, :128] = 0
  state = optax.ScaleByAdamState(count=jnp.int32(count), mu=jnp.float32(mu), nu=jnp.float32(nu))
  return jnp.float32(w), jnp.float32(g), state


def check_fp8_weights(fp8, new_w, dtype, delayed=None):
  """fp8 against NumPy's quantization of new_w in the computation dtype, bit for bit: blockwise, the values
  and exponents (numpy_weight_blocks); tensorwise (delayed: the maximum it was quantized by), its values by
  that maximum, the scale and the new weights' own maximum. Both: the transposed copy."""
  assert fp8.recipe == ("blockwise" if delayed is None else "tensorwise")
  np.testing.assert_array_equal(np.asarray(fp8.weights), np.asarray(new_w))
  rounded = np.asarray(new_w).astype(DTYPES[dtype]).astype(np.float64)
  if delayed is None:
    values, exponents = numpy_weight_blocks(rounded)
    np.testing.assert_array_equal(np.asarray(fp8.scales), exponents)
    scale = np.repeat(np.repeat(2.0 ** exponents, 128, axis=1), 128, axis=2)[:, :rounded.shape[1], :rounded.shape[2]]
    np.testing.assert_array_equal(np.asarray(fp8.q).astype(np.float64) * scale, values)
    assert fp8.amax is None
  else:
    np.testing.assert_array_equal(np.asarray(fp8.q).astype(np.float64), fp8_ref._quantize(rounded, delayed))
    assert np.asarray(fp8.scales) == np.float32(delayed) and np.asarray(fp8.amax) == np.abs(rounded).max()
  np.testing.assert_array_equal(np.asarray(fp8.qt).view(np.uint8), np.swapaxes(np.asarray(fp8.q).view(np.uint8), 1, 2))


def tensorwise_before(w, dtype, fraction=1.0):
  """The tensorwise Fp8Weights of w that a step takes its delayed maximum from: jaxmlp.fp8_weights', its
  maximum scaled by `fraction` (below 1: the new weights' largest elements saturate)."""
  fp8 = jaxmlp.fp8_weights(w, "tensorwise", dtype)
  return dataclasses.replace(fp8, amax=jnp.float32(np.float32(fp8.amax) * np.float32(fraction)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("hyper", HYPER)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grad", ["float32", "16-bit"])
@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_fp8_adam_step_is_adam_then_the_fp8_weights(platform, rng, shape, hyper, dtype, grad,  # noqa: F811
                                                     recipe):
  """The new weights and moments equal NumPy's float32 adam up to a few roundings (fused multiply-adds, XLA's
  power against NumPy's); the FP8 weights are the NumPy quantization of the new weights as returned, in the
  computation dtype, bit for bit (check_fp8_weights): tensorwise by a delayed maximum half the last weights',
  so that the largest new weights saturate at +-448. The gradient float32 or in the computation dtype (taken
  as its float32 value). The quantized outputs are poisoned; w, mu and nu are updated in place, where an
  element left unwritten keeps its old value, which the update moves (but in the zero tile)."""
  count = int(rng.integers(0, 50))
  w, g, state = adam_inputs(rng, SHAPES[shape], count)
  if grad == "16-bit":
    g = g.astype(dtype)
  kw = dict(HYPER[hyper], dtype=jnp.dtype(dtype))
  before = tensorwise_before(w, dtype, 0.5) if recipe == "tensorwise" else recipe
  new_w, new_state, fp8 = jax.jit(lambda w, g, s, f: jaxmlp.fp8_adam_step(w, g, s, **kw, fp8=f),
                                  static_argnums=3 if recipe == "blockwise" else ())(w, g, state, before)
  want, terms = numpy_adam(*(np.asarray(v, np.float32) for v in (w, g, state.mu, state.nu)), count + 1,
                           **HYPER[hyper])
  for got, expected, magnitude, roundings in zip((new_w, new_state.mu, new_state.nu), want, terms, ROUNDINGS):
    assert_rounded_alike(got, expected, magnitude, roundings)
  assert int(new_state.count) == count + 1 and isinstance(new_state, optax.ScaleByAdamState)
  check_fp8_weights(fp8, new_w, dtype, None if recipe == "blockwise" else np.float32(before.amax))
  if recipe == "tensorwise":  # the test reaches the saturation
    assert np.any(np.abs(np.asarray(fp8.q, np.float32)) == 448)


@pytest.mark.parametrize("case", ["zero weights", "all zeros"])
def test_fp8_adam_step_tensorwise_from_a_zero_maximum(platform, rng, case):  # noqa: F811
  """Weights initialised to zeros: their maximum, 0, quantizes the first step's new weights by scale 1 (as
  a zero amax does in tensorwise.quantize_e4m3; most round to e4m3's subnormals or 0), NumPy's quantization
  bit for bit, and the result's maximum is that of the new weights. With a zero gradient and moments as well
  nothing moves: every output 0, the new maximum 0 (the kernel's zeroed maximum, no tile's atomic)."""
  shape = (2, 144, 272)
  w = jnp.zeros(shape, jnp.float32)
  g = jnp.zeros(shape, jnp.float32) if case == "all zeros" else jnp.float32(rng.standard_normal(shape) * 1e-2)
  before = jaxmlp.fp8_weights(w, "tensorwise", jnp.bfloat16)
  assert np.asarray(before.amax) == 0
  new_w, _, fp8 = jax.jit(lambda w, g, s, f: jaxmlp.fp8_adam_step(w, g, s, learning_rate=1e-3, fp8=f))(
      w, g, optax.scale_by_adam().init(w), before)
  check_fp8_weights(fp8, new_w, "bfloat16", np.float32(0))
  if case == "all zeros":
    assert not np.any(np.asarray(new_w)) and not np.any(np.asarray(fp8.q, np.float32)) and np.asarray(fp8.amax) == 0
  else:
    assert np.any(np.asarray(fp8.q, np.float32)) and np.asarray(fp8.amax) > 0


@pytest.mark.parametrize("hyper", HYPER)
@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_fp8_adam_step_equals_optax_over_steps(platform, rng, hyper, recipe):  # noqa: F811
  """Three steps, each fed the last one's state (and donated: on a GPU the kernel writes in place), against
  optax.adam's (optax.adamw's): the same weights, moments and counts up to a few roundings (module
  ROUNDINGS), and FP8 weights that equal jaxmlp.fp8_weights of the new weights (blockwise) or their
  quantization by the last step's maximum, starting from jaxmlp.fp8_weights' (tensorwise)."""
  w, g, _ = adam_inputs(rng, SHAPES["cut"], 0)
  kw = HYPER[hyper]
  tx = optax.adamw(**kw) if "weight_decay" in kw else optax.adam(**kw)
  opt_state = tx.init(w)
  state = opt_state[0]
  fp8 = jaxmlp.fp8_weights(w, "tensorwise", jnp.bfloat16) if recipe == "tensorwise" else None
  step = jax.jit(lambda w, g, s, f: jaxmlp.fp8_adam_step(w, g, s, **kw, fp8=recipe if f is None else f),
                 donate_argnums=(0, 2))
  want = w
  for i in range(3):
    g_i = g * (i + 1)
    _, terms = numpy_adam(*map(np.asarray, (want, g_i, opt_state[0].mu, opt_state[0].nu)), i + 1, **kw)
    updates, opt_state = tx.update(g_i, opt_state, want)
    want = optax.apply_updates(want, updates)
    delayed = None if fp8 is None else np.float32(fp8.amax)
    w, state, fp8 = step(w, g_i, state, fp8)
    for got, expected, magnitude, roundings in zip((w, state.mu, state.nu), (want, *opt_state[0][1:]), terms,
                                                   ROUNDINGS):
      assert_rounded_alike(got, expected, magnitude, 2 * roundings)  # both sides' roundings
    assert int(state.count) == int(opt_state[0].count) == i + 1
    check_fp8_weights(fp8, w, "bfloat16", delayed)
    fp8 = fp8 if recipe == "tensorwise" else None


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_fp8_adam_step_feeds_grouped_mlp(rng, recipe):
  """A training step as docs/fp8.md gives it: the loss reads the last step's FP8 weights (Fp8Weights carried
  without their weights) with the master weights differentiated in their `weights` field; its gradient
  reaches the master weights, and the results equal those of the same jitted program given NumPy's
  quantization of the weights by the same maximum (blockwise: those of quantizing the master weights in the
  call), and the last step's scale is its input's maximum, its amax its output's. A program that differs (the
  quantization as constants) may round h's scaling otherwise: CI's seed 3249744517 moved 2% of a gradient's
  elements by a bfloat16 ulp."""
  E, d, f, M = 2, 128, 128, 256
  x = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16)
  w1 = jnp.float32(rng.standard_normal((E, d, 2 * f)) / np.sqrt(d))
  w2 = jnp.float32(rng.standard_normal((E, f, d)) / np.sqrt(f))
  sizes = jnp.array([100, 156], jnp.int32)
  fp8 = jaxmlp.Fp8Recipe(recipe, when="always")

  def loss(w1, w2, q1, q2):
    w1, w2 = dataclasses.replace(q1, weights=w1), dataclasses.replace(q2, weights=w2)
    return jnp.sum(jaxmlp.grouped_mlp(x, w1, w2, sizes, fp8=fp8).astype(jnp.float32) ** 2)

  states = [optax.scale_by_adam().init(w) for w in (w1, w2)]
  q1, q2 = (dataclasses.replace(jaxmlp.fp8_weights(w, recipe, jnp.bfloat16), weights=None) for w in (w1, w2))
  for _ in range(2):
    step_loss = jax.jit(loss)
    grads = jax.grad(step_loss, argnums=(0, 1))(w1, w2, q1, q2)
    if recipe == "blockwise":
      given = lambda a, b: tuple(jaxmlp.fp8_weights(v, recipe, jnp.bfloat16) for v in (a, b))
      want = jax.grad(jax.jit(lambda a, b: loss(a, b, *given(a, b))), argnums=(0, 1))(w1, w2)
    else:  # the same program given NumPy's quantization of the weights by the maximum the step's were
      e4m3 = [jnp.asarray(fp8_ref._quantize(np.asarray(w.astype(jnp.bfloat16), np.float64), np.float32(q.scales)),
                          jnp.float8_e4m3fn) for w, q in ((w1, q1), (w2, q2))]
      given = [dataclasses.replace(q, q=e, qt=jnp.swapaxes(e, 1, 2)) for e, q in zip(e4m3, (q1, q2))]
      want = jax.grad(step_loss, argnums=(0, 1))(w1, w2, *given)
    for got, expected in zip(grads, want):
      assert got.dtype == jnp.float32 and np.any(np.asarray(got) != 0)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    new = [jaxmlp.fp8_adam_step(w, gw, s, learning_rate=1e-2, fp8=q if recipe == "tensorwise" else recipe)
           for w, gw, s, q in zip((w1, w2), grads, states, (q1, q2))]
    before = w1
    (w1, states[0], q1), (w2, states[1], q2) = ((w, s, dataclasses.replace(q, weights=None)) for w, s, q in new)
  if recipe == "tensorwise":  # the last step quantized by its input's maximum, and carries its output's
    largest = lambda w: np.abs(np.asarray(w.astype(jnp.bfloat16), np.float32)).max()
    assert np.asarray(q1.scales) == largest(before) and np.asarray(q1.amax) == largest(w1)


def test_flax_modules_take_the_optimizers_fp8_weights(rng):
  """The Flax MoE layers' fp8_weights(quantized) (nnx, and linen's apply(method="fp8_weights")): the given
  quantized weights around the parameters, which the gradient reaches; given those fp8_weights() would
  quantize, the layer's output and gradients are those of fp8_weights(), bit for bit; given others (one
  fp8_adam_step further), the output moves with them."""
  from flax import nnx
  E, d, f = 4, 32, 32
  x = jnp.asarray(rng.standard_normal((2, 8, d)), jnp.bfloat16)
  graphdef, params = nnx.split(jaxmlp.nnx.MoE(E, d, f, 2, dtype=jnp.bfloat16, fp8="blockwise", rngs=nnx.Rngs(1)))
  linen_moe = jaxmlp.linen.MoE(E, d, f, 2, dtype=jnp.bfloat16, fp8="blockwise")
  linen_params = {"params": nnx.to_pure_dict(params)}
  quantized = [w.quantized for w in nnx.merge(graphdef, params).fp8_weights()]

  def nnx_loss(params, quantized):
    moe = nnx.merge(graphdef, params)
    return jnp.sum(moe(x, fp8_weights=moe.fp8_weights(quantized))[0].astype(jnp.float32) ** 2)

  def linen_loss(params, quantized):
    weights = linen_moe.apply(params, quantized, method="fp8_weights")
    return jnp.sum(linen_moe.apply(params, x, fp8_weights=weights)[0].astype(jnp.float32) ** 2)

  for loss, p in ((nnx_loss, params), (linen_loss, linen_params)):
    got, want = (jax.value_and_grad(loss)(p, q) for q in (quantized, None))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    w1 = nnx.merge(graphdef, params).experts.w1[...]
    moved = jaxmlp.fp8_adam_step(w1, jnp.ones_like(w1), optax.scale_by_adam().init(w1), learning_rate=0.1)[2]
    assert loss(p, [moved.quantized, quantized[1]]) != got[0]


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("devices, placed", [(4, "split"), (4, "whole"), (4, "eagerly"), (1, "split"),
                                             pytest.param(4, "on GPUs", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_fp8_adam_step_over_the_expert_axis(rng, axis_type, devices, placed, recipe):
  """With expert_axis (the experts split over the mesh's devices, as the expert-parallel layer holds them)
  each device steps and quantizes its own experts: NumPy's adam of the whole tensor up to a few roundings (on
  the CPU XLA fuses the split program's multiply-adds otherwise than the whole one's: last bits), and the
  quantization of the new weights bit for bit (cut tiles; tensorwise by the one delayed maximum, and the new
  maximum that of all devices' experts); the results come back split by expert. Operands already split or
  whole (under Explicit axes the step reshards them), the step jitted or eager, an axis of one device."""
  platform = "gpu" if placed == "on GPUs" else "cpu"
  if platform == "gpu" and (len(gpus()) < devices or fp8_reason()):
    pytest.skip(f"needs {devices} GPUs that run FP8 ({len(gpus())} here)")
  count = 5
  w, g, state = adam_inputs(rng, (8, 144, 272), count)
  kw = HYPER["adamw"]
  mesh = jax.make_mesh((devices,), ("expert",), axis_types=(axis_type,), devices=jax.devices(platform)[:devices])
  args = (w, g, state.mu, state.nu)
  if placed != "whole":
    args = [jax.device_put(v, jax.sharding.NamedSharding(mesh, P("expert"))) for v in args]
  before = tensorwise_before(w, "bfloat16", 0.75) if recipe == "tensorwise" else recipe
  step = lambda w, g, mu, nu: jaxmlp.fp8_adam_step(w, g, state._replace(mu=mu, nu=nu), expert_axis="expert",
                                                   fp8=before, **kw)
  with jax.set_mesh(mesh):
    new_w, new_state, fp8 = (step if placed == "eagerly" else jax.jit(step))(*args)
    # Each device runs the step on its own experts (on a GPU the kernel's custom call, which XLA would
    # otherwise run on gathered operands), not XLA's partitioning of the whole step.
    assert "shard_map" in str(jax.make_jaxpr(step)(*args))
  want, terms = numpy_adam(*(np.asarray(v, np.float32) for v in (w, g, state.mu, state.nu)), count + 1, **kw)
  for got, expected, magnitude, roundings in zip((new_w, new_state.mu, new_state.nu), want, terms, ROUNDINGS):
    assert_rounded_alike(got, expected, magnitude, roundings)
  check_fp8_weights(fp8, new_w, "bfloat16", None if recipe == "blockwise" else np.float32(before.amax))
  for v in (new_w, new_state.mu, new_state.nu, fp8.q, fp8.qt) + ((fp8.scales,) if recipe == "blockwise" else ()):
    assert v.sharding.spec[0] == "expert", v.sharding


def test_fp8_adam_step_expert_axis_errors():
  mesh = jax.make_mesh((4,), ("expert",), axis_types=(AxisType.Explicit,), devices=jax.devices("cpu")[:4])
  w = jnp.zeros((6, 16, 32), jnp.float32)
  state = optax.scale_by_adam().init(w)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"fp8_adam_step: w: 6 experts do not split over the 4 devices"):
      jax.eval_shape(lambda: jaxmlp.fp8_adam_step(w, w, state, learning_rate=1e-3, expert_axis="expert"))
    with pytest.raises(ValueError, match=r"fp8_adam_step: expert_axis: 'model' is not an axis of the current mesh"):
      jax.eval_shape(lambda: jaxmlp.fp8_adam_step(w, w, state, learning_rate=1e-3, expert_axis="model"))


W = jnp.zeros((2, 16, 32), jnp.float32)
STATE = optax.ScaleByAdamState(count=jnp.int32(0), mu=W, nu=W)


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((W.astype(jnp.bfloat16), W, STATE), {}, TypeError, r"w.dtype is bfloat16, expected float32"),
    ((W, W[:, :, :16], STATE), {}, ValueError, r"g has shape \[2, 16, 16\], expected w's \[2, 16, 32\]"),
    ((W, W.astype(jnp.float16), STATE), {}, TypeError, r"g.dtype is float16, expected float32 .* or dtype bfloat16"),
    ((W, W, STATE._replace(nu=W.astype(jnp.float16))), {}, TypeError, r"state.nu.dtype is float16"),
    ((W, W, dict(count=0, mu=W, nu=W)), {}, TypeError, "state has no field 'count'"),
    ((W, W, STATE._replace(count=jnp.float32(0))), {}, TypeError, "state.count must be an integer scalar"),
    ((W[:, :8], W[:, :8], STATE), {}, ValueError, r"w has shape \[2, 8, 32\], expected \[E, K, N\]"),
    ((W, W, STATE), dict(dtype=jnp.float32), TypeError, "dtype float32 is not supported"),
    ((W, W, STATE), dict(b1=1.0), ValueError, r"b1 = 1.0 must lie in \[0, 1\)"),
    ((W, W, STATE), dict(eps=jnp.float32(1e-8)), TypeError, "eps must be a Python float"),
    ((W, W, STATE), dict(learning_rate=jnp.ones(2)), ValueError, "learning_rate must be a scalar"),
    ((W, W, STATE), dict(fp8="tensorwise"), ValueError, "fp8='tensorwise' quantizes .* pass their Fp8Weights"),
    ((W, W, STATE), dict(fp8="rowwise"), ValueError, "fp8: expected 'blockwise'"),
    ((W, W, STATE), dict(fp8=3), TypeError, "fp8: expected 'blockwise'"),
    ((W, W, STATE), dict(fp8=jaxmlp.fp8_weights(W, "blockwise", jnp.bfloat16)), ValueError,
     "fp8: Fp8Weights of the blockwise recipe; pass fp8='blockwise'"),
    ((W, W, STATE), dict(fp8=dataclasses.replace(jaxmlp.fp8_weights(W, "tensorwise", jnp.bfloat16), amax=None)),
     ValueError, r"tensorwise Fp8Weights without their maximum \(amax is None\)"),
    ((W, W, STATE), dict(fp8=jaxmlp.fp8_weights(W[:, :, :16], "tensorwise", jnp.bfloat16)), ValueError,
     r"fp8: Fp8Weights of shape \[2, 16, 16\], expected w's \[2, 16, 32\]"),
    ((W, W, STATE), dict(fp8=dataclasses.replace(jaxmlp.fp8_weights(W, "tensorwise", jnp.bfloat16),
                                                 amax=jnp.zeros(1))), ValueError, r"fp8.amax must be a scalar"),
    ((W, W, STATE), dict(fp8=dataclasses.replace(jaxmlp.fp8_weights(W, "tensorwise", jnp.bfloat16),
                                                 amax=jnp.int32(1))), TypeError, r"fp8.amax must be float32"),
])
def test_fp8_adam_step_bad_arguments(args, kwargs, error, match):
  kwargs = dict(dict(learning_rate=1e-3), **kwargs)
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda: jaxmlp.fp8_adam_step(*args, **kwargs))


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_optimizer_writes_fp8_from_the_steps_measured_rows(monkeypatch, recipe):
  """Fp8Recipe.optimizer_writes_fp8 (the step a user picks, docs/fp8.md): by default from
  MIN_ROWS_OPTIMIZER_WRITES_FP8 rows per expert, above the calls' own threshold with the weights given (the
  optimizer's kernel gives part of their gain back); JAXMLP_FP8_WHEN=always or when="always": always."""
  monkeypatch.delenv("JAXMLP_FP8_WHEN", raising=False)
  faster, E = jaxmlp.Fp8Recipe(recipe), 8
  need = jaxmlp.fp8.recipe.MIN_ROWS_OPTIMIZER_WRITES_FP8[recipe]
  assert not faster.optimizer_writes_fp8(need * E - 1, E) and faster.optimizer_writes_fp8(need * E, E)
  calls_need = jaxmlp.fp8.recipe.MIN_ROWS_PER_EXPERT[recipe, True]
  assert calls_need < need and faster.runs_fp8(calls_need * E, E, cached=True)
  assert not faster.optimizer_writes_fp8(calls_need * E, E)
  assert f"{recipe} {need}" in jaxmlp.backend_info()["fp8_when"].split("optimizer_writes_fp8")[1]
  assert jaxmlp.Fp8Recipe(recipe, when="always").optimizer_writes_fp8(E, E)
  monkeypatch.setenv("JAXMLP_FP8_WHEN", "always")
  assert faster.optimizer_writes_fp8(E, E)


def test_numpy_adam_is_adam():
  """The model itself: float32 NumPy adam against float64 adam (textbook form) within float32's error."""
  rng = np.random.default_rng(0)
  w, g, mu = (rng.standard_normal(1000) for _ in range(3))
  nu = rng.uniform(0, 1, 1000)
  got, _ = numpy_adam(*(np.float32(v) for v in (w, g, mu, nu)), 7, 1e-3, weight_decay=0.1)
  mu64, nu64 = 0.1 * g + 0.9 * mu, 0.001 * g * g + 0.999 * nu
  u = (mu64 / (1 - 0.9**7)) / (np.sqrt(nu64 / (1 - 0.999**7)) + 1e-8) + 0.1 * w
  for a, b in zip(got, (w - 1e-3 * u, mu64, nu64)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
