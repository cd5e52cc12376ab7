"""Flax modules (jaxmlp.nnx, jaxmlp.linen), on CPU (the training example built on them: test_train_moe.py).

The MoE is checked against a dense float64 reference written here: every expert applied to every token,
combined through masks, with no sorting or grouped GEMM, so a permutation or capacity bug cannot hide in
shared code.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, serialization
from jax.sharding import PartitionSpec as P

import jaxmlp.linen
import jaxmlp.moe
import jaxmlp.nnx
import numpy_reference as ref
from jaxmlp.activations import resolve

E, D, F = 4, 16, 24  # experts, model width, expert hidden width

# Calls a module under jit: op-by-op dispatch would compile every small op and dominate the run time.
jit_call = nnx.jit(lambda module, *args: module(*args))


def random_init(scale):
  """An initializer giving non-zero values, so that biases take part in the checks."""
  return nnx.initializers.normal(scale)


def assert_close(actual, expected, tol, name=""):
  """Max abs error relative to the largest magnitude of `expected`."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
  scale = max(np.max(np.abs(expected)), 1e-30)
  err = np.max(np.abs(actual - expected)) / scale
  assert err <= tol, f"{name}: relative max error {err:.2e} > {tol:.0e}"


# ---- GroupedMLP ------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_mlp_params_and_output_shapes(activation):
  mlp = jaxmlp.nnx.GroupedMLP(E, D, F, activation=activation, use_bias=True, rngs=nnx.Rngs(0))
  fc1 = 2 * F if resolve(activation).gated else F
  assert mlp.w1.shape == (E, D, fc1) and mlp.w2.shape == (E, F, D)
  assert mlp.b1.shape == (E, fc1) and mlp.b2.shape == (E, D)
  assert mlp.w1.dtype == jnp.float32
  x = jax.random.normal(jax.random.key(1), (10, D))
  y = jit_call(mlp, x, jnp.array([3, 2, 4, 1], jnp.int32))
  assert y.shape == (10, D) and y.dtype == jnp.float32

  no_bias = jaxmlp.nnx.GroupedMLP(E, D, F, rngs=nnx.Rngs(0))
  assert no_bias.b1 is None and no_bias.b2 is None
  assert set(nnx.to_pure_dict(nnx.state(no_bias))) == {"w1", "w2"}


