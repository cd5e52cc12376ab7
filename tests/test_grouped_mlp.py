"""jaxmlp.grouped_mlp against the float64 NumPy reference, on every backend the machine has."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOLERANCE, check_close, check_padding_rows_zero, float32_backends, rel_error, skip_unless_served

import jaxmlp
import numpy_reference as ref
from jaxmlp import _checks, _groups, mlp

# (M, d, f, group_sizes): odd sizes, one expert, empty groups, padding rows, skewed sizes.
CASES = {
    "basic": (64, 32, 48, [20, 12, 32]),
    "odd": (37, 13, 7, [5, 0, 19, 13]),
    "one_expert": (24, 16, 16, [24]),
    "padding": (50, 16, 24, [10, 0, 15]),
    "skewed": (96, 24, 40, [0, 90, 1, 0, 5, 0]),
    "all_empty": (16, 8, 8, [0, 0]),
}


def make_inputs(rng, M, d, f, sizes, act, dtype, bias=False, scales=False):
  E, F1 = len(sizes), (2 * f if act in ref.GATED else f)
  cast = lambda a: jnp.asarray(a, dtype)
  args = dict(
      x=cast(rng.standard_normal((M, d))),
      w1=cast(rng.standard_normal((E, d, F1)) / np.sqrt(d)),
      w2=cast(rng.standard_normal((E, f, d)) / np.sqrt(f)),
      group_sizes=jnp.asarray(sizes, jnp.int32),
  )
  if bias:
    args["b1"] = cast(rng.standard_normal((E, F1)) * 0.5)
    args["b2"] = cast(rng.standard_normal((E, d)) * 0.5)
  if scales:
    args["scales"] = cast(rng.uniform(0.1, 1.0, M))
  return args


def numpy_args(args):
  return {k: np.asarray(v, np.float64) if k != "group_sizes" else np.asarray(v) for k, v in args.items()}


def check_forward_and_grads(args, act, dtype, rng, alpha=1.702, limit=7.0):
  activation = jaxmlp.Activation(act, alpha=alpha, limit=limit)
  names = [k for k in args if k != "group_sizes"]
  dy = jnp.asarray(rng.standard_normal(args["x"].shape), dtype)

  def f(*diff):
    kw = dict(zip(names, diff))
    return jaxmlp.grouped_mlp(kw.pop("x"), kw.pop("w1"), kw.pop("w2"), args["group_sizes"], activation=activation, **kw)

  y, vjp = jax.vjp(f, *[args[k] for k in names])
  grads = dict(zip(names, vjp(dy)))
  n = numpy_args(args)
  want_y, want = ref.grouped_mlp(n["x"], n["w1"], n["w2"], n["group_sizes"], act, n.get("b1"), n.get("b2"),
                                 n.get("scales"), dy=np.asarray(dy, np.float64), alpha=alpha, limit=limit)
  tol = TOLERANCE[jnp.dtype(dtype).name]
  assert y.dtype == dtype
  check_close(y, want_y, tol, "y")
  for k in names:
    assert grads[k].dtype == args[k].dtype, k
    check_close(grads[k], want[k], tol, k)
  # Padding rows: output 0 and no gradient, whatever the dtype.
  check_padding_rows_zero(n["x"].shape[0], n["group_sizes"], y, grads["x"])


@pytest.mark.matrix
@float32_backends
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("act", jaxmlp.ACTIVATIONS)
def test_every_activation_float32(backend, rng, case, act):
  M, d, f, sizes = CASES[case]
  check_forward_and_grads(make_inputs(rng, M, d, f, sizes, act, jnp.float32), act, jnp.float32, rng)


# Every activation with a continuous derivative. relu and reglu are left to the float32 test: their
# derivative jumps at 0, where 16-bit rounding of h moves a few elements across, each an O(1) error
# (seen in a trial on the tiled path: 0.011 for reglu in float16, 0.039 for relu in bfloat16, over
# this test's tolerances).
@pytest.mark.matrix
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("act", [a for a in jaxmlp.ACTIVATIONS if a not in ("relu", "reglu")])
def test_dtypes_with_biases_and_scales(backend, rng, dtype, act):
  skip_unless_served(backend, dtype)
  # Row lengths that are multiples of 8 so the CUDA grouped and tiled paths take these too; f = 40 and
  # d = 32 end the tiled kernel's 64-wide tiles part-way.
  args = make_inputs(rng, 96, 32, 40, [30, 0, 50, 8], act, dtype, bias=True, scales=True)
  check_forward_and_grads(args, act, dtype, rng)


@float32_backends
def test_clamped_swiglu_clamps(backend, rng):
  # A small limit so that a large share of the gate and linear values sit outside it.
  args = make_inputs(rng, 64, 16, 32, [30, 30], "clamped_swiglu", jnp.float32, bias=True, scales=True)
  check_forward_and_grads(args, "clamped_swiglu", jnp.float32, rng, alpha=1.2, limit=0.3)


# No rows, no model width or no hidden width: what is left (biases, zeros) is still right, on every backend.
@float32_backends
@pytest.mark.parametrize("M, d, f", [(0, 16, 8), (24, 0, 8), (24, 16, 0)])
def test_empty_dimensions(backend, rng, M, d, f):
  args = make_inputs(rng, M, d, f, [10, 0, 9], "swiglu", jnp.float32, bias=True, scales=True)
  check_forward_and_grads(args, "swiglu", jnp.float32, rng)


# Sizes of any integer dtype mean what their values say: no wrap in the cast to int32 (uint32 2**31 + 1)
# or in the cap at M (300 rows against int8 and uint8 sizes).
@float32_backends
@pytest.mark.parametrize("dtype, sizes", [(np.uint32, [2**31 + 1, 0, 7]), (np.int8, [-5, 100, 120]),
                                          (np.uint8, [100, 100, 100]), (np.int16, [-300, 200, 30000])])
def test_group_sizes_of_other_integer_dtypes(backend, rng, dtype, sizes):
  args = make_inputs(rng, 300, 16, 16, [0] * len(sizes), "swiglu", jnp.float32, bias=True, scales=True)
  args["group_sizes"] = jnp.asarray(np.asarray(sizes).astype(dtype))
  check_forward_and_grads(args, "swiglu", jnp.float32, rng)
  n = numpy_args(args)
  out = jaxmlp.ragged_dot(args["x"], args["w1"], args["group_sizes"])
  assert rel_error(out, ref.ragged_dot(n["x"], n["w1"], n["group_sizes"])) < TOLERANCE["float32"]


# A NaN in a row reaches that row's output on every path, as in the reference (jax.nn.relu(nan) is nan):
# the activations' comparisons must not turn it into a finite value that a check on the loss cannot see.
@pytest.mark.matrix
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("act", jaxmlp.ACTIVATIONS)
def test_nan_rows_stay_nan(backend, rng, dtype, act):
  skip_unless_served(backend, dtype)
  args = make_inputs(rng, 48, 16, 24, [20, 0, 28], act, dtype, bias=True)
  args["x"] = args["x"].at[np.array([5, 30])].set(jnp.nan)
  for y in (jaxmlp.grouped_mlp(**args, activation=act), jaxmlp.reference.grouped_mlp(**args, activation=act)):
    y = np.asarray(y, np.float32)
    assert np.isnan(y[[5, 30]]).all() and np.isfinite(np.delete(y, [5, 30], axis=0)).all()


# NumPy's default integer is int64. Without x64 JAX would narrow such an array to int32 by wrapping
# (2**32 + 5 to 5, -2**40 to 0) before any clamp on the device ran: jaxmlp clamps NumPy sizes on the host.
@float32_backends
def test_numpy_int64_group_sizes_keep_their_values(backend, rng):
  args = make_inputs(rng, 40, 16, 16, [0, 0, 0], "swiglu", jnp.float32, bias=True, scales=True)
  args["group_sizes"] = np.array([3, 2**32 + 5, -2**40], np.int64)  # rows 3.. all in group 1
  check_forward_and_grads(args, "swiglu", jnp.float32, rng)
  n = numpy_args(args)
  out = jaxmlp.ragged_dot(args["x"], args["w1"], args["group_sizes"])
  assert rel_error(out, ref.ragged_dot(n["x"], n["w1"], n["group_sizes"])) < TOLERANCE["float32"]
  with pytest.raises(ValueError, match=r"sizes sum to 4294967304 > M = 40"):
    jaxmlp.grouped_mlp(args["x"], args["w1"], args["w2"], args["group_sizes"], check_group_sizes=True)


@pytest.mark.parametrize("m, sizes, want", [
    (2**30 + 5, [2**30, 2**30, 7], [2**30, 5, 0]),  # the running total passes 2^31 before the cap
    (2**31 - 1, [2**31 - 1, 2**31 - 1, -(2**31), 1], [2**31 - 1, 0, 0, 0]),
    (100, [-1, 60, 30, 2**31 - 1, 4], [0, 60, 30, 10, 0]),
])
def test_clamped_group_sizes_at_the_int32_limit(m, sizes, want):
  """The policy's running total is capped at M without wrapping int32, for any M up to 2^31 - 1."""
  got = _groups.clamp_group_sizes(jnp.asarray(sizes, jnp.int32), m)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.diff(ref.clamp_sizes(sizes, m)), want)


