"""grouped_mlp(fp8=...) against the float64 NumPy model of each recipe and against the exact MLP, on the CPU
emulation and, where a GPU can run it, the CUDA FP8 path; the CUDA path also against the CPU emulation."""
import functools
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import check_close, max_error, rel_error
from fp8_cases import (BLOCK_CASES, CASES, CUDA_TOLERANCE, DTYPES, EXACT, NUMPY_MODEL, blockwise_primitive,
                       check_against_model, check_recipe, fp8_reason, inputs, platform,  # noqa: F401 (a fixture)
                       run)

import jaxmlp
import numpy_fp8_reference as fp8_ref
import numpy_reference as ref
from jaxmlp import _checks, activations
from jaxmlp._groups import Groups
from jaxmlp.fp8 import blockwise, cuda as fp8_cuda, mlp as fp8_mlp, tensorwise

# Without --full, the "uneven" shape with each recipe, dtype and activation once (`matrix`); the other shapes,
# each a new compilation of every op of the recipe, only with --full.
@pytest.mark.matrix
@pytest.mark.parametrize("recipe, case", [pytest.param(r, c, marks=() if c == "uneven" else pytest.mark.full)
                                          for r, cases in (("tensorwise", CASES), ("blockwise", BLOCK_CASES))
                                          for c in cases])
@pytest.mark.parametrize("act", ["swiglu", "gelu", "clamped_swiglu"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_follows_the_recipe(platform, rng, recipe, case, act, dtype):
  """Every output against the float64 NumPy model of the recipe: the same quantization, products and
  rounding, up to float32 accumulation (and, where an element sits on a rounding boundary, its e4m3
  neighbour)."""
  M, d, f, sizes = BLOCK_CASES[case]
  args, gs, dy = inputs(rng, M, d, f, sizes, act, jnp.dtype(dtype))
  y, grads = run(jaxmlp.grouped_mlp, args, gs, dy, act, fp8=EXACT[recipe])
  n = {k: np.asarray(v, np.float64) for k, v in args.items() if v is not None}
  model = functools.partial(NUMPY_MODEL[recipe], n["x"], n["w1"], n["w2"], sizes, act, n.get("scales"),
                            np.asarray(dy, np.float64), DTYPES[dtype])
  assert y.dtype == jnp.dtype(dtype)
  check_against_model(y, grads, model, args, platform, M, sizes)


@pytest.mark.matrix
@pytest.mark.parametrize("recipe, case", [("tensorwise", "uneven"),
                                          pytest.param("tensorwise", "skewed", marks=pytest.mark.full),
                                          pytest.param("tensorwise", "blocks", marks=pytest.mark.full),
                                          pytest.param("blockwise", "blocks", marks=pytest.mark.full),
                                          ("blockwise", "uneven")])
@pytest.mark.parametrize("biases, act, with_scales", [("both", "clamped_swiglu", True), ("both", "gelu", False),
                                                      ("b1", "swiglu", True), ("b2", "swiglu", True)])
def test_fp8_biases_follow_the_recipe(platform, rng, recipe, case, biases, act, with_scales):
  """With biases (gpt-oss's experts have both), every output and gradient, db1 and db2 included, against the
  NumPy model: b1 added to FC1's output before the activation, b2 (weighted by the row's scale) to FC2's, and
  the scales' gradient taking b2's term."""
  M, d, f, sizes = BLOCK_CASES[case]
  args, gs, dy = inputs(rng, M, d, f, sizes, act, jnp.bfloat16, scales=with_scales, b1=biases != "b2",
                        b2=biases != "b1")
  y, grads = run(jaxmlp.grouped_mlp, args, gs, dy, act, fp8=EXACT[recipe])
  n = {k: np.asarray(v, np.float64) for k, v in args.items() if v is not None}
  model = functools.partial(NUMPY_MODEL[recipe], n["x"], n["w1"], n["w2"], sizes, act, n.get("scales"),
                            np.asarray(dy, np.float64), ml_dtypes.bfloat16, b1=n.get("b1"), b2=n.get("b2"))
  check_against_model(y, grads, model, args, platform, M, sizes)


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("blockwise", marks=pytest.mark.full)])
def test_fp8_quantizes(rng, recipe):
  """FP8's error against the exact MLP lies in a band: above the bfloat16 path's (the products were
  quantized) and below FP8's bound (a few e4m3 ulps of 2^-3)."""
  M, d, f, sizes = 256, 256, 128, [100, 60, 0, 96]
  args, gs, dy = inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16)
  n = {k: np.asarray(v, np.float64) for k, v in args.items()}
  want_y, want = ref.grouped_mlp(n["x"], n["w1"], n["w2"], sizes, "swiglu", scales=n["scales"],
                                 dy=np.asarray(dy, np.float64))
  y16, g16 = run(jaxmlp.grouped_mlp, args, gs, dy, "swiglu")
  y8, g8 = run(jaxmlp.grouped_mlp, args, gs, dy, "swiglu", fp8=recipe)
  for k, got8, got16, exact in [("y", y8, y16, want_y)] + [(k, g8[k], g16[k], want[k]) for k in g8]:
    e8, e16 = rel_error(got8, exact), rel_error(got16, exact)
    assert 2 * e16 < e8 < 0.1, (k, e8, e16)