def test_grouped_mlp_dtypes():
  x = jax.random.normal(jax.random.key(1), (10, D))
  sizes = jnp.array([3, 2, 4, 1], jnp.int32)
  bf16_compute = jaxmlp.nnx.GroupedMLP(E, D, F, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert bf16_compute.w1.dtype == jnp.float32
  assert jit_call(bf16_compute, x, sizes).dtype == jnp.bfloat16
  bf16_params = jaxmlp.nnx.GroupedMLP(E, D, F, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert bf16_params.w1.dtype == jnp.bfloat16
  assert jit_call(bf16_params, x.astype(jnp.bfloat16), sizes).dtype == jnp.bfloat16

  linen_mlp = jaxmlp.linen.GroupedMLP(E, D, F, dtype=jnp.bfloat16)
  variables = jax.jit(linen_mlp.init)(jax.random.key(0), x, sizes)
  assert nn.meta.unbox(variables)["params"]["w1"].dtype == jnp.float32
  assert jax.jit(linen_mlp.apply)(variables, x, sizes).dtype == jnp.bfloat16


def test_grouped_mlp_rejects_unknown_impl():
  with pytest.raises(ValueError, match="impl"):
    jaxmlp.nnx.GroupedMLP(E, D, F, impl="triton", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_mlp_matches_reference_and_float64(rng, activation):
  # An empty expert and 3 padding rows at the end.
  sizes = np.array([4, 0, 6, 3], np.int32)
  m = 16
  keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
  x = jax.random.normal(keys[0], (m, D))
  scales = jax.random.uniform(keys[1], (m,), minval=0.2, maxval=1.0)
  cotangent = jax.random.normal(keys[2], (m, D))
  seed = int(rng.integers(2**31))  # the same parameters for both
  mlps = {impl: jaxmlp.nnx.GroupedMLP(E, D, F, activation=activation, use_bias=True, bias_init=random_init(0.3),
                                      impl=impl, rngs=nnx.Rngs(seed))
          for impl in ("jaxmlp", "reference")}

  results = {}
  for impl, mlp in mlps.items():
    graphdef, state = nnx.split(mlp)

    def loss(state, x, scales):
      y = nnx.merge(graphdef, state)(x, jnp.asarray(sizes), scales)
      return jnp.sum(y * cotangent), y

    grads, y = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(state, x, scales)
    results[impl] = (y, grads)

  # float64 NumPy: each row through its expert, the whole expert output scaled; padding rows are 0.
  params = nnx.to_pure_dict(nnx.state(mlps["jaxmlp"]))
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  xs, ss = np.asarray(x, np.float64), np.asarray(scales, np.float64)
  unscaled = np.zeros((m, D))
  row = 0
  for g, size in enumerate(sizes):
    rows = slice(row, row + size)
    unscaled[rows] = ref.activation(activation, xs[rows] @ p["w1"][g] + p["b1"][g])[0] @ p["w2"][g] + p["b2"][g]
    row += size

  y, grads = results["jaxmlp"]
  y_ref, grads_ref = results["reference"]
  assert_close(y, ss[:, None] * unscaled, 1e-5, "y vs float64")
  assert_close(y, y_ref, 1e-5, "y vs reference")
  np.testing.assert_array_equal(y[sizes.sum():], 0)
  for name, g, g_ref in zip(("params", "x", "scales"), grads, grads_ref):
    for path, leaf in jax.tree_util.tree_leaves_with_path(g):
      leaf_ref = dict(jax.tree_util.tree_leaves_with_path(g_ref))[path]
      assert_close(leaf, leaf_ref, 1e-5, f"d{name}{jax.tree_util.keystr(path)}")
  np.testing.assert_array_equal(grads[1][sizes.sum():], 0)
  np.testing.assert_array_equal(grads[2][sizes.sum():], 0)

  # Without scales the module is exactly the op: compare with the reference function called directly.
  y_unscaled = jit_call(mlps["jaxmlp"], x, jnp.asarray(sizes))
  direct = jaxmlp.reference.grouped_mlp(x, params["w1"], params["w2"], jnp.asarray(sizes), activation=activation,
                                        b1=params["b1"], b2=params["b2"])
  assert_close(y_unscaled, direct, 1e-5, "unscaled y vs jaxmlp.reference.grouped_mlp")
  assert_close(y_unscaled, unscaled, 1e-5, "unscaled y vs float64")


def test_grouped_mlp_bfloat16_matches_reference(rng):
  sizes = jnp.array([5, 3, 0, 7], jnp.int32)
  keys = jax.random.split(jax.random.key(int(rng.integers(2**31))))
  x = jax.random.normal(keys[0], (16, D), jnp.bfloat16)
  scales = jax.random.uniform(keys[1], (16,), minval=0.2, maxval=1.0)
  seed = int(rng.integers(2**31))
  outputs = [jit_call(jaxmlp.nnx.GroupedMLP(E, D, F, use_bias=True, bias_init=random_init(0.3),
                                            dtype=jnp.bfloat16, impl=impl, rngs=nnx.Rngs(seed)), x, sizes, scales)
             for impl in ("jaxmlp", "reference")]
  assert outputs[0].dtype == jnp.bfloat16
  assert_close(outputs[0], outputs[1], 2e-2, "bfloat16 y")


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("blockwise", marks=pytest.mark.full)])
def test_modules_run_their_experts_in_fp8(recipe):
  """fp8= on the modules: GroupedMLP (nnx and linen) computes jaxmlp.grouped_mlp(..., fp8=) of its
  parameters, and MoE passes it on (its output moves away from the bfloat16 one by FP8's error)."""
  f = 32  # FP8 takes widths that are multiples of 16
  sizes = jnp.array([5, 3, 0, 7], jnp.int32)
  x = jax.random.normal(jax.random.key(4), (16, D), jnp.bfloat16)
  mlp = jaxmlp.nnx.GroupedMLP(E, D, f, dtype=jnp.bfloat16, fp8=recipe, rngs=nnx.Rngs(6))
  y = jit_call(mlp, x, sizes)
  w1, w2 = (p[...].astype(jnp.bfloat16) for p in (mlp.w1, mlp.w2))
  np.testing.assert_array_equal(y, jax.jit(lambda *a: jaxmlp.grouped_mlp(*a, sizes, fp8=recipe))(x, w1, w2))
  assert not np.array_equal(y, jaxmlp.grouped_mlp(x, w1, w2, sizes))
  linen_mlp = jaxmlp.linen.GroupedMLP(E, D, f, dtype=jnp.bfloat16, fp8=recipe)
  np.testing.assert_array_equal(jax.jit(linen_mlp.apply)({"params": nnx.to_pure_dict(nnx.state(mlp))}, x, sizes), y)

  tokens = jax.random.normal(jax.random.key(5), (2, 8, D), jnp.bfloat16)
  outputs = [jit_call(jaxmlp.nnx.MoE(E, D, f, 2, dtype=jnp.bfloat16, fp8=fp8, rngs=nnx.Rngs(7)), tokens)[0]
             for fp8 in (recipe, None)]
  err = np.linalg.norm(np.subtract(*outputs, dtype=np.float64)) / np.linalg.norm(np.asarray(outputs[1], np.float64))
  assert 5e-3 < err < 0.2, err


def test_modules_take_an_fp8_history():
  """fp8_history= (delayed scaling) on GroupedMLP and MoE, nnx and linen: GroupedMLP's y and the history's
  gradient (its update) are jaxmlp.grouped_mlp's with the parameters; MoE's update holds its experts' amaxes
  first and the older ones shifted, linen's equal to nnx's (over an expert axis: test_expert_parallel)."""
  f = 32  # FP8 takes widths that are multiples of 16
  recipe = jaxmlp.Fp8Recipe("tensorwise", scaling="delayed", when="always")
  sizes = jnp.array([5, 3, 0, 7], jnp.int32)
  x = jax.random.normal(jax.random.key(4), (16, D), jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(5), (16, D), jnp.bfloat16)
  past = jnp.asarray(np.random.default_rng(3).uniform(0.5, 3.0, (4, 3)), jnp.float32)
  mlp = jaxmlp.nnx.GroupedMLP(E, D, f, dtype=jnp.bfloat16, fp8=recipe, rngs=nnx.Rngs(6))
  w1, w2 = (p[...].astype(jnp.bfloat16) for p in (mlp.w1, mlp.w2))
  linen_mlp = jaxmlp.linen.GroupedMLP(E, D, f, dtype=jnp.bfloat16, fp8=recipe)
  params = {"params": nnx.to_pure_dict(nnx.state(mlp))}
  calls = {"nnx": lambda x, h: mlp(x, sizes, fp8_history=h),
           "linen": lambda x, h: linen_mlp.apply(params, x, sizes, fp8_history=h),
           "grouped_mlp": lambda x, h: jaxmlp.grouped_mlp(x, w1, w2, sizes, fp8=recipe, fp8_history=h)}
  results = {k: jax.jit(lambda x, h, c=c: (lambda y, vjp: (y, vjp(dy)[1]))(*jax.vjp(c, x, h)))(x, past)
             for k, c in calls.items()}
  for k in ("nnx", "linen"):
    for got, want in zip(results[k], results["grouped_mlp"]):
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), k)
  new = np.asarray(results["nnx"][1])
  np.testing.assert_array_equal(new[:, 1:], np.asarray(past)[:, :-1])
  assert new[0, 0] == np.abs(np.asarray(x[:15], np.float32)).max()  # x's amax over its 15 rows in groups

  tokens = jax.random.normal(jax.random.key(7), (2, 8, D), jnp.bfloat16)
  moe = jaxmlp.nnx.MoE(E, D, f, 2, dtype=jnp.bfloat16, fp8=recipe, rngs=nnx.Rngs(8))
  linen_moe = jaxmlp.linen.MoE(E, D, f, 2, dtype=jnp.bfloat16, fp8=recipe)
  moe_params = {"params": nnx.to_pure_dict(nnx.state(moe))}
  loss = lambda y: jnp.sum(y[0].astype(jnp.float32) ** 2)
  updates = [jax.jit(jax.grad(lambda h: loss(moe(tokens, fp8_history=h))))(past),
             jax.jit(jax.grad(lambda h: loss(linen_moe.apply(moe_params, tokens, fp8_history=h))))(past)]
  np.testing.assert_array_equal(np.asarray(updates[0]), np.asarray(updates[1]))
  np.testing.assert_array_equal(np.asarray(updates[0])[:, 1:], np.asarray(past)[:, :-1])
  assert np.all(np.asarray(updates[0])[:, 0] > 0)  # every tensor observed


