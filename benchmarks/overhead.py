"""Host overhead: a jitted stack of L small MoE MLP layers, where the GPU work per layer is tiny and
the time goes to launching it. Reports wall time per layer at steady state, forward and fwd+bwd, for
jaxmlp and the ragged_dot path: the larger of the host's work and the GPU's, since calls are
dispatched asynchronously.

bench.py runs this once per XLA_FLAGS setting (command buffers off / default / on), in a fresh
process each, because XLA reads its flags once, when JAX initialises the backend. Prints one JSON
object on stdout.

  XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/overhead.py --layers 16
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from jax_impls import forward, forward_backward
from timing import measure

IMPLS = ("jaxmlp", "ragged_dot")


def stack(impl: str):
  """y = layer_L(... layer_1(x)) with each layer's own weights, unrolled so XLA sees (and can
  capture into one command buffer) the whole sequence of kernels."""
  mlp = forward(impl)

  def run(x, w1s, w2s, gs):
    for w1, w2 in zip(w1s, w2s):
      x = mlp(x, w1, w2, gs)
    return x
  return run


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--E", type=int, default=8)
  p.add_argument("--d", type=int, default=256)
  p.add_argument("--f", type=int, default=512)
  p.add_argument("--M", type=int, default=256)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--budget-s", type=float, default=10.0)
  a = p.parse_args()

  dtype = jnp.dtype(a.dtype)
  keys = jax.random.split(jax.random.key(0), 2 * a.layers + 2)
  x = jax.random.normal(keys[0], (a.M, a.d), dtype)
  dy = jax.random.normal(keys[1], (a.M, a.d), dtype)
  w1s = [(jax.random.normal(k, (a.E, a.d, 2 * a.f)) / a.d ** 0.5).astype(dtype) for k in keys[2:a.layers + 2]]
  w2s = [(jax.random.normal(k, (a.E, a.f, a.d)) / a.f ** 0.5).astype(dtype) for k in keys[a.layers + 2:]]
  gs = jnp.full((a.E,), a.M // a.E, jnp.int32).at[: a.M % a.E].add(1)

  result = {"device": str(jax.devices()[0].device_kind), "platform": jax.default_backend()}
  for impl in IMPLS:
    fwd = stack(impl)
    calls = {"fwd": (fwd, (x, w1s, w2s, gs)), "fwd_bwd": (forward_backward(fwd), (x, w1s, w2s, dy, gs))}
    result[impl] = {}
    for mode, (fn, args) in calls.items():
      compiled = jax.jit(fn).lower(*args).compile()
      t = measure(lambda i: compiled(*args), jax.block_until_ready,
                  repeats=a.repeats, max_call_s=10.0, budget_s=a.budget_s, sample_s=0.05)
      result[impl][mode] = {"us_per_layer": t["s"] / a.layers * 1e6, "timing": t}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