def test_blockwise_beats_tensorwise_on_outlier_blocks(rng):
  """A few outlier blocks, as activations and weights have: one scale per tensor sends the rest of x into
  e4m3's subnormals and zero (the other rows' outputs vanish), one scale per block keeps FP8's precision."""
  M, d, f, sizes = 256, 256, 128, [128, 128]
  args, gs, dy = inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16, scales=False)
  x, w1 = np.asarray(args["x"], np.float64), np.asarray(args["w1"], np.float64)
  x[:4, :128] *= 2.0**12  # one 128-column block of four rows
  w1[0, :128, :128] *= 2.0**8  # one 128 x 128 block of expert 0
  args.update(x=jnp.asarray(x, jnp.bfloat16), w1=jnp.asarray(w1, jnp.bfloat16))
  n = {k: np.asarray(v, np.float64) for k, v in args.items() if v is not None}
  want_y, want = ref.grouped_mlp(n["x"], n["w1"], n["w2"], sizes, "swiglu", dy=np.asarray(dy, np.float64))
  errors = {}
  for recipe in ("tensorwise", "blockwise"):
    y, grads = run(jaxmlp.grouped_mlp, args, gs, dy, "swiglu", fp8=recipe)
    errors[recipe] = rel_error(y[4:], want_y[4:]), rel_error(grads["x"][4:], want["x"][4:])
  (y_tensor, dx_tensor), (y_block, dx_block) = errors["tensorwise"], errors["blockwise"]
  assert y_tensor > 0.5 and y_block < 0.1, errors  # measured: 1.0 (all zero) and 0.065
  assert dx_block < dx_tensor / 3, errors  # measured: 0.11 and 0.70


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, fast, case, biases", [("tensorwise", fast, c, False) for fast in ("none", "forward", "both")
                                                        for c in CASES] + [("blockwise", "none", c, False) for c in BLOCK_CASES]
                         + [("tensorwise", "forward", c, True) for c in CASES] + [("blockwise", "none", c, True)
                                                                                  for c in ("blocks", "all_empty")])
def test_cuda_fp8_equals_the_cpu_emulation(rng, recipe, fast, case, biases):
  """The CUDA path and the CPU emulation quantize the same values: their results differ by how the
  products are accumulated (CUDA_TOLERANCE) and the roundings that follow from it."""
  reason = fp8_reason()
  if reason:
    pytest.skip(reason)
  M, d, f, sizes = BLOCK_CASES[case]
  args, gs, dy = inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16, b1=biases, b2=biases)
  recipe = jaxmlp.Fp8Recipe(recipe, fast_accumulation=fast != "none", backward_fast_accumulation=fast == "both")
  results = {}
  for platform in ("cpu", "cuda"):
    with jax.default_device(jax.devices(platform)[0]):
      y, grads = run(jaxmlp.grouped_mlp, jax.device_put(args, jax.devices(platform)[0]),
                     jax.device_put(gs, jax.devices(platform)[0]), jax.device_put(dy, jax.devices(platform)[0]),
                     "swiglu", fp8=recipe)
      results[platform] = {"y": y, **grads}
  # Fast accumulation keeps fewer bits still in the forward's sums; the difference reaches every gradient
  # through h (measured on an H200: up to 8e-3 relative error, elements up to 4e-2), within the same bound.
  for k in results["cpu"]:
    check_close(results["cuda"][k], results["cpu"][k], CUDA_TOLERANCE, k)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_fp8_forward_keeps_the_emulations_copy_of_x(rng, case):
  """The tensorwise forward's residual xt (x's e4m3 copy in the weight gradients' padded layout, which the
  handler poisons first): every byte equals the emulation's, the zeros between and after the groups
  included (the layout is sized for the worst case; the products never read past the groups)."""
  reason = fp8_reason()
  if reason:
    pytest.skip(reason)
  M, d, f, sizes = CASES[case]
  args, gs, _ = inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16)
  act = activations.resolve("swiglu")
  shape = _checks.check_mlp(args["x"], args["w1"], args["w2"], gs, act)
  xts = {}
  for platform in ("cpu", "cuda"):
    with jax.default_device(jax.devices(platform)[0]):
      a = jax.device_put(args, jax.devices(platform)[0])
      _, (residuals, *_) = fp8_mlp._mlp_fwd(a["x"], None, a["w1"], a["w2"], None, None,
                                            jax.device_put(gs, a["x"].device), None, None, a["scales"], None, act,
                                            EXACT["tensorwise"], shape, True)
      xts[platform] = np.asarray(residuals[2]).view(np.uint8)
  assert xts["cuda"].shape == (d, tensorwise.SCHEME.padded_length(M, len(sizes)))
  np.testing.assert_array_equal(xts["cuda"], xts["cpu"])