@pytest.mark.parametrize("fp8, impl", [(None, "jaxmlp"), ("tensorwise", "jaxmlp"), (None, "reference")])
def test_moe_leaves_padding_rows_unwritten_only_where_no_expert_reads_them(monkeypatch, fp8, impl):
  """The MoE modules run their experts with zero_padding=False (their result's padding rows go only to the
  combine), and ask the dispatch and combine for it where the experts are jaxmlp's MLP, which reads no
  padding row with or without FP8 (test_padding_rows_are_never_read, test_fp8_padding_rows_are_never_read);
  the reference MLP gets zeros there."""
  seen = {"mlp": [], "dispatch": [], "combine": []}

  def spy(name, fn):
    def call(*args, **kwargs):
      seen[name].append(kwargs.get("zero_padding", True))
      return fn(*args, **kwargs)
    return call

  monkeypatch.setitem(jaxmlp.moe.IMPLS, impl, spy("mlp", jaxmlp.moe.IMPLS[impl]))
  ops = jaxmlp.moe.DISPATCHERS[impl]
  for name in ("dispatch", "combine"):
    monkeypatch.setattr(ops, name, spy(name, getattr(ops, name)))
  f, dtype = 32, jnp.bfloat16  # FP8 takes widths that are multiples of 16
  tokens = jax.random.normal(jax.random.key(5), (2, 8, D), dtype)
  jit_call(jaxmlp.nnx.MoE(E, D, f, 2, dtype=dtype, fp8=fp8, impl=impl, capacity_factor=2.0, rngs=nnx.Rngs(7)), tokens)
  linen_moe = jaxmlp.linen.MoE(E, D, f, 2, dtype=dtype, fp8=fp8, impl=impl, capacity_factor=2.0)
  jax.jit(linen_moe.apply)(linen_moe.init(jax.random.key(0), tokens), tokens)
  zeros = impl == "reference"
  assert seen["mlp"] and set(seen["mlp"]) == {False}
  assert seen["dispatch"] and set(seen["dispatch"]) == set(seen["combine"]) == {zeros}