def test_int32_group_sizes_reach_the_handlers_as_they_are():
  """The handlers clamp int32 sizes themselves (test_adversarial_group_sizes_are_clamped checks that they
  get it right), so no XLA op runs ahead of the custom calls; on a GPU it was a kernel launch per step.
  Other dtypes are clamped in their own dtype first (the test above checks the values)."""
  M, d, f, E = 64, 16, 32, 4
  x, w1, w2 = jnp.ones((M, d)), jnp.ones((E, d, 2 * f)), jnp.ones((E, f, d))

  def step(x, w1, w2, gs):
    return jax.grad(lambda x, w1, w2: jaxmlp.grouped_mlp(x, w1, w2, gs).sum(), argnums=(0, 1, 2))(x, w1, w2)

  for dtype, clamped in ((jnp.int32, False), (jnp.int16, True)):
    hlo = jax.jit(step).lower(x, w1, w2, jnp.full((E,), M // E, dtype)).as_text()
    ops = {op for op in ("clamp", "maximum", "minimum", "convert") if f"stablehlo.{op}" in hlo}
    assert bool(ops) == clamped, (dtype, ops)


def test_saved_fc1_output_holds_every_group_row(backend, rng):
  """The forward's residual h, which the backward reads in the group rows: x @ w1[g] + b1[g] there (its
  padding rows are never read, and the CUDA handlers leave them unwritten)."""
  M, d, f, sizes = 96, 32, 40, [30, 0, 50, 8]
  a = make_inputs(rng, M, d, f, sizes, "swiglu", jnp.bfloat16, bias=True)
  act = jaxmlp.Activation("swiglu")
  shape = _checks.check_mlp(a["x"], a["w1"], a["w2"], a["group_sizes"], act, a["b1"], a["b2"])
  _, h = mlp.mlp_forward(a["x"], a["w1"], a["w2"], a["group_sizes"], a["b1"], a["b2"], None, act, shape)
  n = numpy_args(a)
  want = ref.ragged_dot(n["x"], n["w1"], sizes)
  want[:sum(sizes)] += np.repeat(n["b1"], sizes, axis=0)
  total = sum(sizes)
  assert rel_error(h[:total], want[:total]) < TOLERANCE["bfloat16"]


@pytest.mark.parametrize("zero_padding", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_padding_rows_are_never_read(backend, rng, dtype, zero_padding):
  """NaN in the padding rows of x and of y's cotangent reaches nothing: y's group rows and every gradient
  are the reference's on zeros there. With zero_padding y and dx are zeros in the padding rows; without,
  the CUDA handlers leave them unwritten (poisoned here), for callers that never read them."""
  skip_unless_served(backend, dtype)
  M, d, f, sizes = 96, 32, 40, [30, 0, 50, 8]
  total = sum(sizes)
  a = make_inputs(rng, M, d, f, sizes, "swiglu", dtype, bias=True, scales=True)
  dy = jnp.asarray(rng.standard_normal((M, d)), dtype)
  n = numpy_args(a)  # the reference reads zeros in the padding rows
  n["x"][total:] = 0
  dy_ref = np.asarray(dy, np.float64)
  dy_ref[total:] = 0
  x, dy = a["x"].at[total:].set(jnp.nan), dy.at[total:].set(jnp.nan)

  def f(x, w1, w2, b1, b2, scales):
    return jaxmlp.grouped_mlp(x, w1, w2, a["group_sizes"], b1=b1, b2=b2, scales=scales, zero_padding=zero_padding)

  names = ["x", "w1", "w2", "b1", "b2", "scales"]
  y, vjp = jax.vjp(f, x, *[a[k] for k in names[1:]])
  grads = dict(zip(names, vjp(dy)))
  want_y, want = ref.grouped_mlp(n["x"], n["w1"], n["w2"], n["group_sizes"], "swiglu", n["b1"], n["b2"],
                                 n["scales"], dy=dy_ref)
  tol = TOLERANCE[jnp.dtype(dtype).name]
  check_close(y[:total], want_y[:total], tol, "y")
  for k in names:
    rows = slice(0, total) if k in ("x", "scales") else slice(None)
    check_close(grads[k][rows], want[k][rows], tol, k)
  if zero_padding:
    check_padding_rows_zero(M, sizes, y, grads["x"])


@pytest.mark.matrix
@pytest.mark.parametrize("sizes", [[-5, 40, 100], [70, 70], [2**31 - 1, 3], [-(2**31), 2**31 - 1, 5]])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_adversarial_group_sizes_are_clamped(backend, rng, sizes, dtype):
  skip_unless_served(backend, dtype)
  args = make_inputs(rng, 48, 16, 16, sizes, "swiglu", dtype, bias=True, scales=True)
  check_forward_and_grads(args, "swiglu", dtype, rng)


def test_reference_matches_numpy(rng):
  for act in jaxmlp.ACTIVATIONS:
    args = make_inputs(rng, 50, 16, 24, [10, 0, 15, 20], act, jnp.float32, bias=True, scales=True)
    n = numpy_args(args)
    got = jaxmlp.reference.grouped_mlp(**args, activation=act)
    want = ref.grouped_mlp(n["x"], n["w1"], n["w2"], n["group_sizes"], act, n["b1"], n["b2"], n["scales"])
    assert rel_error(got, want) < 1e-5, act


def test_activation_derivatives_match_jax_autodiff(rng):
  """The hand-written NumPy derivatives (the test oracle) against autodiff of jaxmlp.activations."""
  with jax.enable_x64(True):
    for name in jaxmlp.ACTIVATIONS:
      act = jaxmlp.Activation(name, alpha=1.3, limit=0.8)
      h = rng.standard_normal((8, 12)) * 2
      val, (dgate, dup) = ref.activation(name, h, act.alpha, act.limit)
      np.testing.assert_allclose(act(jnp.asarray(h)), val, rtol=1e-12, atol=1e-12)
      ct = rng.standard_normal(val.shape)
      (got,) = jax.vjp(act, jnp.asarray(h))[1](jnp.asarray(ct))
      want = np.concatenate([ct * dgate, ct * dup], 1) if dup is not None else ct * dgate
      np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_jit_grad_value_and_grad_checkpoint(backend, rng, dtype):
  skip_unless_served(backend, dtype)
  args = make_inputs(rng, 64, 16, 32, [20, 30, 14], "swiglu", dtype, scales=True)
  gs = args["group_sizes"]
  tol = TOLERANCE[jnp.dtype(dtype).name]

  def loss(x, w1, w2, s):
    return jnp.sum(jaxmlp.grouped_mlp(x, w1, w2, gs, scales=s).astype(jnp.float32) ** 2)

  n = numpy_args(args)
  y = ref.grouped_mlp(n["x"], n["w1"], n["w2"], n["group_sizes"], "swiglu", scales=n["scales"])
  _, want = ref.grouped_mlp(n["x"], n["w1"], n["w2"], n["group_sizes"], "swiglu", scales=n["scales"], dy=2 * y)
  xs = (args["x"], args["w1"], args["w2"], args["scales"])
  for fn in (jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))),
             jax.jit(jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3)))):
    v, g = fn(*xs)
    assert rel_error(v, np.sum(y**2)) < tol
    for a, k in zip(g, ("x", "w1", "w2", "scales")):
      check_close(a, want[k], tol, k)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vmap_over_a_batch_of_calls(backend, rng, dtype):
  skip_unless_served(backend, dtype)
  args = [make_inputs(rng, 32, 8, 16, sizes, "silu", dtype) for sizes in ([10, 22], [0, 30], [5, 5])]
  stack = {k: jnp.stack([a[k] for a in args]) for k in args[0]}
  dy = jnp.asarray(rng.standard_normal(stack["x"].shape), dtype)
  tol = TOLERANCE[jnp.dtype(dtype).name]

  def one(x, w1, w2, gs, dy):
    y, vjp = jax.vjp(lambda x, w1, w2: jaxmlp.grouped_mlp(x, w1, w2, gs, activation="silu"), x, w1, w2)
    return y, vjp(dy)

  got_y, got_grads = jax.vmap(one)(stack["x"], stack["w1"], stack["w2"], stack["group_sizes"], dy)
  for i, a in enumerate(args):
    n = numpy_args(a)
    want_y, want = ref.grouped_mlp(n["x"], n["w1"], n["w2"], n["group_sizes"], "silu", dy=np.asarray(dy[i], np.float64))
    check_close(got_y[i], want_y, tol, "y")
    for g, k in zip(got_grads, ("x", "w1", "w2")):
      check_close(g[i], want[k], tol, k)


