"""Probe (not a benchmark): the Qwen3 MoE layer's fwd+bwd with parts swapped, to see where its time over
the MLP goes. python benchmarks/probes/layer_variants.py"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax
import jax.numpy as jnp

import jaxmlp
import moe_layer
from jaxmlp import moe as moe_lib
from timing import measure

T, d, E, k, f = moe_layer.SHAPES["qwen3"]
x, wr, w1, w2, dy = moe_layer.make_inputs(T, d, E, f, jnp.bfloat16)


def router_tf32(x, wr):
  return x.astype(jnp.float32) @ wr


def router_bf16(x, wr):
  return jnp.dot(x, wr.astype(x.dtype), preferred_element_type=jnp.float32)


def layer(router, aux=True):
  """moe_layer.py's layer with `router` for its logits."""
  def fn(x, wr, w1, w2):
    mlp = lambda rows, gs, s: jaxmlp.grouped_mlp(rows, w1, w2, gs, scales=s.astype(rows.dtype))
    y, losses = moe_lib.moe(x, router(x, wr), mlp, top_k=k, aux_loss_coef=1e-2 if aux else 0.0,
                            z_loss_coef=1e-3 if aux else 0.0)
    return y, losses["aux_loss"]
  return fn


variants = {
    "layer, tf32 router": layer(router_tf32),
    "layer, bf16 router": layer(router_bf16),
    "layer, split router": layer(moe_lib.router_logits),
    "layer, no aux": layer(moe_lib.router_logits, aux=False),
}
steps = moe_layer.steps("jaxmlp", (T, d, E, k, f), (x, wr, w1, w2, dy))
timing = dict(repeats=10, max_call_s=5.0, budget_s=2.0)
rows = []
for name in ("mlp", "layer"):
  step, args = steps[name]
  rows.append((f"moe_layer.py {name}", measure(lambda i: step(*args), jax.block_until_ready, **timing)["s"]))
for name, fn in variants.items():
  step = moe_layer.vjp_step(fn, 4)
  args = (x, wr, w1, w2, (dy, jnp.ones((), jnp.float32)))
  rows.append((name, measure(lambda i: step(*args), jax.block_until_ready, **timing)["s"]))
for name, fn in (("router tf32", router_tf32), ("router bf16", router_bf16), ("router split", moe_lib.router_logits)):
  logits = jax.jit(fn)(x, wr)
  ref = jax.jit(lambda x, wr: jnp.dot(x.astype(jnp.float32), wr, precision="highest"))(x, wr)
  err = float(jnp.max(jnp.abs(logits - ref)) / jnp.max(jnp.abs(ref)))
  print(f"{name}: max error of the logits {err:.2e}")
mlp_s = rows[0][1]
for name, s in rows:
  print(f"{name:34s} {s * 1e3:8.3f} ms  {s / mlp_s:.3f}x mlp")