# The default run checks the modules' fp8_weights in test_fp8_weights_quantized_before_the_call_expert_parallel.
@pytest.mark.full
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_modules_take_their_fp8_weights_quantized_once(recipe):
  """MoE.fp8_weights() (nnx, and linen's apply(method="fp8_weights")): the experts' float32 parameters
  quantized once from bfloat16, then two micro-batches' calls with fp8_weights= give the loss and the
  gradients of calls that quantize themselves (gradients summed in float32 either way)."""
  f = 32  # FP8 takes widths that are multiples of 16
  batches = [jax.random.normal(jax.random.key(i), (2, 8, D), jnp.bfloat16) for i in (5, 6)]
  graphdef, params = nnx.split(jaxmlp.nnx.MoE(E, D, f, 2, dtype=jnp.bfloat16, fp8=recipe, rngs=nnx.Rngs(7)))

  def loss(params, quantize_once):
    moe = nnx.merge(graphdef, params)
    weights = moe.fp8_weights() if quantize_once else None
    return sum(jnp.sum(moe(x, fp8_weights=weights)[0].astype(jnp.float32) ** 2) for x in batches)

  linen_moe = jaxmlp.linen.MoE(E, D, f, 2, dtype=jnp.bfloat16, fp8=recipe)

  def linen_loss(params, quantize_once):
    weights = linen_moe.apply(params, method="fp8_weights") if quantize_once else None
    return sum(jnp.sum(linen_moe.apply(params, x, fp8_weights=weights)[0].astype(jnp.float32) ** 2) for x in batches)

  # Bit for bit here; 1e-6 allows a GPU's XLA to fuse the rest of the two programs differently, where
  # weights quantized otherwise would be ~1e-2 off.
  for fn, p in ((loss, params), (linen_loss, {"params": nnx.to_pure_dict(params)})):
    want, got = (jax.jit(jax.value_and_grad(fn), static_argnums=1)(p, once) for once in (False, True))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert g.dtype == w.dtype
      assert np.linalg.norm(np.float64(g) - np.float64(w)) <= 1e-6 * np.linalg.norm(np.float64(w))
  # The layers compute with the weights given, not their parameters: with w1 doubled, y moves.
  moe = nnx.merge(graphdef, params)
  w1q, w2q = moe.fp8_weights()
  assert w1q.weights.dtype == w2q.weights.dtype == jnp.float32  # the parameters: gradients add up in float32
  doubled = (jaxmlp.fp8_weights(2 * w1q.weights, recipe, dtype=jnp.bfloat16), w2q)
  for call in (lambda w: moe(batches[0], fp8_weights=w)[0],
               lambda w: linen_moe.apply({"params": nnx.to_pure_dict(params)}, batches[0], fp8_weights=w)[0]):
    assert not np.array_equal(call(doubled), call((w1q, w2q)))
  with pytest.raises(ValueError, match="fp8_weights: the layer was built with fp8=None"):
    jaxmlp.nnx.MoE(E, D, f, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(7)).fp8_weights()
  with pytest.raises(TypeError, match="the parameters are float32 and the layer's dtype is None"):
    jaxmlp.nnx.GroupedMLP(E, D, f, fp8=recipe, rngs=nnx.Rngs(7)).fp8_weights()