def test_check_group_sizes_raises_the_documented_errors(rng):
  """ValueError where the sizes are concrete (outside jit), at the call; under jit, at run time, the
  JaxRuntimeError that JAX makes of the host callback's ValueError, with the same message."""
  args = make_inputs(rng, 16, 8, 8, [10, 10], "relu", jnp.float32)
  call = lambda a: jaxmlp.grouped_mlp(**a, activation="relu", check_group_sizes=True)
  for sizes, says in (([10, 10], r"\[10, 10\]: sizes sum to 20 > M = 16 \(check_group_sizes=True\)"),
                      ([-1, 10], r"\[-1, 10\]: negative entries \(check"),
                      ([-5, 18], r"\[-5, 18\]: negative entries and sizes sum to 18 > M = 16")):
    bad = dict(args, group_sizes=jnp.asarray(sizes, jnp.int32))
    with pytest.raises(ValueError, match=says):
      call(bad)
    with pytest.raises(jax.errors.JaxRuntimeError, match="ValueError: group_sizes " + says):
      jax.block_until_ready(jax.jit(call)(bad))
  ok = dict(args, group_sizes=jnp.asarray([6, 10], jnp.int32))
  jax.block_until_ready(call(ok))
  jax.block_until_ready(jax.jit(call)(ok))


