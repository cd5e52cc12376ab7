"""grouped_mlp(x, ..., gather=plan): the expert MLP over the rows a dispatch plan takes from the tokens x,
equal bit for bit to grouped_mlp over jaxmlp.dispatch's rows (values and gradients: the same products over
the same rows) and close to the float64 reference, on every backend. On cuda-cutlass and cuda-fused FC1 reads
the rows from x in the engine's loads ("jaxmlp_mlp_fwd_gathered", checked in the lowered module); elsewhere
XLA gathers them first. The plans put groups across tile edges (128 rows), an empty group, one of a few
rows, capacity drops, padding rows inside the groups (pad_to) and past them; whatever a plan's slot_of_row
holds, a gathered row is a token or zeros.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOLERANCE, check_close, engine_launches, launched, skip_unless_served

import jaxmlp
import numpy_reference as ref
from jaxmlp import dispatch, reference_moe

T, K, E = 300, 2, 5


def _experts(rng, tokens=T):
  """[tokens, K] choices: expert 1 empty, expert 3 a few rows, expert 0 most (more than two 128-row tiles)."""
  p = np.array([0.5, 0.0, 0.25, 0.02, 0.23])
  return jnp.asarray(np.stack([rng.choice(E, size=K, replace=False, p=p) for _ in range(tokens)]), jnp.int32)


def _operands(rng, dtype, d, f, tokens=T):
  cast = lambda a: jnp.asarray(a, dtype)
  return (cast(rng.standard_normal((tokens, d))), cast(rng.standard_normal((E, d, 2 * f)) / np.sqrt(d)),
          cast(rng.standard_normal((E, f, d)) / np.sqrt(f)))


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("act, b1", [("swiglu", False), ("geglu", True)])
@pytest.mark.parametrize("capacity, pad_to", [(None, 1), (130, 16), (90, 1)])
@pytest.mark.parametrize("f", [64, 192])
def test_gathered_mlp_equals_the_mlp_of_the_dispatched_rows(backend, rng, dtype, act, b1, capacity, pad_to, f):
  d = 64
  skip_unless_served(backend, dtype, d, f, 2 * f)
  x, w1, w2 = _operands(rng, dtype, d, f)
  b1 = jnp.asarray(rng.standard_normal((E, 2 * f)) * 0.5, dtype) if b1 else None
  experts = _experts(rng)
  rows, sizes, plan = dispatch.dispatch(x, experts, E, capacity=capacity, pad_to=pad_to)
  M = rows.shape[0]
  scales = jnp.asarray(rng.uniform(0.1, 1.0, M), dtype)
  dy = jnp.asarray(rng.standard_normal((M, d)), dtype)

  def gathered(x, w1, w2, scales, *b1):
    return jaxmlp.grouped_mlp(x, w1, w2, sizes, activation=act, b1=b1[0] if b1 else None, scales=scales,
                              gather=plan)

  def dispatched(x, w1, w2, scales, *b1):
    rows = dispatch.dispatch(x, experts, E, capacity=capacity, pad_to=pad_to)[0]
    return jaxmlp.grouped_mlp(rows, w1, w2, sizes, activation=act, b1=b1[0] if b1 else None, scales=scales)

  operands = (x, w1, w2, scales) + (() if b1 is None else (b1,))

  def run(f_):
    y, vjp = jax.vjp(f_, *operands)
    return (y, *vjp(dy))

  engine = backend in ("cuda-cutlass", "cuda-fused")
  since = engine_launches() if engine else None
  got, want = jax.jit(lambda: run(gathered))(), jax.jit(lambda: run(dispatched))()
  if engine:  # the gathering kernel ran (a first run executes the handlers' host code, which counts it)
    assert launched(since)["gated_fc1_gathered"] > 0
  for name, a, b in zip(["y", "dx", "dw1", "dw2", "dscales", "db1"], got, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), name)
  assert ("jaxmlp_mlp_fwd_gathered" in jax.jit(gathered).lower(*operands).as_text()) == engine

  # The float64 reference over the rows, its x gradient summed over each token's rows.
  f64 = lambda a: np.asarray(a, np.float64)
  want_y, want_g = ref.grouped_mlp(f64(rows), f64(w1), f64(w2), np.asarray(sizes), act,
                                   b1=None if b1 is None else f64(b1), scales=f64(scales), dy=f64(dy))
  token = np.asarray(plan.slot_of_row) // K
  want_dx = np.zeros((T, d))
  np.add.at(want_dx, token[token >= 0], want_g["x"][token >= 0])
  tol = TOLERANCE[jnp.dtype(dtype).name]
  check_close(got[0], want_y, tol, "y")
  for name, a, b in zip(["x", "w1", "w2", "scales", "b1"], got[1:], [want_dx, want_g["w1"], want_g["w2"],
                                                                       want_g["scales"], want_g.get("b1")]):
    check_close(a, b, tol, name)


@pytest.mark.parametrize("d, f, tokens", [(256, 128, T), (1024, 2112, 4 * T)])
def test_gathered_forward_at_the_engines_other_shapes(backend, rng, d, f, tokens):
  """The engine's gathered FC1 where test_gathered_mlp_equals_the_mlp_of_the_dispatched_rows does not take it:
  several k-tiles (d 256), an even number of 64-column gate pieces (f 128), and its 2x1 cluster (an expert's
  weights past 4M elements, more than 128 rows a group on average): bit for bit the forward over
  jaxmlp.dispatch's rows, and close to float64."""
  if backend not in ("cuda-cutlass", "cuda-fused"):
    pytest.skip("the engine's tile configurations")
  dtype = jnp.bfloat16
  skip_unless_served(backend, dtype, d, f, 2 * f)
  x, w1, w2 = _operands(rng, dtype, d, f, tokens)
  rows, sizes, plan = dispatch.dispatch(x, _experts(rng, tokens), E)
  gathered = jax.jit(lambda x, w1, w2: jaxmlp.grouped_mlp(x, w1, w2, sizes, gather=plan))
  assert "jaxmlp_mlp_fwd_gathered" in gathered.lower(x, w1, w2).as_text()
  got = gathered(x, w1, w2)
  want = jax.jit(lambda rows, w1, w2: jaxmlp.grouped_mlp(rows, w1, w2, sizes))(rows, w1, w2)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  f64 = lambda a: np.asarray(a, np.float64)
  check_close(got, ref.grouped_mlp(f64(rows), f64(w1), f64(w2), np.asarray(sizes), "swiglu"),
              TOLERANCE[jnp.dtype(dtype).name], "y")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_any_slot_of_row_gathers_a_token_or_zeros(backend, rng, dtype):
  """A plan whose slot_of_row holds anything (past T k, negative, the int32 extremes), with group sizes that
  overrun the rows: each row is the token its slot names (0 <= slot < T k: token slot // k) or zeros."""
  d, f = 64, 64
  skip_unless_served(backend, dtype, d, f, 2 * f)
  x, w1, w2 = _operands(rng, dtype, d, f)
  M = 400
  slots = rng.integers(-5, T * K + 40, M).astype(np.int32)
  slots[::7] = np.iinfo(np.int32).max
  slots[3::11] = np.iinfo(np.int32).min
  plan = jaxmlp.dispatch.Plan(jnp.zeros((T, K), jnp.int32), jnp.asarray(slots), jnp.zeros((E,), jnp.int32))
  sizes = jnp.asarray([150, 0, 7, 2**30, 5], jnp.int32)
  y = jax.jit(lambda x, w1, w2: jaxmlp.grouped_mlp(x, w1, w2, sizes, gather=plan))(x, w1, w2)
  valid = (slots >= 0) & (slots < T * K)
  rows = np.where(valid[:, None], np.asarray(x, np.float64)[np.where(valid, slots, 0) // K], 0)
  want = ref.grouped_mlp(rows, np.asarray(w1, np.float64), np.asarray(w2, np.float64), np.asarray(sizes), "swiglu")
  check_close(y, want, TOLERANCE[jnp.dtype(dtype).name], "y")


def test_gather_checks_its_arguments():
  x = jnp.zeros((T, 64), jnp.bfloat16)
  plan = jaxmlp.dispatch.Plan(jnp.zeros((T, K), jnp.int32), jnp.zeros((10,), jnp.int32), jnp.zeros((E,), jnp.int32))
  w1, w2, sizes = jnp.zeros((E, 64, 128), x.dtype), jnp.zeros((E, 64, 64), x.dtype), jnp.zeros((E,), jnp.int32)
  with pytest.raises(ValueError, match="x: got shape"):
    jaxmlp.grouped_mlp(x[:5], w1, w2, sizes, gather=plan)
  with pytest.raises(TypeError, match="gather: expected a jaxmlp.dispatch.Plan"):
    jaxmlp.grouped_mlp(x, w1, w2, sizes, gather=(plan.row_of_slot, plan.slot_of_row))
  with pytest.raises(TypeError, match="slot_of_row must be int32"):
    jaxmlp.grouped_mlp(x, w1, w2, sizes, gather=plan._replace(slot_of_row=plan.slot_of_row.astype(jnp.uint32)))
  with pytest.raises(ValueError, match=r"row_of_slot must be \[T, k\]"):
    jaxmlp.grouped_mlp(x, w1, w2, sizes, gather=plan._replace(row_of_slot=plan.row_of_slot[:, 0]))
  with pytest.raises(ValueError, match=r"scales: got shape \(300,\), expected \[M\] = \[10\]"):
    jaxmlp.grouped_mlp(x, w1, w2, sizes, scales=jnp.zeros((T,), x.dtype), gather=plan)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dispatch_gather_takes_the_dispatched_rows_again(rng, dtype):
  """jaxmlp.dispatch.gather: dispatch's rows, bit for bit (padding rows zero); its gradient each token's rows'
  gradients summed, as the reference's scatter-add."""
  x = jnp.asarray(rng.standard_normal((T, 16)), dtype)
  rows, _, plan = dispatch.dispatch(x, _experts(rng), E, capacity=90, pad_to=16)
  np.testing.assert_array_equal(np.asarray(dispatch.gather(x, plan), np.float32), np.asarray(rows, np.float32))
  drows = jnp.asarray(rng.standard_normal(rows.shape), dtype)
  got = jax.vjp(lambda x: dispatch.gather(x, plan), x)[1](drows)[0]
  want = jax.vjp(lambda x: reference_moe.gather(x, plan), x.astype(jnp.float32))[1](drows.astype(jnp.float32))[0]
  check_close(got, want, TOLERANCE[jnp.dtype(dtype).name], "dx")


def test_only_a_forced_engine_path_reads_the_rows_in_fc1(monkeypatch):
  """`auto` gathers with XLA first (the gathered loads measured slower); JAXMLP_GEMM_PATH=cutlass or fused
  takes them for an FC1 the engine fuses (gated, f a multiple of 64)."""
  from jaxmlp import _gemm_path
  swiglu, gelu = jaxmlp.Activation("swiglu"), jaxmlp.Activation("gelu")
  monkeypatch.setenv("JAXMLP_GEMM_PATH", "auto")
  assert not _gemm_path.gathers_in_fc1("cutlass", swiglu, 768)
  for path in ("cutlass", "fused"):
    monkeypatch.setenv("JAXMLP_GEMM_PATH", path)
    assert _gemm_path.gathers_in_fc1(path, swiglu, 768)
    assert not _gemm_path.gathers_in_fc1(path, swiglu, 96)
    assert not _gemm_path.gathers_in_fc1(path, gelu, 768)
  monkeypatch.setenv("JAXMLP_GEMM_PATH", "grouped")
  assert not _gemm_path.gathers_in_fc1("grouped", swiglu, 768)


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto],
                         ids=["explicit", "auto"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sharded_tokens_and_weights(rng, axis_type, dtype):
  """Tokens split over a mesh axis of 2 CPU devices by rows, the experts' weights by expert, the plan's arrays
  as dispatch left them: the values and gradients of unsharded operands, each gradient sharded as its
  operand under Explicit axes."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  d, f = 32, 64
  x, w1, w2 = _operands(rng, dtype, d, f)
  w1, w2 = w1[:4], w2[:4]  # 4 experts: 2 a device
  experts = jnp.asarray(rng.integers(0, 4, (T, K)), jnp.int32)
  _, sizes, plan = dispatch.dispatch(x, experts, 4)

  def loss(x, w1, w2):
    return jnp.sum(jaxmlp.grouped_mlp(x, w1, w2, sizes, gather=plan).astype(jnp.float32) ** 2)

  cpu = jax.devices("cpu")
  with jax.default_device(cpu[0]):
    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w1, w2)
  mesh = jax.make_mesh((2,), ("e",), axis_types=(axis_type,), devices=cpu[:2])
  with jax.set_mesh(mesh):
    if axis_type == jax.sharding.AxisType.Explicit:
      args = (jax.sharding.reshard(x, P("e")), *(jax.sharding.reshard(w, P("e")) for w in (w1, w2)))
    else:
      args = tuple(jax.device_put(a, NamedSharding(mesh, P("e"))) for a in (x, w1, w2))
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    if axis_type == jax.sharding.AxisType.Explicit:
      assert [g.sharding.spec for g in grads] == [P("e", None), P("e", None, None), P("e", None, None)]
  tol = TOLERANCE[jnp.dtype(dtype).name]  # XLA may reduce the sharded loss in another order
  np.testing.assert_allclose(value, want[0], rtol=tol)
  for g, w, name in zip(grads, want[1], ("dx", "dw1", "dw2")):
    check_close(g, w, tol, name)


def test_a_plan_without_tokens_gathers_zero_rows(rng):
  """No tokens, and a plan whose groups hold padding rows only (pad_to): the rows are zeros, the MLP over
  them its biases' (the reference's), x's gradient empty."""
  x = jnp.zeros((0, 16), jnp.float32)
  _, sizes, plan = dispatch.dispatch(x, jnp.zeros((0, K), jnp.int32), E, pad_to=4)
  rows = dispatch.gather(x, plan)
  assert rows.shape == (E * 3, 16) and not np.asarray(rows).any()
  w1, w2, b2 = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((E, 16, 32), (E, 16, 16), (E, 16)))
  y, vjp = jax.vjp(lambda x: jaxmlp.grouped_mlp(x, w1, w2, sizes, b2=b2, gather=plan), x)
  want = ref.grouped_mlp(np.zeros(rows.shape), np.float64(w1), np.float64(w2), np.asarray(sizes), "swiglu",
                         b2=np.float64(b2))
  check_close(y, want, TOLERANCE["float32"], "y")
  assert vjp(jnp.ones_like(y))[0].shape == (0, 16)