@pytest.mark.matrix
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("cached", ["w1", "w2", "both"])
def test_fp8_weights_give_the_results_of_quantizing_in_the_call(platform, rng, recipe, cached):
  """grouped_mlp with weights quantized beforehand (jaxmlp.fp8_weights, inside the differentiated function:
  the gradient reaches the weights through Fp8Weights.weights) returns y and every gradient of the call that
  quantizes them itself, bit for bit; with fp8 omitted the weights' recipe runs."""
  M, d, f, sizes = BLOCK_CASES["blocks" if recipe == "blockwise" else "uneven"]
  args, gs, dy = inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16)
  quantized = {"w1": cached in ("w1", "both"), "w2": cached in ("w2", "both")}

  def with_fp8_weights(x, w1, w2, sizes, **kw):
    w1, w2 = [jaxmlp.fp8_weights(w, recipe) if quantized[k] else w for k, w in (("w1", w1), ("w2", w2))]
    return jaxmlp.grouped_mlp(x, w1, w2, sizes, **(kw if cached != "both" else {**kw, "fp8": None}))

  want = run(jax.jit(jaxmlp.grouped_mlp, static_argnames=("activation", "fp8")), args, gs, dy, "swiglu",
             fp8=recipe)
  got = run(jax.jit(with_fp8_weights, static_argnames=("activation", "fp8")), args, gs, dy, "swiglu",
            fp8=recipe)
  for k, g, w in [("y", got[0], want[0])] + [(k, got[1][k], want[1][k]) for k in want[1]]:
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=k)
  # ...and they are not the bfloat16 results: the quantized weights were used.
  assert rel_error(got[0], run(jaxmlp.grouped_mlp, args, gs, dy, "swiglu")[0]) > 1e-2


@pytest.mark.parametrize("recipe, cached", [("tensorwise", False), ("blockwise", True),
                                            pytest.param("tensorwise", True, marks=pytest.mark.full),
                                            pytest.param("blockwise", False, marks=pytest.mark.full)])
def test_fp8_runs_only_where_it_pays_by_default(platform, rng, monkeypatch, recipe, cached):
  """when="faster" (the default, which this suite turns off in conftest): with fewer rows per expert than
  the recipe's MIN_ROWS_PER_EXPERT the call, and the reference's, give the bf16 results bit for bit
  (gradients of Fp8Weights' weights included); from that many on, the FP8 results of when="always" (with
  16-bit weight gradients below MIN_ROWS_FP8_WEIGHT_GRADIENTS: test_fp8_weight_gradients.py)."""
  monkeypatch.delenv("JAXMLP_FP8_WHEN", raising=False)
  need = jaxmlp.fp8.recipe.MIN_ROWS_PER_EXPERT[recipe, cached]
  fp8_wgrad = need >= jaxmlp.fp8.recipe.MIN_ROWS_FP8_WEIGHT_GRADIENTS[recipe, cached]
  E, d, f = 2, 32, 32

  def call(fp8):
    def mlp(x, w1, w2, sizes, **kw):
      if cached:  # inside the differentiated function: the gradient reaches Fp8Weights.weights
        w1, w2 = (jaxmlp.fp8_weights(w, recipe) for w in (w1, w2))
      return jaxmlp.grouped_mlp(x, w1, w2, sizes, fp8=fp8, **kw)
    return mlp

  for M, fp8_runs in ((need * E - 16, False), (need * E, True)):
    args, gs, dy = inputs(rng, M, d, f, [M // 2, M - M // 2], "swiglu", jnp.bfloat16)
    got = run(call(recipe), args, gs, dy, "swiglu")
    always = jaxmlp.Fp8Recipe(recipe, when="always", fp8_weight_gradients=fp8_wgrad)
    want = run(call(always) if fp8_runs else jaxmlp.grouped_mlp, args, gs, dy, "swiglu")
    for k, g, w in [("y", got[0], want[0])] + [(k, got[1][k], want[1][k]) for k in want[1]]:
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=f"{M} rows: {k}")
    bf16 = got[0] if not fp8_runs else run(jaxmlp.grouped_mlp, args, gs, dy, "swiglu")[0]
    assert (rel_error(got[0], bf16) > 1e-3) == fp8_runs  # the two branches differ: the test can tell them apart
    if not cached:
      reference = jaxmlp.reference.grouped_mlp(args["x"], args["w1"], args["w2"], gs, fp8=recipe)
      reference_bf16 = jaxmlp.reference.grouped_mlp(args["x"], args["w1"], args["w2"], gs)
      assert (rel_error(reference, reference_bf16) == 0) != fp8_runs
  # A buffer that holds twice the rows in use (the expert-parallel layer's) decides by the rows in use.
  with jaxmlp._gemm_path.padded_buffers(2.0):
    got = run(call(recipe), args, gs, dy, "swiglu")
  np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(bf16, np.float32))