# ---- Sharding metadata ---------------------------------------------------------------------------------


EXPECTED_SPECS = {
  "router": {"kernel": P("embed", None)},
  "experts": {"w1": P("expert", "embed", "mlp"), "w2": P("expert", "mlp", "embed"),
              "b1": P("expert", "mlp"), "b2": P("expert", "embed")},
}


def test_nnx_params_carry_logical_axis_names():
  moe = jaxmlp.nnx.MoE(E, D, F, 2, use_bias=True, rngs=nnx.Rngs(0))
  assert moe.experts.w1.get_metadata("out_sharding") == ("expert", "embed", "mlp")
  specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(moe)))
  assert specs == EXPECTED_SPECS


def test_nnx_params_are_sharded_under_a_mesh():
  mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
  rules = (("expert", "ep"), ("embed", None), ("mlp", None))
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    mlp = jaxmlp.nnx.GroupedMLP(E, D, F, rngs=nnx.Rngs(0))
    assert mlp.w1[...].sharding.spec == P("ep", None, None)
    assert mlp.w2[...].sharding.spec == P("ep", None, None)
    y = jit_call(mlp, jax.random.normal(jax.random.key(1), (8, D)), jnp.array([2, 2, 2, 2], jnp.int32))
  assert np.all(np.isfinite(y))


def test_linen_params_carry_logical_axis_names():
  x = jax.random.normal(jax.random.key(1), (8, D))
  variables = jax.jit(jaxmlp.linen.MoE(E, D, F, 2, use_bias=True).init)(jax.random.key(0), x)
  assert isinstance(variables["params"]["experts"]["w1"], nn.LogicallyPartitioned)
  assert nn.get_partition_spec(variables)["params"] == EXPECTED_SPECS


# ---- MoE against a dense float64 reference -------------------------------------------------------------


def dense_moe(params, x, *, activation, top_k, score_func, renormalize, capacity_factor, aux_loss_coef,
              z_loss_coef):
  """Every expert on every token, combined with per-expert gates; run it under jax.enable_x64."""
  tokens = x.reshape(-1, x.shape[-1])
  num_tokens = tokens.shape[0]
  logits = tokens @ params["router"]["kernel"]
  num_experts = logits.shape[1]
  scores = jax.nn.softmax(logits) if score_func == "softmax" else jax.nn.sigmoid(logits)
  chosen = jnp.argsort(-scores, axis=1, stable=True)[:, :top_k]  # [T, k]
  weights = jnp.take_along_axis(scores, chosen, axis=1)
  if renormalize:
    weights = weights / weights.sum(axis=1, keepdims=True)
  capacity = math.ceil(capacity_factor * num_tokens * top_k / num_experts) if capacity_factor else None

  ex = params["experts"]
  act = resolve(activation)
  out = jnp.zeros_like(tokens)
  for e in range(num_experts):
    picked = (chosen.T == e)  # [k, T]: choice-major, the order in which capacity is handed out
    if capacity is not None:
      picked = picked & (jnp.cumsum(picked.reshape(-1)).reshape(picked.shape) <= capacity)
    gate = jnp.sum(jnp.where(picked, weights.T, 0), axis=0)  # [T]
    hidden = act(tokens @ ex["w1"][e] + (ex["b1"][e] if "b1" in ex else 0))
    out = out + gate[:, None] * (hidden @ ex["w2"][e] + (ex["b2"][e] if "b2" in ex else 0))

  probs = scores if score_func == "softmax" else scores / scores.sum(axis=1, keepdims=True)
  fraction = jnp.stack([jnp.sum(chosen == e) for e in range(num_experts)]) / (num_tokens * top_k)
  load_balancing = num_experts * jnp.sum(fraction * probs.mean(axis=0))
  z = jnp.mean(jax.nn.logsumexp(logits, axis=1) ** 2)
  aux = aux_loss_coef * load_balancing + z_loss_coef * z
  return out.reshape(x.shape), aux