def test_operands_are_checked_once_per_call(monkeypatch):
  """The public op validates its operands; its forward and backward rules take the checked sizes."""
  calls = []
  check = _checks.check_mlp
  monkeypatch.setattr(_checks, "check_mlp", lambda *a, **k: calls.append(1) or check(*a, **k))
  x, w1, w2, gs = jnp.ones((16, 8)), jnp.ones((2, 8, 16)), jnp.ones((2, 8, 8)), jnp.asarray([8, 8], jnp.int32)
  jax.grad(lambda x: jaxmlp.grouped_mlp(x, w1, w2, gs).sum())(x)
  assert len(calls) == 1


def test_op_scales_the_whole_expert_output_bias_included(backend, rng):
  """y = s * (act(x @ w1 + b1) @ w2 + b2): with w2 = 0 only s * b2 is left, and the gradients of b2 and of
  the scales are sum(s * dy) and <dy, b2[g]>: checked by hand, on every backend."""
  sizes = [30, 0, 50, 8]
  args = make_inputs(rng, 96, 32, 40, sizes, "swiglu", jnp.bfloat16, bias=True, scales=True)
  args["w2"] = jnp.zeros_like(args["w2"])
  dy = jnp.asarray(rng.standard_normal((96, 32)), jnp.bfloat16)
  y, vjp = jax.vjp(lambda b2, s: jaxmlp.grouped_mlp(**dict(args, b2=b2, scales=s)), args["b2"], args["scales"])
  db2, ds = vjp(dy)
  n = numpy_args(args)
  group = np.repeat(np.arange(4), sizes)
  want_y = np.zeros((96, 32))
  want_y[:88] = n["scales"][:88, None] * n["b2"][group]
  tol = TOLERANCE["bfloat16"]
  check_close(y, want_y, tol, "y")
  d = np.asarray(dy, np.float64)
  want_db2 = np.stack([(n["scales"][:88, None] * d[:88])[group == g].sum(0) for g in range(4)])
  check_close(db2, want_db2, tol, "b2")
  want_ds = np.zeros(96)
  want_ds[:88] = (d[:88] * n["b2"][group]).sum(1)
  check_close(ds, want_ds, tol, "scales")