def test_fp8_runs_with_the_weights_given_from_their_count(platform, rng, monkeypatch):
  """when="faster", tensorwise, the weights given as Fp8Weights, fewer rows per expert than MIN_ROWS_PER_EXPERT:
  where the experts hold MIN_WEIGHTS_STREAMED weights (here lowered to the call's own E d (2f + f)) the call and
  the reference give the FP8 results of when="always" with 16-bit weight gradients, bit for bit; with one
  weight fewer to the threshold, the bf16 results."""
  monkeypatch.delenv("JAXMLP_FP8_WHEN", raising=False)
  E, d, f, M = 2, 32, 32, 64  # 32 rows per expert, under the recipe's 256
  assert M < jaxmlp.fp8.recipe.MIN_ROWS_PER_EXPERT["tensorwise", True] * E
  args, gs, dy = inputs(rng, M, d, f, [M // 2, M - M // 2], "swiglu", jnp.bfloat16)

  def call(fp8):
    def mlp(x, w1, w2, sizes, **kw):
      w1, w2 = (jaxmlp.fp8_weights(w, "tensorwise") for w in (w1, w2))
      return jaxmlp.grouped_mlp(x, w1, w2, sizes, fp8=fp8, **kw)
    return mlp

  fp8 = run(call(jaxmlp.Fp8Recipe("tensorwise", when="always", fp8_weight_gradients=False)), args, gs, dy, "swiglu")
  bf16 = run(jaxmlp.grouped_mlp, args, gs, dy, "swiglu")
  assert rel_error(fp8[0], bf16[0]) > 1e-3  # the two differ: the test can tell them apart
  weights = E * d * 3 * f
  w1q, w2q = (jaxmlp.fp8_weights(args[k], "tensorwise") for k in ("w1", "w2"))
  reference_bf16 = jaxmlp.reference.grouped_mlp(args["x"], args["w1"], args["w2"], gs)
  for threshold, want in ((weights, fp8), (weights + 1, bf16)):
    monkeypatch.setitem(jaxmlp.fp8.recipe.MIN_WEIGHTS_STREAMED, "tensorwise", threshold)
    got = run(call("tensorwise"), args, gs, dy, "swiglu")
    for k, g, w in [("y", got[0], want[0])] + [(k, got[1][k], want[1][k]) for k in want[1]]:
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=f"{threshold}: {k}")
    reference = jaxmlp.reference.grouped_mlp(args["x"], w1q, w2q, gs, fp8="tensorwise")
    assert (rel_error(reference, reference_bf16) == 0) == (want is bf16)


def test_fp8_when_bad_values_name_the_setting(monkeypatch):
  with pytest.raises(ValueError, match="fp8: when='sometimes'"):
    jaxmlp.Fp8Recipe("tensorwise", when="sometimes")
  monkeypatch.setenv("JAXMLP_FP8_WHEN", "sometimes")
  x, w1, w2 = jnp.ones((32, 16), jnp.bfloat16), jnp.ones((2, 16, 32), jnp.bfloat16), jnp.ones((2, 16, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="JAXMLP_FP8_WHEN='sometimes'"):
    jaxmlp.grouped_mlp(x, w1, w2, jnp.array([16, 16]), fp8="tensorwise")


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("blockwise", marks=pytest.mark.full)])
def test_fp8_weights_quantized_once_over_micro_batches(rng, recipe):
  """Gradient accumulation with float32 master weights: quantized once (from bfloat16), then a scan over
  micro-batches; the accumulated float32 weight gradients equal the sum of the micro-batches' gradients of
  calls that round and quantize the weights themselves."""
  M, d, f, sizes = BLOCK_CASES["blocks" if recipe == "blockwise" else "uneven"]
  args, gs, _ = inputs(rng, M, d, f, sizes, "swiglu", jnp.float32, scales=False)
  xs = jnp.asarray(rng.standard_normal((3, M, d)), jnp.bfloat16)
  dys = jnp.asarray(rng.standard_normal((3, M, d)), jnp.bfloat16)

  def step(w1, w2):
    w1q, w2q = (jaxmlp.fp8_weights(w, recipe, dtype=jnp.bfloat16) for w in (w1, w2))
    def micro_batch(total, x_dy):
      x, dy = x_dy
      y = jaxmlp.grouped_mlp(x, w1q, w2q, gs, fp8=recipe)
      return total + jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), None
    return jax.lax.scan(micro_batch, 0.0, (xs, dys))[0]

  def per_call(w1, w2, x, dy):
    y = jaxmlp.grouped_mlp(x, w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), gs, fp8=recipe)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

  got = jax.jit(jax.grad(step, argnums=(0, 1)))(args["w1"], args["w2"])
  grads = [jax.jit(jax.grad(per_call, argnums=(0, 1)))(args["w1"], args["w2"], x, dy) for x, dy in zip(xs, dys)]
  for i, name in enumerate(("w1", "w2")):
    want = sum(np.asarray(g[i], np.float64) for g in grads)
    assert got[i].dtype == jnp.float32  # accumulated in the master weights' dtype
    check_close(got[i], want, 1e-5, name)