MOE_CASES = [
  # activation, top_k, score_func, renormalize, capacity_factor, use_bias, impl
  ("swiglu", 2, "softmax", True, None, False, "jaxmlp"),
  pytest.param("swiglu", 2, "sigmoid", True, None, True, "jaxmlp", marks=pytest.mark.full),
  pytest.param("gelu", 2, "softmax", False, 0.5, True, "jaxmlp", marks=pytest.mark.full),
  pytest.param("swiglu", 3, "sigmoid", False, 0.75, False, "jaxmlp", marks=pytest.mark.full),
  ("geglu", 1, "softmax", False, 0.75, True, "jaxmlp"),
  ("swiglu", 2, "sigmoid", True, 0.5, True, "reference"),
]


@pytest.mark.parametrize("activation,top_k,score_func,renormalize,capacity_factor,use_bias,impl", MOE_CASES)
def test_moe_matches_dense_reference(rng, activation, top_k, score_func, renormalize, capacity_factor, use_bias,
                                     impl):
  coefs = dict(aux_loss_coef=0.1, z_loss_coef=0.01)
  options = dict(activation=activation, top_k=top_k, score_func=score_func, renormalize=renormalize,
                 capacity_factor=capacity_factor, **coefs)
  moe = jaxmlp.nnx.MoE(E, D, F, top_k, activation=activation, use_bias=use_bias, score_func=score_func,
                       renormalize=renormalize, capacity_factor=capacity_factor, bias_init=random_init(0.3),
                       impl=impl, rngs=nnx.Rngs(int(rng.integers(2**31))), **coefs)
  keys = jax.random.split(jax.random.key(int(rng.integers(2**31))))
  x = jax.random.normal(keys[0], (2, 12, D))
  cotangent = jax.random.normal(keys[1], x.shape)
  graphdef, state = nnx.split(moe)

  @jax.jit
  def loss_and_outputs(state, x):
    y, aux = nnx.merge(graphdef, state)(x)
    return jnp.sum(y * cotangent) + aux["aux_loss"], (y, aux)

  (_, (y, aux)), (dparams, dx) = jax.value_and_grad(loss_and_outputs, argnums=(0, 1), has_aux=True)(state, x)
  params = nnx.to_pure_dict(state)

  if capacity_factor is not None:  # the case drops rows: its capacity holds fewer than the 24 k choices
    _, experts, _ = jaxmlp.moe.route(x.reshape(-1, D) @ params["router"]["kernel"], top_k, score_func)
    capacity = math.ceil(capacity_factor * 24 * top_k / E)
    assert np.bincount(np.asarray(experts).ravel(), minlength=E).max() > capacity

  with jax.enable_x64(True):
    params64, x64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (params, x))

    def reference_loss(params, x):
      y, aux = dense_moe(params, x, **options)
      return jnp.sum(y * jnp.asarray(cotangent, jnp.float64)) + aux, (y, aux)

    (_, (y_ref, aux_ref)), (dparams_ref, dx_ref) = jax.jit(jax.value_and_grad(
      reference_loss, argnums=(0, 1), has_aux=True))(params64, x64)
    y_ref, aux_ref, dparams_ref, dx_ref = jax.tree.map(np.asarray, (y_ref, aux_ref, dparams_ref, dx_ref))

  assert y.shape == x.shape and y.dtype == jnp.float32
  assert_close(y, y_ref, 1e-5, "y")
  assert_close(aux["aux_loss"], aux_ref, 1e-5, "aux_loss")
  assert_close(dx, dx_ref, 1e-5, "dx")
  for path, grad_ref in jax.tree_util.tree_leaves_with_path(dparams_ref):
    grad = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(dparams)))[path]
    assert_close(grad, grad_ref, 1e-5, f"d{jax.tree_util.keystr(path)}")


