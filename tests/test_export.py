"""jax.export of functions that call jaxmlp's ops: serialized, deserialized and run with the results of the
function itself, at a concrete and at a symbolic batch size (the trace-time checks once compared a
symbolic dimension with 2^31 and raised); a subprocess loads the artifact after importing jaxmlp."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

import jaxmlp
import jaxmlp.nnx

E, D, F = 4, 32, 48


def mlp(x, w1, w2, gs):
  return jaxmlp.grouped_mlp(x, w1, w2, gs, b1=None, scales=None)


def mlp_grads(x, w1, w2, gs):
  return jax.grad(lambda *a: jnp.sum(mlp(*a, gs).astype(jnp.float32)), argnums=(0, 1, 2))(x, w1, w2)


def fp8_grads(recipe):
  def grads(x, w1, w2, gs):
    loss = lambda *a: jnp.sum(jaxmlp.grouped_mlp(*a, gs, fp8=recipe).astype(jnp.float32))  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)
  return grads


def ragged(x, w1, w2, gs):
  return jaxmlp.ragged_dot(x, w1, gs), jax.grad(lambda a: jnp.sum(jaxmlp.ragged_dot(a, w1, gs)))(x)


FUNCTIONS = {"mlp": mlp, "mlp_grads": mlp_grads, "ragged_dot": ragged, "fp8_tensorwise": fp8_grads("tensorwise"),
             "fp8_blockwise": fp8_grads("blockwise")}


def specs(rows, dtype):
  return (jax.ShapeDtypeStruct((rows, D), dtype), jax.ShapeDtypeStruct((E, D, 2 * F), dtype),
          jax.ShapeDtypeStruct((E, F, D), dtype), jax.ShapeDtypeStruct((E,), jnp.int32))


def values(rng, rows, dtype):
  return [jnp.asarray(rng.standard_normal(s.shape) * 0.5, dtype) for s in specs(rows, dtype)[:3]] + [
      jnp.asarray([10, 0, 17, 9], jnp.int32)]


@pytest.mark.matrix
@pytest.mark.parametrize("name", list(FUNCTIONS))
@pytest.mark.parametrize("batch", ["concrete", "symbolic"])
def test_exported_function_runs_with_the_same_results(rng, name, batch):
  fn = FUNCTIONS[name]
  dtype = jnp.float32 if name in ("mlp", "ragged_dot") else jnp.bfloat16
  rows = export.symbolic_shape("m")[0] if batch == "symbolic" else 40
  with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees"):
    export.export(jax.jit(fn))(*specs(rows, dtype))
  exported = export.deserialize(
      export.export(jax.jit(fn), disabled_checks=jaxmlp.export_disabled_checks())(*specs(rows, dtype)).serialize())
  for m in ([40] if batch == "concrete" else [40, 61]):
    args = values(rng, m, dtype)
    for got, want in zip(jax.tree.leaves(exported.call(*args)), jax.tree.leaves(jax.jit(fn)(*args))):
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_exported_moe_layer_with_a_symbolic_token_count(rng):
  layer = jaxmlp.nnx.MoE(8, D, F, 2, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  graphdef, state = nnx.split(layer)
  params = nnx.to_pure_dict(state)

  def forward(params, x):
    s = nnx.clone(state)
    nnx.replace_by_pure_dict(s, params)
    y, aux = nnx.merge(graphdef, s)(x)
    return y, aux["aux_loss"]

  spec = jax.ShapeDtypeStruct((export.symbolic_shape("t")[0], D), jnp.bfloat16)
  exported = export.export(jax.jit(forward), disabled_checks=jaxmlp.export_disabled_checks())(
      jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params), spec)
  exported = export.deserialize(exported.serialize())
  for tokens in (24, 7):
    x = jnp.asarray(rng.standard_normal((tokens, D)), jnp.bfloat16)
    for got, want in zip(exported.call(params, x), jax.jit(forward)(params, x)):
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


LOAD_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax import export
import jaxmlp  # registers the targets the artifact calls
exported = export.deserialize(open(sys.argv[1], "rb").read())
x = jnp.asarray(np.linspace(-1, 1, 30 * 32).reshape(30, 32), jnp.float32)
w1 = jnp.full((4, 32, 96), 0.01, jnp.float32)
w2 = jnp.full((4, 48, 32), 0.02, jnp.float32)
print(float(jnp.sum(exported.call(x, w1, w2, jnp.asarray([10, 0, 17, 9], jnp.int32)))))
"""


def test_artifact_loads_in_a_process_that_imported_jaxmlp(tmp_path):
  spec = specs(export.symbolic_shape("m")[0], jnp.float32)
  exported = export.export(jax.jit(mlp), disabled_checks=jaxmlp.export_disabled_checks())(*spec)
  (tmp_path / "mlp.bin").write_bytes(exported.serialize())
  x = jnp.asarray(np.linspace(-1, 1, 30 * 32).reshape(30, 32), jnp.float32)
  want = float(jnp.sum(mlp(x, jnp.full((4, 32, 96), 0.01), jnp.full((4, 48, 32), 0.02),
                           jnp.asarray([10, 0, 17, 9], jnp.int32))))
  out = subprocess.run([sys.executable, "-P", "-c", LOAD_SCRIPT, str(tmp_path / "mlp.bin")], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr
  assert float(out.stdout.split()[-1]) == pytest.approx(want, rel=1e-6)