@pytest.mark.parametrize("make, error, match", [
    (lambda w1, w2: dict(w1=jaxmlp.fp8_weights(w1, "blockwise"), fp8="tensorwise"), ValueError,
     r"w1: Fp8Weights quantized for fp8='blockwise', but the call runs fp8='tensorwise'"),
    (lambda w1, w2: dict(w1=jaxmlp.fp8_weights(w1, "tensorwise"), w2=jaxmlp.fp8_weights(w2, "blockwise")),
     ValueError, r"w2: Fp8Weights quantized for fp8='blockwise'"),
    (lambda w1, w2: dict(w2=jaxmlp.Fp8Weights(w2, jnp.zeros((2, 16, 8), jnp.float8_e4m3fn), jnp.float32(1),
                                              jnp.zeros((2, 16, 16), jnp.float8_e4m3fn), "tensorwise")),
     ValueError, r"w2: Fp8Weights.q is float8_e4m3fn \[2, 16, 8\], expected float8_e4m3fn \[2, 16, 16\]"),
])
def test_fp8_weights_bad_arguments(make, error, match):
  x, w1, w2 = jnp.zeros((8, 16), jnp.bfloat16), jnp.zeros((2, 16, 32), jnp.bfloat16), jnp.zeros((2, 16, 16), jnp.bfloat16)
  kw = {"w1": w1, "w2": w2, **make(w1, w2)}
  with pytest.raises(error, match=match):
    jaxmlp.grouped_mlp(x, kw.pop("w1"), kw.pop("w2"), jnp.array([4, 4]), **kw)


def test_fp8_weights_checks_its_weights():
  with pytest.raises(ValueError, match=r"fp8_weights: w has shape \[2, 24, 16\], expected \[E, K, N\]"):
    jaxmlp.fp8_weights(jnp.zeros((2, 24, 16), jnp.bfloat16))
  with pytest.raises(TypeError, match="fp8_weights: computation dtype float32 is not supported"):
    jaxmlp.fp8_weights(jnp.zeros((2, 16, 16)))
  with pytest.raises(TypeError, match="fp8_weights: w.dtype int32 is not a floating-point type"):
    jaxmlp.fp8_weights(jnp.zeros((2, 16, 16), jnp.int32), dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="fp8_weights: fp8 must name a recipe"):
    jaxmlp.fp8_weights(jnp.zeros((2, 16, 16), jnp.bfloat16), None)
  with pytest.raises(ValueError, match="fp8: unknown recipe"):
    jaxmlp.fp8_weights(jnp.zeros((2, 16, 16), jnp.bfloat16), "rowwise")


@pytest.mark.parametrize("sizes, want", [
    # groups of 300, 0, 37, 63 and 1 rows of 448: 128-row blocks from each group's first row
    ([300, 0, 37, 63, 1], [(0, 128), (128, 128), (256, 44), (300, 37), (337, 63), (400, 1)]),
    # clamped as grouped_mlp clamps: negative sizes count as 0, the running total stops at 448 rows
    ([-5, 500, 7], [(0, 128), (128, 128), (256, 128), (384, 64)]),
])
def test_blockwise_column_blocks(sizes, want):
  """The weight gradients' 128 x 1 blocks, (first row, rows), that the JAX and the CUDA quantizer read: the
  groups' blocks in order, then blocks of no rows up to padded_length."""
  first, rows = blockwise.column_blocks(Groups.of(jnp.asarray(sizes, jnp.int32), 448))
  got = list(zip(np.asarray(first).tolist(), np.asarray(rows).tolist()))
  assert len(got) == blockwise.SCHEME.padded_length(448, len(sizes)) // 128
  assert got[:len(want)] == want and all(r == 0 for _, r in got[len(want):]), got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cuda_quantizers_equal_the_jax_ones(rng, dtype):
  """The CUDA quantizers of the blockwise recipe (and of the tensorwise weights) write the e4m3 values and
  exponents (amax) of their JAX quantizers bit for bit: rows of magnitudes 2^-12 to 2^12, a zero block,
  blocks cut short by the widths (272, 144) and by the groups (300 rows: 128, 128 and 44), an empty group
  and rows past the groups (what no product reads, those rows and the blocks past the groups', not compared:
  a kernel leaves them unwritten). float32 weights are master weights: quantized as rounded to bfloat16
  and to float16 (the blockwise kernel rounds them as it reads them; the JAX code rounds first)."""
  reason = fp8_reason()
  if reason:
    pytest.skip(reason)
  M, C, sizes = 448, 272, [300, 0, 37, 63, 1]
  v = rng.standard_normal((M, C)) * 2.0 ** rng.integers(-12, 13, (M, 1))
  v[:5, 128:256] = 0
  w = rng.standard_normal((3, C, 144)) * 2.0 ** rng.integers(-12, 13, (3, 1, 1))
  v, w, gs = jnp.asarray(v, dtype), jnp.asarray(w, dtype), jnp.asarray(sizes, jnp.int32)
  rows_and_columns = blockwise_primitive("quantize_rows_and_columns")  # CUDA's kernel on a GPU, JAX's on the CPU
  read = lambda quantized, gs: blockwise.read_by_products(quantized, Groups.of(gs, M))
  quantizers = {"rows and columns": lambda v, w, gs: read(rows_and_columns(v, Groups.of(gs, M)), gs)}
  # The weights of both recipes (tensorwise: one scale for the whole tensor), in the computation dtypes.
  for recipe in ("blockwise", "tensorwise"):
    for computation in (["bfloat16", "float16"] if dtype == "float32" else [dtype]):
      quantizers[f"{recipe} weights as {computation}"] = functools.partial(
          lambda v, w, gs, recipe, computation: fp8_mlp._quantize_weights(w, jaxmlp.Fp8Recipe(recipe), computation),
          recipe=recipe, computation=jnp.dtype(computation))
  bits = lambda a: np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else np.asarray(a)
  for name, quantize in quantizers.items():
    results = {}
    for platform in ("cpu", "cuda"):
      device = jax.devices(platform)[0]
      with jax.default_device(device):
        results[platform] = jax.jit(quantize)(*jax.device_put((v, w, gs), device))
    for i, (got, want) in enumerate(zip(results["cuda"], results["cpu"])):
      np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"{name}: output {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["reglu", "relu", "swiglu", "clamped_swiglu"])