def test_moe_dropped_tokens_get_zero_output_and_gradient():
  # One expert, capacity 2 of 6 tokens: only the first two tokens are served.
  moe = jaxmlp.nnx.MoE(1, D, F, 1, capacity_factor=1 / 3, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (6, D))
  y, _ = jit_call(moe, x)
  dx = nnx.jit(nnx.grad(lambda moe, x: jnp.sum(moe(x)[0] ** 2), argnums=1))(moe, x)
  assert np.all(np.abs(y[:2]) > 0) and np.all(np.abs(dx[:2]) > 0)
  np.testing.assert_array_equal(y[2:], 0)
  np.testing.assert_array_equal(dx[2:], 0)


def test_moe_shapes_and_dtypes():
  x = jax.random.normal(jax.random.key(0), (3, 5, D))
  moe = jaxmlp.nnx.MoE(E, D, F, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert moe.router.kernel.shape == (D, E) and moe.experts.w1.shape == (E, D, 2 * F)
  y, aux = jit_call(moe, x)
  assert y.shape == (3, 5, D) and y.dtype == jnp.bfloat16
  assert set(aux) == {"load_balancing_loss", "router_z_loss", "aux_loss"}
  assert all(v.shape == () and v.dtype == jnp.float32 for v in aux.values())
  y2, _ = jit_call(moe, x.reshape(15, D))  # tokens as rows: the same computation, the same rows out
  assert y2.shape == (15, D)
  np.testing.assert_array_equal(np.asarray(y2, np.float32), np.asarray(y.reshape(15, D), np.float32))

  linen_moe = jaxmlp.linen.MoE(E, D, F, 2, dtype=jnp.bfloat16)
  variables = jax.jit(linen_moe.init)(jax.random.key(0), x)
  y, aux = jax.jit(linen_moe.apply)(variables, x)
  assert y.shape == (3, 5, D) and y.dtype == jnp.bfloat16
  assert set(aux) == {"load_balancing_loss", "router_z_loss", "aux_loss"}


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_linen_moe_matches_nnx_moe_with_the_same_params(rng, capacity_factor):
  options = dict(activation="geglu", use_bias=True, score_func="sigmoid", capacity_factor=capacity_factor,
                 bias_init=random_init(0.3))
  nnx_moe = jaxmlp.nnx.MoE(E, D, F, 2, rngs=nnx.Rngs(int(rng.integers(2**31))), **options)
  x = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (2, 6, D))
  y, aux = jit_call(nnx_moe, x)
  linen_moe = jaxmlp.linen.MoE(E, D, F, 2, **options)
  layout = jax.tree.map(jnp.shape, nn.meta.unbox(jax.eval_shape(linen_moe.init, jax.random.key(0), x))["params"])
  params = nnx.to_pure_dict(nnx.state(nnx_moe))
  assert jax.tree.map(jnp.shape, params) == layout
  y_linen, aux_linen = jax.jit(linen_moe.apply)({"params": params}, x)
  np.testing.assert_allclose(y_linen, y, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(aux_linen["aux_loss"], aux["aux_loss"], rtol=1e-6)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_losses_on_a_hand_checkable_case(score_func):
  # Two experts, identity router: the logits are the tokens. Both tokens prefer expert 0.
  moe = jaxmlp.nnx.MoE(2, 2, F, 1, score_func=score_func, aux_loss_coef=0.1, z_loss_coef=0.01,
                       rngs=nnx.Rngs(0))
  moe.router.kernel[...] = jnp.eye(2)
  logits = np.array([[1 + math.log(3), 1.0], [1 + math.log(9), 1.0]])
  _, aux = jit_call(moe, jnp.asarray(logits, jnp.float32))

  if score_func == "softmax":
    p0 = (0.75 + 0.9) / 2  # softmax of logit gaps ln 3 and ln 9
  else:
    sig = lambda v: 1 / (1 + math.exp(-v))
    p0 = np.mean([sig(a) / (sig(a) + sig(b)) for a, b in logits])
  # f = (1, 0): every choice went to expert 0, so E * sum_e f_e P_e = 2 * P_0.
  load_balancing = 2 * p0
  z = ((1 + math.log(4)) ** 2 + (1 + math.log(10)) ** 2) / 2  # logsumexp = 1 + ln(1 + 3), 1 + ln(1 + 9)
  assert aux["load_balancing_loss"] == pytest.approx(0.1 * load_balancing, rel=1e-6)
  assert aux["router_z_loss"] == pytest.approx(0.01 * z, rel=1e-6)
  assert aux["aux_loss"] == pytest.approx(0.1 * load_balancing + 0.01 * z, rel=1e-6)


def test_moe_rejects_bad_arguments():
  with pytest.raises(ValueError, match="top_k"):
    jaxmlp.nnx.MoE(E, D, F, E + 1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="score_func"):
    jaxmlp.nnx.MoE(E, D, F, 2, score_func="relu", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="capacity_factor"):
    jaxmlp.nnx.MoE(E, D, F, 2, capacity_factor=0.0, rngs=nnx.Rngs(0))
  # An input of another width must not be reshaped into tokens of width D (mixing neighbours' features).
  x = jnp.ones((3, 2 * D))
  expected = rf"x: got shape \(3, {2 * D}\), expected \[\.\.\., d_model\] = \[\.\.\., {D}\]"
  with pytest.raises(ValueError, match=expected):
    jaxmlp.nnx.MoE(E, D, F, 2, rngs=nnx.Rngs(0))(x)
  with pytest.raises(ValueError, match=expected):
    jaxmlp.linen.MoE(E, D, F, 2).init(jax.random.key(0), x)


def test_moe_of_no_tokens_has_zero_losses():
  """An empty batch (say, an empty last shard) gives no output rows and zero losses, not NaN."""
  x = jnp.ones((0, D))
  moe = jaxmlp.nnx.MoE(E, D, F, 2, aux_loss_coef=0.1, z_loss_coef=0.01, rngs=nnx.Rngs(0))
  y, aux = moe(x)
  linen_moe = jaxmlp.linen.MoE(E, D, F, 2, aux_loss_coef=0.1, z_loss_coef=0.01)
  y_linen, aux_linen = linen_moe.apply(linen_moe.init(jax.random.key(0), x), x)
  assert y.shape == y_linen.shape == (0, D)
  for losses in (aux, aux_linen):
    assert {k: float(v) for k, v in losses.items()} == {"load_balancing_loss": 0.0, "router_z_loss": 0.0,
                                                         "aux_loss": 0.0}


# ---- Save and restore ---------------------------------------------------------------------------------


def test_nnx_save_and_restore_gives_identical_outputs(tmp_path):
  options = dict(use_bias=True, capacity_factor=0.75, bias_init=random_init(0.3))
  moe = jaxmlp.nnx.MoE(E, D, F, 2, rngs=nnx.Rngs(0), **options)
  x = jax.random.normal(jax.random.key(1), (10, D))
  y, _ = jit_call(moe, x)

  flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(moe)))[0]
  np.savez(tmp_path / "params.npz", **{jax.tree_util.keystr(path): np.asarray(a) for path, a in flat})
  saved = np.load(tmp_path / "params.npz")

  # Restore into a model built from another seed, without allocating its parameters.
  graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: jaxmlp.nnx.MoE(E, D, F, 2, rngs=nnx.Rngs(1),
                                                                              **options)))
  pure = nnx.to_pure_dict(abstract_state)
  pure = jax.tree_util.tree_map_with_path(lambda path, _: jnp.asarray(saved[jax.tree_util.keystr(path)]), pure)
  nnx.replace_by_pure_dict(abstract_state, pure)
  restored = nnx.merge(graphdef, abstract_state)
  np.testing.assert_array_equal(jit_call(restored, x)[0], y)
  assert restored.experts.w1.get_metadata("out_sharding") == ("expert", "embed", "mlp")


def test_linen_save_and_restore_gives_identical_outputs():
  moe = jaxmlp.linen.MoE(E, D, F, 2, use_bias=True)
  x = jax.random.normal(jax.random.key(1), (10, D))
  init = jax.jit(moe.init)
  variables, other = init(jax.random.key(0), x), init(jax.random.key(1), x)
  restored = serialization.from_bytes(other, serialization.to_bytes(variables))
  apply = jax.jit(moe.apply)
  np.testing.assert_array_equal(apply(restored, x)[0], apply(variables, x)[0])
