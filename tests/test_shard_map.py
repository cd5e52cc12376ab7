"""jaxmlp's ops inside jax.shard_map, the way to run them on data spread over devices: values and
gradients against the float64 NumPy reference, shard by shard. On the CPU backend the mesh is 8 CPU
devices (conftest); on CUDA, the GPUs there are."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOLERANCE, check_close
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxmlp
import numpy_reference as ref
from jaxmlp import _library

M, d, f = 40, 16, 24
SIZES = [[10, 0, 22], [3, 17, 20], [0, 0, 0], [40, 5, -2]]  # per device: padding, full, empty, clamped


def mesh_for(backend):
  devices = jax.devices("cpu") if backend == "cpu" else _library.cuda_devices()
  return jax.make_mesh((len(devices),), ("dev",), devices=devices)


def dtype_for(backend):
  return jnp.float32 if backend == "cpu" else jnp.bfloat16  # on CUDA, the paths other than the fallback


def device_sizes(n):
  """group_sizes of n devices, concatenated: device i routes its rows by SIZES[i % 4]."""
  return np.asarray([SIZES[i % len(SIZES)] for i in range(n)], np.int32).reshape(-1)


def put(mesh, a, spec, dtype):
  return jax.device_put(jnp.asarray(a, dtype), NamedSharding(mesh, spec))


def as_seen(a, dtype):
  """`a` in float64 as the op saw it: rounded to the op's dtype first."""
  return np.asarray(jnp.asarray(a, dtype), np.float64)


@pytest.mark.parametrize("parallel", ["data", "expert"])
def test_grouped_mlp(backend, rng, parallel):
  """data: each device its rows, the experts replicated, so their gradients are summed over devices;
  expert: each device its rows and its own experts."""
  mesh = mesh_for(backend)
  n = mesh.devices.size
  E = len(SIZES[0])
  wE = E if parallel == "data" else n * E
  dtype = dtype_for(backend)
  host = dict(x=rng.standard_normal((n * M, d)), w1=rng.standard_normal((wE, d, 2 * f)) / np.sqrt(d),
              w2=rng.standard_normal((wE, f, d)) / np.sqrt(f), b1=rng.standard_normal((wE, 2 * f)) * 0.5,
              b2=rng.standard_normal((wE, d)) * 0.5, scales=rng.uniform(0.1, 1.0, n * M))
  dy = rng.standard_normal((n * M, d))
  sizes = device_sizes(n)
  weights = P() if parallel == "data" else P("dev")
  specs = dict(x=P("dev"), w1=weights, w2=weights, b1=weights, b2=weights, scales=P("dev"))
  args = {k: put(mesh, v, specs[k], dtype) for k, v in host.items()}
  gs = put(mesh, sizes, P("dev"), jnp.int32)

  def mlp(x, w1, w2, b1, b2, scales, gs):
    return jaxmlp.grouped_mlp(x, w1, w2, gs, b1=b1, b2=b2, scales=scales)

  sharded = jax.shard_map(mlp, mesh=mesh, in_specs=(*specs.values(), P("dev")), out_specs=P("dev"))
  y, vjp = jax.vjp(jax.jit(lambda *a: sharded(*a, gs)), *args.values())
  grads = dict(zip(host, vjp(put(mesh, dy, P("dev"), dtype))))

  # The reference, device by device: its slices of the inputs, gradients summed for replicated operands.
  want_y, want = np.zeros((n * M, d)), {k: np.zeros(v.shape) for k, v in host.items()}
  for i in range(n):
    rows, experts = slice(i * M, (i + 1) * M), slice(None) if parallel == "data" else slice(i * E, (i + 1) * E)
    part = {k: as_seen(v, dtype)[rows if k in ("x", "scales") else experts] for k, v in host.items()}
    y_i, g_i = ref.grouped_mlp(part["x"], part["w1"], part["w2"], sizes[i * E:(i + 1) * E], "swiglu", part["b1"],
                               part["b2"], part["scales"], dy=as_seen(dy, dtype)[rows])
    want_y[rows] = y_i
    for k in host:
      want[k][rows if k in ("x", "scales") else experts] += g_i[k]
  tol = TOLERANCE[jnp.dtype(dtype).name]
  check_close(y, want_y, tol)
  for k in host:
    check_close(grads[k], want[k], tol)


def test_ragged_dot_data_parallel(backend, rng):
  mesh = mesh_for(backend)
  n = mesh.devices.size
  E, k, m = len(SIZES[0]), 16, 24
  dtype = dtype_for(backend)
  lhs, rhs, dout = rng.standard_normal((n * M, k)), rng.standard_normal((E, k, m)), rng.standard_normal((n * M, m))
  sizes = device_sizes(n)
  gs = put(mesh, sizes, P("dev"), jnp.int32)
  sharded = jax.shard_map(jaxmlp.ragged_dot, mesh=mesh, in_specs=(P("dev"), P(), P("dev")), out_specs=P("dev"))
  out, vjp = jax.vjp(jax.jit(lambda a, b: sharded(a, b, gs)), put(mesh, lhs, P("dev"), dtype),
                     put(mesh, rhs, P(), dtype))
  dlhs, drhs = vjp(put(mesh, dout, P("dev"), dtype))

  lhs, rhs, dout = (as_seen(a, dtype) for a in (lhs, rhs, dout))
  want_out, want_dlhs, want_drhs = np.zeros(out.shape), np.zeros(lhs.shape), np.zeros(rhs.shape)
  for i in range(n):
    rows, s = slice(i * M, (i + 1) * M), sizes[i * E:(i + 1) * E]
    want_out[rows] = ref.ragged_dot(lhs[rows], rhs, s)
    want_dlhs[rows] = ref.ragged_dot(dout[rows], rhs.transpose(0, 2, 1), s)
    want_drhs += ref.ragged_dot_rhs_grad(lhs[rows], dout[rows], s)
  tol = TOLERANCE[jnp.dtype(dtype).name]
  for got, want in ((out, want_out), (dlhs, want_dlhs), (drhs, want_drhs)):
    check_close(got, want, tol)