SECOND_ORDER = r"grad of grad, jax.hessian\) is not implemented. Use jaxmlp.reference.grouped_mlp"


def test_second_derivatives_say_to_use_the_reference(rng):
  args = make_inputs(rng, 16, 8, 8, [8, 8], "swiglu", jnp.float32, bias=True, scales=True)
  loss = lambda x: jaxmlp.grouped_mlp(**dict(args, x=x)).sum()
  x = args["x"]
  for second in (jax.grad(lambda x: jax.grad(loss)(x).sum()), jax.hessian(loss),
                 jax.jit(jax.grad(lambda x: jax.grad(loss)(x).sum()))):
    with pytest.raises(NotImplementedError, match=SECOND_ORDER):
      second(x)
  rd = lambda lhs: jaxmlp.ragged_dot(lhs, args["w1"], args["group_sizes"]).sum()
  with pytest.raises(NotImplementedError, match=SECOND_ORDER):
    jax.grad(lambda lhs: jax.grad(rd)(lhs).sum())(x)
  # Forward mode: a TypeError, as JAX's own for a custom_vjp, that names the way on.
  forward = r"forward mode \(jax.jvp, jax.jacfwd\) is not implemented. Use jaxmlp.reference.grouped_mlp"
  for forward_mode in (lambda: jax.jvp(loss, (x,), (x,)), lambda: jax.jacfwd(loss)(x),
                       lambda: jax.jvp(rd, (x,), (x,)), lambda: jax.jit(lambda x: jax.jvp(loss, (x,), (x,)))(x)):
    with pytest.raises(TypeError, match=forward):
      forward_mode()