@pytest.mark.parametrize("with_scales", [True, False])
@pytest.mark.parametrize("f", [144, 256])
def test_cuda_activation_quantizers_equal_the_jax_ones(rng, act, with_scales, f):
  """The blockwise quantizers of the forward's a = act(h) * scales and the backward's dh = (da * scales) *
  act'(h), which on a GPU compute the activation on the way from h, against the JAX ones: for relu and reglu
  (the same float32 operations) the same values and exponents; for the others, whose float32 act may differ
  in its last bit (and far in its tails, where XLA's sigmoid underflows to 0 before CUDA's), the same
  dequantized values but for a few elements one e4m3 step apart and values below 2^-100. Widths cut short
  (f = 144: F1 = 288 gated) and whole blocks (f = 256: the gated dh's gate and up tiles paired in the
  kernel's order), groups of several blocks, an empty group and rows past the groups (not compared, as above)."""
  reason = fp8_reason()
  if reason:
    pytest.skip(reason)
  M, sizes = 448, [300, 0, 37, 63, 1]
  F1 = 2 * f if act in ref.GATED else f
  h = jnp.asarray(rng.standard_normal((M, F1)) * 2.0 ** rng.integers(-6, 7, (M, 1)), jnp.bfloat16)
  da = jnp.asarray(rng.standard_normal((M, f)), jnp.bfloat16)
  scales = jnp.asarray(rng.uniform(0.1, 1.0, M), jnp.bfloat16) if with_scales else None
  gs = jnp.asarray(sizes, jnp.int32)
  activation = jaxmlp.Activation(act)
  a, dh = (blockwise_primitive(name, activation) for name in ("activation_rows_and_columns",
                                                                  "activation_grad_rows_and_columns"))
  read = lambda quantized, gs: blockwise.read_by_products(quantized, Groups.of(gs, M))
  quantizers = {"a": lambda h, da, s, gs: read(a(h, s, Groups.of(gs, M)), gs),
                "dh": lambda h, da, s, gs: read(dh(h, da, s, Groups.of(gs, M)), gs)}
  for name, quantize in quantizers.items():
    results = {}
    for platform in ("cpu", "cuda"):
      device = jax.devices(platform)[0]
      with jax.default_device(device):
        results[platform] = jax.jit(quantize)(*jax.device_put((h, da, scales, gs), device))
    (q, e, qt, ec), (q0, e0, qt0, ec0) = results["cuda"], results["cpu"]
    if act in ("reglu", "relu"):
      for got, want, what in ((e, e0, "row exponents"), (ec, ec0, "column exponents"), (q, q0, "rows"),
                              (qt, qt0, "columns")):  # as float: -0 and 0 alike
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), f"{name}: {what}")
      continue
    dequantized = {"rows": (blockwise.dequantize_rows(q, e), blockwise.dequantize_rows(q0, e0)),
                   "columns": (blockwise.dequantize_columns(qt, ec), blockwise.dequantize_columns(qt0, ec0))}
    for what, (got, want) in dequantized.items():
      got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
      # a flip to the neighbouring e4m3 value (3 mantissa bits; one step of the block's subnormals at most)
      step = 2.0 ** -3 * np.abs(want) + 2.0 ** -9 * np.max(np.abs(want))
      assert np.all(np.abs(got - want) <= step), f"{name}: {what}"
      differ = np.mean(np.abs(got - want) > 2.0 ** -100)
      assert differ < 1e-3, f"{name}: {what}: {differ} of the values differ"


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(fp8="blockwise8"), ValueError, "fp8: unknown recipe 'blockwise8'"),
    (dict(fp8=3), TypeError, "fp8: expected None, a recipe name"),
    (dict(fp8="tensorwise", b2=jnp.zeros((2, 8), jnp.bfloat16)), ValueError, r"b2: .*\[E, d\] = \[2, 16\]"),
])
def test_fp8_bad_arguments(kwargs, error, match):
  x, w1, w2 = jnp.zeros((8, 16), jnp.bfloat16), jnp.zeros((2, 16, 32), jnp.bfloat16), jnp.zeros((2, 16, 16), jnp.bfloat16)
  with pytest.raises(error, match=match):
    jaxmlp.grouped_mlp(x, w1, w2, jnp.array([4, 4]), **kwargs)