@pytest.mark.parametrize("optional", ["none", "scales", "b1"])
def test_gradient_accumulated_in_a_loop_over_a_shard_map(backend, rng, optional):
  """Gradient accumulation over micro-batches (jax.lax.map) of a shard_map holding grouped_mlp, with some
  optional operands absent: the gradient equals the micro-batches' gradients summed outside any loop.
  (jax 0.11.2 crashed compiling the loop when absent operands were 0-element arrays.)"""
  mesh = mesh_for(backend)
  n, E = mesh.devices.size, len(SIZES[0])
  dtype = dtype_for(backend)
  x = put(mesh, rng.standard_normal((2, n * M, d)), P(None, "dev"), dtype)
  w1 = put(mesh, rng.standard_normal((n * E, d, 2 * f)) / np.sqrt(d), P("dev"), dtype)
  w2 = put(mesh, rng.standard_normal((n * E, f, d)) / np.sqrt(f), P("dev"), dtype)
  b1 = put(mesh, rng.standard_normal((n * E, 2 * f)), P("dev"), dtype)
  gs = put(mesh, device_sizes(n), P("dev"), jnp.int32)

  def mlp(x, w1, w2, b1, gs):
    return jaxmlp.grouped_mlp(x, w1, w2, gs, scales=x[:, 0] if optional == "scales" else None,
                              b1=b1 if optional == "b1" else None)

  sharded = jax.shard_map(mlp, mesh=mesh, in_specs=(P("dev"),) * 5, out_specs=P("dev"))
  loss = lambda w1, x: jnp.sum(sharded(x, w1, w2, b1, gs).astype(jnp.float32) ** 2)
  looped = jax.jit(jax.grad(lambda w1: jax.lax.map(lambda x: loss(w1, x), x).sum()))(w1)
  parts = [jax.jit(jax.grad(loss))(w1, x[i]) for i in range(2)]
  check_close(looped, np.float64(parts[0]) + np.float64(parts[1]), TOLERANCE[jnp.dtype(dtype).name])


@pytest.mark.matrix
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_explicitly_sharded_operands_outside_shard_map(rng, devices, dtype):
  """Under an Explicit mesh axis, without shard_map: the experts' weights sharded over it (as the MoE layer
  stores them with P = 1, or a user's model does), the ops run on the gathered operands and each gradient
  is sharded as its operand (JAX requires the cotangent's type to be its primal's; a custom call's result
  is not sharded); the values are those of unsharded operands, up to the order of the loss's sums."""
  mesh = jax.make_mesh((devices,), ("e",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices("cpu")[:devices])
  E = 2
  x, w1, w2 = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((M, d), (E, d, 2 * f), (E, f, d)))
  gs = jnp.asarray([15, 20], jnp.int32)

  def loss(x, w1, w2):
    y = jaxmlp.grouped_mlp(x, w1, w2, gs) + jaxmlp.ragged_dot(x, w1, gs)[:, :d]
    return jnp.sum(y.astype(jnp.float32) ** 2)

  want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w1, w2)
  with jax.set_mesh(mesh):
    w1s, w2s = (jax.sharding.reshard(w, P("e")) for w in (w1, w2))
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w1s, w2s)
    assert [g.sharding.spec for g in grads] == [P(None, None), P("e", None, None), P("e", None, None)]
  tol = TOLERANCE[dtype]  # XLA may reduce the sharded loss in another order
  np.testing.assert_allclose(value, want[0], rtol=tol)
  for g, w, name in zip(grads, want[1], ("dx", "dw1", "dw2")):
    check_close(g, w, tol, name)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_explicitly_sharded_weights_with_fp8(rng, recipe):
  """The same for an FP8 call: gradients sharded as the weights, values those of unsharded weights."""
  mesh = jax.make_mesh((2,), ("e",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices("cpu")[:2])
  x, w1, w2 = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((40, 16), (2, 16, 64), (2, 32, 16)))
  gs = jnp.asarray([15, 20], jnp.int32)
  loss = lambda x, w1, w2: jnp.sum(jaxmlp.grouped_mlp(x, w1, w2, gs, fp8=recipe).astype(jnp.float32) ** 2)  # noqa
  with jax.default_device(jax.devices("cpu")[0]):  # the mesh's platform (on a GPU machine: not the GPU's FP8)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w1, w2)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, *(jax.sharding.reshard(w, P("e")) for w in (w1, w2)))
    assert [g.sharding.spec for g in got] == [P(None, None), P("e", None, None), P("e", None, None)]
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