def test_reference_differentiates_again_in_float64(rng):
  """Where jaxmlp's ops stop (forward mode, second derivatives), the reference goes on, in float64."""
  with jax.enable_x64(True):
    args = make_inputs(rng, 24, 8, 8, [10, 0, 9], "silu", jnp.float64, bias=True, scales=True)
    n = numpy_args(args)
    y = jaxmlp.reference.grouped_mlp(**args, activation="silu")
    assert y.dtype == jnp.float64
    want = ref.grouped_mlp(n["x"], n["w1"], n["w2"], n["group_sizes"], "silu", n["b1"], n["b2"], n["scales"])
    assert rel_error(y, want) < 1e-12
    ds = rng.standard_normal(24)
    f = lambda s: jaxmlp.reference.grouped_mlp(**dict(args, scales=s), activation="silu")
    _, tangent = jax.jvp(f, (args["scales"],), (jnp.asarray(ds),))
    # y is linear in each row's scale: the tangent is the unscaled row times the scale's tangent.
    unscaled = ref.grouped_mlp(n["x"], n["w1"], n["w2"], n["group_sizes"], "silu", n["b1"], n["b2"], np.ones(24))
    assert rel_error(tangent, unscaled * ds[:, None]) < 1e-12
    # A Hessian-vector product (forward over reverse) against central differences of the gradient.
    grad = jax.grad(lambda x: jnp.sum(jaxmlp.reference.grouped_mlp(**dict(args, x=x), activation="silu") ** 2))
    v = jnp.zeros_like(args["x"]).at[3].set(jnp.asarray(rng.standard_normal(8)))  # one row of group 0
    _, hvp = jax.jvp(grad, (args["x"],), (v,))
    eps = 1e-6
    fd = (grad(args["x"] + eps * v) - grad(args["x"] - eps * v)) / (2 * eps)
    assert rel_error(hvp, fd) < 1e-6
    assert np.asarray(hvp)[3].any() and not np.delete(np.asarray(hvp), 3, axis=0).any()  # rows do not interact