def test_fp8_needs_16bit_operands_and_aligned_widths():
  gs = jnp.array([4, 4])
  with pytest.raises(TypeError, match="fp8: x.dtype float32"):
    jaxmlp.grouped_mlp(jnp.zeros((8, 16)), jnp.zeros((2, 16, 32)), jnp.zeros((2, 16, 16)), gs, fp8="tensorwise")
  with pytest.raises(ValueError, match="multiples of 16"):
    jaxmlp.grouped_mlp(jnp.zeros((8, 24), jnp.bfloat16), jnp.zeros((2, 24, 32), jnp.bfloat16),
                       jnp.zeros((2, 16, 24), jnp.bfloat16), gs, fp8="tensorwise")


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_on_a_gpu_that_cannot_run_it_raises_at_trace_time(monkeypatch, recipe):
  """A CUDA device whose GPU or cuBLAS cannot run the FP8 path (here: one made up, so that the CPU runs the
  check) fails when the call is traced, naming fp8 and why, not when it runs; weights quantized once too."""
  from jaxmlp import _library
  monkeypatch.setattr(_library, "cuda_devices", lambda: ["cuda:0"])
  monkeypatch.setattr(fp8_cuda, "fp8_status", lambda: (False, "cuBLASLt 130100 has no grouped GEMM (13.4 or newer)"))
  x, w1, w2 = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((8, 16), (2, 16, 32), (2, 16, 16)))
  with pytest.raises(RuntimeError, match=r"fp8: this GPU cannot run the FP8 grouped MLP: cuBLASLt 130100"):
    jax.eval_shape(lambda x, w1, w2: jaxmlp.grouped_mlp(x, w1, w2, jnp.array([4, 4]), fp8=recipe), x, w1, w2)
  with pytest.raises(RuntimeError, match=r"fp8: this GPU cannot run the FP8 grouped MLP"):
    jax.eval_shape(lambda w: jaxmlp.fp8_weights(w, recipe), w1)


@pytest.mark.gpu
def test_backend_info_reports_fp8():
  cuda = jaxmlp.backend_info()["cuda"]
  if not cuda.get("devices"):
    pytest.skip("no CUDA device")
  ok, why = fp8_cuda.fp8_status()
  assert cuda["fp8_available"] is ok and cuda["fp8_why"] == why
  assert ok == (cuda["compute_capability"].startswith("9.") and cuda["grouped_available"])
  if ok:
    assert "block-scaled" in cuda["fp8_blockwise"]


@pytest.mark.parametrize("recipe, rows, pad", [("tensorwise", 2**31 - 16, 15), ("blockwise", 2**31 - 200, 127)])
def test_fp8_rejects_more_padded_rows_than_int32_indexes(recipe, rows, pad):
  """The weight gradients pad every group's rows to 16 (tensorwise) or 128 (blockwise): M + 15 E or
  M + 127 E must stay below 2^31, checked at trace time (abstract operands: nothing that large is
  allocated)."""
  x = jax.ShapeDtypeStruct((rows, 16), jnp.bfloat16)
  w1, w2 = jax.ShapeDtypeStruct((2, 16, 32), jnp.bfloat16), jax.ShapeDtypeStruct((2, 16, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match=rf"M \+ {pad} E must stay below 2\^31"):
    jax.eval_shape(lambda x, w1, w2: jaxmlp.grouped_mlp(x, w1, w2, jnp.array([4, 4]), fp8=recipe), x, w1, w2)


@pytest.mark.parametrize("recipe, case", [("tensorwise", "uneven"), ("blockwise", "blocks")])
def test_fp8_reference_is_the_emulation(rng, recipe, case):
  """jaxmlp.reference.grouped_mlp(fp8=...) and the CPU backend compute the same recipe (biases included)."""
  M, d, f, sizes = BLOCK_CASES[case]
  args, gs, dy = inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16, b1=True, b2=True)
  with jax.default_device(jax.devices("cpu")[0]):
    got = run(jaxmlp.grouped_mlp, args, gs, dy, "swiglu", fp8=recipe)
    want = run(jaxmlp.reference.grouped_mlp, args, gs, dy, "swiglu", fp8=recipe)
  # The two sum in float32 in different orders: where that moves a bfloat16 rounding, an element moves by
  # 2^-8 of itself (max_error 2.9e-3 was seen on dw1), and an e4m3 rounding of a or dh that follows moves more.
  for k, g, w in [("y", got[0], want[0])] + [(k, got[1][k], want[1][k]) for k in got[1]]:
    assert rel_error(g, w) < 1e-3 and max_error(g, w) < 1e-2, k


