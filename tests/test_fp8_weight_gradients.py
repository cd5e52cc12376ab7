"""The recipes' 16-bit weight gradients (Fp8Recipe.fp8_weight_gradients=False, and by default below
MIN_ROWS_FP8_WEIGHT_GRADIENTS rows per expert): every output against the float64 NumPy model of each recipe,
the rule that decides them, and on a GPU the blockwise quantizers that write the rows only (and a, dh in 16
bits) against JAX's."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_error
from fp8_cases import (BLOCK_CASES, DTYPES, NUMPY_MODEL, blockwise_primitive,  # noqa: F401 (platform: a fixture)
                       check_against_model, fp8_reason, inputs, platform, run)

import jaxmlp
import numpy_reference as ref
from jaxmlp._groups import Groups
from jaxmlp.fp8 import blockwise
from jaxmlp.fp8.recipe import MIN_ROWS_FP8_WEIGHT_GRADIENTS, MIN_ROWS_PER_EXPERT, MIN_WEIGHTS_STREAMED

WGRAD16 = {name: jaxmlp.Fp8Recipe(name, fast_accumulation=False, fp8_weight_gradients=False)
           for name in ("tensorwise", "blockwise")}


@pytest.mark.matrix
@pytest.mark.parametrize("recipe", list(WGRAD16))
@pytest.mark.parametrize("case, act, dtype", [("uneven", "swiglu", "bfloat16"), ("blocks", "gelu", "float16"),
                                              pytest.param("blocks", "clamped_swiglu", "bfloat16", marks=pytest.mark.full),
                                              pytest.param("all_empty", "swiglu", "bfloat16", marks=pytest.mark.full)])
@pytest.mark.parametrize("biases", [False, True])
def test_16bit_weight_gradients_follow_the_recipe(platform, rng, recipe, case, act, dtype, biases):
  """y, dx, dscales (and db1, db2) as the FP8 recipe's, dw1 = x^T round(dh) and dw2 = round(a)^T dy of
  16-bit operands, against the NumPy model; the rows past the groups of y and dx zeros."""
  M, d, f, sizes = BLOCK_CASES[case]
  args, gs, dy = inputs(rng, M, d, f, sizes, act, jnp.dtype(dtype), b1=biases, b2=biases)
  y, grads = run(jaxmlp.grouped_mlp, args, gs, dy, act, fp8=WGRAD16[recipe])
  n = {k: np.asarray(v, np.float64) for k, v in args.items() if v is not None}
  model = functools.partial(NUMPY_MODEL[recipe], n["x"], n["w1"], n["w2"], sizes, act, n.get("scales"),
                            np.asarray(dy, np.float64), DTYPES[dtype], b1=n.get("b1"), b2=n.get("b2"),
                            fp8_weight_gradients=False)
  check_against_model(y, grads, model, args, platform, M, sizes)
  if sum(sizes):  # ...and they are not the FP8 weight gradients: the test tells the two apart
    fp8_wgrad = run(jaxmlp.grouped_mlp, args, gs, dy, act,
                    fp8=dataclasses.replace(WGRAD16[recipe], fp8_weight_gradients=True))
    np.testing.assert_array_equal(np.asarray(fp8_wgrad[1]["x"], np.float32), np.asarray(grads["x"], np.float32))
    assert rel_error(fp8_wgrad[1]["w1"], grads["w1"]) > 1e-2


@pytest.mark.parametrize("recipe", list(WGRAD16))
def test_the_rule_decides_each_products_precision(recipe):
  """Fp8Recipe.as_run: None below the recipe's rows; the weight gradients in FP8 from
  MIN_ROWS_FP8_WEIGHT_GRADIENTS rows per expert (with the weights given, or quantized in the call), or as the
  recipe says."""
  E, need = 4, MIN_ROWS_FP8_WEIGHT_GRADIENTS[recipe, True]
  cached = jaxmlp.Fp8Recipe(recipe, when="faster")
  assert MIN_ROWS_PER_EXPERT[recipe, True] < need  # a range where only the weight gradients go 16-bit
  assert cached.as_run(MIN_ROWS_PER_EXPERT[recipe, True] * E - 1, E, True) is None
  assert cached.as_run(need * E - 1, E, True).fp8_weight_gradients is False
  assert cached.as_run(need * E, E, True).fp8_weight_gradients is True
  assert dataclasses.replace(cached, fp8_weight_gradients=True).as_run(need * E - 1, E, True).fp8_weight_gradients
  assert jaxmlp.Fp8Recipe(recipe, when="always").as_run(16, E, False).fp8_weight_gradients is True
  assert WGRAD16[recipe].as_run(need * E * 8, E, False).fp8_weight_gradients is False
  # Weights quantized in the call: tensorwise runs FP8 from 1024 rows, its weight gradients from 2048.
  per_call, runs = MIN_ROWS_FP8_WEIGHT_GRADIENTS[recipe, False], MIN_ROWS_PER_EXPERT[recipe, False]
  if per_call > runs:
    assert cached.as_run(runs * E, E, False).fp8_weight_gradients is False
    assert cached.as_run(per_call * E - 1, E, False).fp8_weight_gradients is False
  assert cached.as_run(max(per_call, runs) * E, E, False).fp8_weight_gradients is True


def test_with_the_weights_given_many_weights_run_fp8_at_any_rows(monkeypatch):
  """MIN_WEIGHTS_STREAMED: below its rows per expert a tensorwise call with its weights given still runs in
  FP8, its weight gradients 16-bit, where its experts hold that many weights; not with FP8 weight gradients
  asked, nor with the weights quantized in the call or unknown, nor for blockwise."""
  E, streamed = 4, MIN_WEIGHTS_STREAMED["tensorwise"]
  faster = jaxmlp.Fp8Recipe("tensorwise", when="faster")
  for rows in (E, MIN_ROWS_PER_EXPERT["tensorwise", True] * E - 1):
    assert faster.as_run(rows, E, True, streamed).fp8_weight_gradients is False
    assert dataclasses.replace(faster, fp8_weight_gradients=False).as_run(rows, E, True, streamed) is not None
    for run in (faster.as_run(rows, E, True, streamed - 1), faster.as_run(rows, E, True),
                faster.as_run(rows, E, False, streamed),
                dataclasses.replace(faster, fp8_weight_gradients=True).as_run(rows, E, True, streamed),
                jaxmlp.Fp8Recipe("blockwise", when="faster").as_run(rows, E, True, streamed << 8)):
      assert run is None
  monkeypatch.delenv("JAXMLP_FP8_WHEN", raising=False)  # which conftest sets to "always"
  assert f"tensorwise {streamed}" in jaxmlp.backend_info()["fp8_when"]


@pytest.mark.parametrize("recipe", list(WGRAD16))
@pytest.mark.parametrize("rows, fp8_wgrad", [(-16, False), (0, True)])
def test_by_default_16bit_weight_gradients_below_their_rows(rng, monkeypatch, recipe, rows, fp8_wgrad):
  """when="faster" with weights given as Fp8Weights: just below MIN_ROWS_FP8_WEIGHT_GRADIENTS rows per expert
  the results of fp8_weight_gradients=False bit for bit, from there on those of True."""
  monkeypatch.delenv("JAXMLP_FP8_WHEN", raising=False)
  E, d, f = 2, 32, 32
  M = MIN_ROWS_FP8_WEIGHT_GRADIENTS[recipe, True] * E + rows
  args, gs, dy = inputs(rng, M, d, f, [M // 2, M - M // 2], "swiglu", jnp.bfloat16)

  def call(fp8):
    def mlp(x, w1, w2, sizes, **kw):
      w1, w2 = (jaxmlp.fp8_weights(w, recipe) for w in (w1, w2))
      return jaxmlp.grouped_mlp(x, w1, w2, sizes, fp8=fp8, **kw)
    return mlp

  got = run(call(recipe), args, gs, dy, "swiglu")
  want = run(call(jaxmlp.Fp8Recipe(recipe, when="always", fp8_weight_gradients=fp8_wgrad)), args, gs, dy, "swiglu")
  for k, g, w in [("y", got[0], want[0])] + [(k, got[1][k], want[1][k]) for k in want[1]]:
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=k)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(name="blockwise", fp8_weight_gradients="no"), TypeError, "fp8_weight_gradients='no'"),
    (dict(name="blockwise", fp8_weight_gradients=0), TypeError, "fp8_weight_gradients=0"),  # 0 == False
])
def test_bad_fp8_weight_gradients(kwargs, error, match):
  with pytest.raises(error, match=match):
    jaxmlp.Fp8Recipe(**kwargs)
  assert jaxmlp.Fp8Recipe("blockwise", fp8_weight_gradients=np.False_).fp8_weight_gradients is False


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("act", ["relu", "swiglu"])
def test_cuda_rows_only_quantizers_equal_the_jax_ones(rng, dtype, act):
  """The quantizers of 16-bit weight gradients on a GPU (the rows only; a and dh also in 16 bits) against
  the JAX ones, in the groups' rows (the others no product reads: a kernel leaves them unwritten): x's
  rows bit for bit; a's and dh's as test_fp8's activation quantizers (relu bit for bit; swiglu's float32
  act may differ in its last bit: the e4m3 values one step apart and the 16-bit values one 16-bit step
  apart, for a few elements, and values below 2^-100 apart in its far tails)."""
  reason = fp8_reason()
  if reason:
    pytest.skip(reason)
  M, f, sizes = 448, 144, [300, 0, 37, 63, 1]
  F1 = 2 * f if act in ref.GATED else f
  t = jnp.dtype(dtype)
  v = jnp.asarray(rng.standard_normal((M, 272)) * 2.0 ** rng.integers(-12, 13, (M, 1)), t)
  h = jnp.asarray(rng.standard_normal((M, F1)) * 2.0 ** rng.integers(-6, 7, (M, 1)), t)
  da = jnp.asarray(rng.standard_normal((M, f)), t)
  scales = jnp.asarray(rng.uniform(0.1, 1.0, M), t)
  gs = jnp.asarray(sizes, jnp.int32)
  activation = jaxmlp.Activation(act)
  rows = blockwise_primitive("quantize_rows_in_groups")
  a, dh = (blockwise_primitive(name, activation) for name in ("activation_rows", "activation_grad_rows"))
  flat = lambda rows_and_values: (*rows_and_values[0], rows_and_values[1])  # (q, e, values)
  quantizers = {"x": lambda v, h, da, s, gs: (*rows(v, Groups.of(gs, M)), None),
                "a": lambda v, h, da, s, gs: flat(a(h, s, Groups.of(gs, M))),
                "dh": lambda v, h, da, s, gs: flat(dh(h, da, s, Groups.of(gs, M)))}
  in_groups = np.arange(M) < sum(sizes)
  exact = act == "relu"
  for name, quantize in quantizers.items():
    results = {}
    for platform in ("cpu", "cuda"):
      device = jax.devices(platform)[0]
      with jax.default_device(device):
        results[platform] = jax.jit(quantize)(*jax.device_put((v, h, da, scales, gs), device))
    (q, e, values), (q0, e0, values0) = results["cuda"], results["cpu"]
    got, want = (np.asarray(blockwise.dequantize_rows(q, e), np.float64)[in_groups],
                 np.asarray(blockwise.dequantize_rows(q0, e0), np.float64)[in_groups])
    if name == "x" or exact:
      np.testing.assert_array_equal(got, want, f"{name}: rows")
    else:
      step = 2.0 ** -3 * np.abs(want) + 2.0 ** -9 * np.max(np.abs(want))
      assert np.all(np.abs(got - want) <= step) and np.mean(got != want) < 1e-3, f"{name}: rows"
    if values is None:
      continue
    assert values.dtype == t and values.shape == values0.shape, name
    got, want = np.asarray(values, np.float64)[in_groups], np.asarray(values0, np.float64)[in_groups]
    if exact:
      np.testing.assert_array_equal(got, want, f"{name}: 16-bit values")
    else:
      # (+ 2^-100: in swiglu's tails, gate about -87, XLA's float32 sigmoid on the CPU underflows to 0 where
      # CUDA's still gives ~1e-38: dh's up half 0 against ~1e-38, test_fp8's convention for such values)
      ulp = np.abs(want) * float(jnp.finfo(t).eps) + 2.0 ** -100
      assert np.all(np.abs(got - want) <= ulp) and np.mean(got != want) < 1e-3, f"{name}: 16-bit values"