def test_a_flag_that_is_not_a_bool_is_a_type_error():
  x, w1, w2, sizes = jnp.ones((16, 8)), jnp.ones((2, 8, 16)), jnp.ones((2, 8, 8)), jnp.asarray([8, 8], jnp.int32)
  with pytest.raises(TypeError, match=r"zero_padding: expected True or False, got 0"):
    jaxmlp.grouped_mlp(x, w1, w2, sizes, zero_padding=0)


@pytest.mark.parametrize("error, change, match", [
    (ValueError, dict(x=jnp.ones((4, 8, 2))), r"x: got shape \(4, 8, 2\), expected \[M, d\]"),
    (ValueError, dict(w1=jnp.ones((2, 9, 16))), r"w1: got shape \(2, 9, 16\), expected \[E, d, 2f\] = \[2, 8, 16\]"),
    (ValueError, dict(w1=jnp.ones((2, 8, 15))), r"w1: .*even last dimension"),
    (ValueError, dict(w1=jnp.ones((0, 8, 16)), w2=jnp.ones((0, 8, 8)), group_sizes=jnp.ones((0,), jnp.int32)),
     r"w1: got shape \(0, 8, 16\), expected \[E, 8, 2f\] with E >= 1"),
    (ValueError, dict(w2=jnp.ones((2, 8, 9))), r"w2: got shape \(2, 8, 9\), expected \[E, f, d\] = \[2, 8, 8\]"),
    (ValueError, dict(w1=jnp.ones((2, 8, 8))),  # ungated weights with the default, gated, activation: w1 is to blame
     r"w1: got shape \(2, 8, 8\), expected \[E, d, 2f\] = \[2, 8, 16\] \(f = 8 from w2 \(2, 8, 8\)\): the gated "
     r"'swiglu' takes the gate and the linear part in w1, 2f columns \(w1 is f wide: for an ungated MLP use one "
     r"of gelu, relu, silu, squared_relu\)"),
    (ValueError, dict(activation="relu"),  # gated weights with an ungated activation
     r"w1: got shape \(2, 8, 16\), expected \[E, d, f\] = \[2, 8, 8\] \(f = 8 from w2 \(2, 8, 8\)\): 'relu' is not "
     r"gated, so w1 has f columns \(w1 is 2f wide: for a gated MLP use one of swiglu, geglu, reglu, clamped_swiglu\)"),
    (ValueError, dict(w2=jnp.ones((2, 6, 8))),
     r"w1: got shape \(2, 8, 16\), expected \[E, d, 2f\] = \[2, 8, 12\] \(f = 6 from w2"),
    (ValueError, dict(w2=jnp.ones((3, 8, 8))),
     r"w2: got shape \(3, 8, 8\), expected \[E, f, d\] = \[2, 8, 8\] \(E and f from w1"),
    (ValueError, dict(group_sizes=jnp.ones((3,), jnp.int32)), r"group_sizes: got shape \(3,\), expected \[2\]"),
    (TypeError, dict(group_sizes=jnp.ones((2,), jnp.float32)), r"group_sizes: expected an integer dtype"),
    (TypeError, dict(group_sizes=[8, 8]),
     r"group_sizes: expected an integer array \(\[E\] int32, on the device\), got list"),
    (ValueError, dict(b1=jnp.ones((2, 8))), r"b1: got shape \(2, 8\), expected \[E, 2f\] = \[2, 16\]"),
    (ValueError, dict(b2=jnp.ones((8,))), r"b2: got shape \(8,\), expected \[E, d\] = \[2, 8\]"),
    (ValueError, dict(scales=jnp.ones((3,))), r"scales: got shape \(3,\), expected \[M\] = \[16\]"),
    (TypeError, dict(w2=jnp.ones((2, 8, 8), jnp.bfloat16)), r"w2: dtype bfloat16 differs from x.dtype float32"),
    (TypeError, dict(x=jnp.ones((16, 8), jnp.int32), w1=jnp.ones((2, 8, 16), jnp.int32),
                     w2=jnp.ones((2, 8, 8), jnp.int32)),
     r"x: dtype int32 is not supported"),
    (ValueError, dict(activation="swish"), r"activation: unknown name 'swish'"),
])
def test_bad_input_names_the_argument(error, change, match):
  """ValueError for a shape or a name, TypeError for a dtype or a type, as jax.lax.dot and jax.numpy raise."""
  args = dict(x=jnp.ones((16, 8)), w1=jnp.ones((2, 8, 16)), w2=jnp.ones((2, 8, 8)),
              group_sizes=jnp.asarray([8, 8], jnp.int32))
  args.update(change)
  act = args.pop("activation", "swiglu")
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda a: jaxmlp.grouped_mlp(**a, activation=act), args)