@pytest.mark.parametrize("recipe, case", [("tensorwise", "uneven"), ("blockwise", "blocks")])
@pytest.mark.parametrize("zero_padding", [True, False])
def test_fp8_padding_rows_are_never_read(platform, rng, recipe, case, zero_padding):
  """NaN in the padding rows of x and of y's cotangent reaches nothing: every value that is read (y's and
  dx's group rows, the weights', biases' and scales' gradients) is the call's on zeros there, bit for bit
  (the products' h and da unwritten there, which the biases' and scales' gradients read). An amax,
  a block scale or a cast over the whole buffer would carry the NaN everywhere. (What the expert-parallel
  layer needs before its FP8 experts may take buffers whose padding rows are left unwritten.) With
  zero_padding=False (the outputs' padding rows unwritten, poisoned by the tests' handlers) the group rows
  are those of zero_padding=True."""
  M, d, f, sizes = BLOCK_CASES[case]
  total = sum(sizes)
  args, gs, dy = inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16, b1=True, b2=True)
  results = [run(jaxmlp.grouped_mlp, dict(args, x=args["x"].at[total:].set(pad)), gs, dy.at[total:].set(pad),
                 "swiglu", fp8=EXACT[recipe], zero_padding=padding)
             for pad, padding in ((0, True), (jnp.nan, zero_padding))]
  (y0, g0), (y1, g1) = results
  f32 = lambda a: np.asarray(a, np.float32)
  np.testing.assert_array_equal(f32(y0[total:]), 0, err_msg="y's padding rows")
  np.testing.assert_array_equal(f32(g0["x"][total:]), 0, err_msg="dx's padding rows")
  np.testing.assert_array_equal(f32(y1[:total]), f32(y0[:total]), err_msg="y")
  for k in g0:
    rows = slice(0, total) if k in ("x", "scales") else slice(None)
    assert np.isfinite(f32(g0[k][rows])).all(), k
    np.testing.assert_array_equal(f32(g1[k][rows]), f32(g0[k][rows]), err_msg=k)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("tiny", [1e-37, 1e-40])
def test_fp8_tiny_amax_gives_finite_results(platform, rng, recipe, tiny):
  """An output gradient whose amax is tiny: 1e-37 (a normal float, but 448 / amax overflows float32) or 1e-40
  (a denormal). The tensorwise inverse scale 448 / amax would be infinite and 0 x inf = NaN (the padding rows'
  zeros, every element of the gradients after); it is clamped to the float32 maximum, as TransformerEngine
  does, with the dequantization scale its reciprocal. Every output is finite, y (which dy does not reach)
  equals the NumPy model, and no gradient is larger than the model's: their values are near float32's
  denormals, whose scales (2^-128, and the blockwise recipe's powers of two as small) the CPU flushes to
  zero, so the gradients through dy come out zero there."""
  M, d, f, sizes = CASES["uneven"]
  args, gs, dy = inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16)
  dy = jnp.asarray((np.asarray(dy, np.float32) * np.float32(tiny)).astype(ml_dtypes.bfloat16))  # XLA's CPU would flush
  assert 0 < np.abs(np.asarray(dy, np.float32)).max() < 448 / np.finfo(np.float32).max
  y, grads = run(jaxmlp.grouped_mlp, args, gs, dy, "swiglu", fp8=EXACT[recipe])
  n = {k: np.asarray(v, np.float64) for k, v in args.items() if v is not None}
  want_y, want = NUMPY_MODEL[recipe](n["x"], n["w1"], n["w2"], sizes, "swiglu", n.get("scales"),
                                     np.asarray(dy, np.float64), ml_dtypes.bfloat16)
  check_recipe(y, want_y, platform, "y")  # finite too (rel_error asserts it)
  for k, got in grads.items():
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all() and np.abs(got).max() <= 1.1 * np.abs(want[k]).max(), k


def test_tensorwise_quantizer_clamps_the_inverse_scale():
  """quantize_e4m3 and scale_of at an amax below 448 / FLT_MAX (normal values, which no platform flushes):
  the inverse scale is the float32 maximum, the dequantization scale 2^-128 (its float32 reciprocal), zeros
  stay zero, as in the NumPy model."""
  v = np.array([0.0, 1e-37, -3e-37, 2e-38, 0.0], np.float32)
  a = np.float32(3e-37)
  q = np.asarray(tensorwise.quantize_e4m3(jnp.asarray(v), jnp.asarray(a)).astype(jnp.float32), np.float64)
  np.testing.assert_array_equal(q, fp8_ref._quantize(v, a))
  assert np.isfinite(q).all() and q[0] == 0 and q[2] < 0 and np.abs(q).max() > 1
  assert float(tensorwise.scale_of(jnp.asarray(a))) == 2.0**-128 == fp8_ref._scale(a)
  # Above the clamp, the scales are as before: amax / 448 and 448 / amax.
  assert float(tensorwise.scale_of(jnp.float32(2.0))) == np.float32(2.0) / np.float32(448)