def _abstract(*shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("change, match", [
    (dict(x=_abstract(2**31, 8), scales=None), r"x: got shape \(2147483648, 8\), M = 2147483648 must be below 2\^31"),
    (dict(x=_abstract(16, 2**31), w1=_abstract(2, 2**31, 16), w2=_abstract(2, 8, 2**31)),
     r"x: got shape \(16, 2147483648\), d = 2147483648 must be below 2\^31"),
    (dict(w1=_abstract(2, 8, 2**31), w2=_abstract(2, 2**30, 8)),
     r"w1: got shape \(2, 8, 2147483648\), F1 = 2147483648 must be below 2\^31"),
    (dict(w1=_abstract(2**30, 8, 16), w2=_abstract(2**30, 8, 8), group_sizes=_abstract(2**30, dtype=jnp.int32)),
     r"w1: got shape \(1073741824, 8, 16\), 1073741824 groups; at most 2\^30 - 1"),
])
def test_extents_the_kernels_cannot_index_fail_at_trace_time(change, match):
  """Dimensions of 2^31 or more (the handlers index with int32), and 2^30 experts or more (the CUDA
  paths' per-group arrays), are rejected when the call is traced, naming the argument; abstract operands,
  so nothing that large is allocated."""
  args = dict(x=_abstract(16, 8), w1=_abstract(2, 8, 16), w2=_abstract(2, 8, 8),
              group_sizes=_abstract(2, dtype=jnp.int32))
  args.update(change)
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda a: jaxmlp.grouped_mlp(**a), args)
