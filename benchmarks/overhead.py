"""Host overhead: a jitted stack of L small MoE MLP layers, where the GPU work per layer is tiny and
the time goes to launching it. For jaxmlp, the ragged_dot path and, for comparison, a layer of one
element-wise op over the same operands, three programs over the stack:

  fwd         the forward, as in decoding;
  fwd_bwd     the forward and the gradients for a cotangent dy, all returned (as bench.py's step);
  train_step  one SGD step of a training loop: the loss <y, dy>, its gradients, the weights updated in
              place (donated), the loss returned.

Two numbers per program, both per layer at steady state:
  wall  time per call, calls dispatched back to back: the larger of the host's work and the GPU's;
  host  the host's own time per call, dispatched while the GPU is still busy with earlier work, so that
        no dispatch waits for it (timing.host_seconds; GPU only).

bench.py runs this once per XLA_FLAGS setting (command buffers off / default / on), in a fresh
process each, because XLA reads its flags once, when JAX initialises the backend. Prints one JSON
object on stdout.

  XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/overhead.py --layers 16
"""
from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp

from jax_impls import forward, forward_backward
from timing import host_seconds, measure

# "elementwise": a layer of one element-wise op over the same operands, which XLA fuses with its
# neighbours. For comparison: what JAX and XLA cost the host for a program with these operands and
# outputs when the layers themselves are next to nothing.
IMPLS = ("jaxmlp", "ragged_dot", "elementwise")
HOLD_S = 0.1  # GPU work enqueued ahead of each host-time sample: longer than the dispatches it covers


def stack(impl: str):
  """y = layer_L(... layer_1(x)) with each layer's own weights, unrolled so XLA sees (and can
  capture into one command buffer) the whole sequence of kernels."""
  mlp = (lambda x, w1, w2, gs: x * w1[0, :, 0] + w2[0, 0]) if impl == "elementwise" else forward(impl)

  def run(x, w1s, w2s, gs):
    for w1, w2 in zip(w1s, w2s):
      x = mlp(x, w1, w2, gs)
    return x
  return run


def train_step(impl: str, lr: float = 2.0 ** -10):
  """(w1s, w2s, x, dy, gs) -> (loss, new w1s, new w2s): the weights' buffers are donated, so the
  updated weights land where the old ones were, as in a training loop."""
  fwd = stack(impl)

  def loss(w1s, w2s, x, dy, gs):
    return jnp.vdot(fwd(x, w1s, w2s, gs).astype(jnp.float32), dy.astype(jnp.float32))

  def step(w1s, w2s, x, dy, gs):
    value, (dw1s, dw2s) = jax.value_and_grad(loss, argnums=(0, 1))(w1s, w2s, x, dy, gs)
    sgd = lambda ws, grads: [w - (lr * g).astype(w.dtype) for w, g in zip(ws, grads)]
    return value, sgd(w1s, dw1s), sgd(w2s, dw2s)
  return jax.jit(step, donate_argnums=(0, 1))


def gpu_hold(seconds: float):
  """A function that enqueues about `seconds` of GPU work and returns its result without waiting: a
  chain of 8192^2 bf16 matrix products, unrolled (a loop with a traced trip count would make the host
  wait for the GPU at each iteration)."""
  a = (jax.random.normal(jax.random.key(1), (8192, 8192)) / 90).astype(jnp.bfloat16)

  def chain(k: int):
    def run(b):
      for _ in range(k):
        b = b @ a
      return b
    return jax.jit(run)

  one = chain(1)
  jax.block_until_ready(one(a))
  start = time.perf_counter()
  jax.block_until_ready([one(a) for _ in range(10)])
  hold = chain(max(1, math.ceil(seconds / ((time.perf_counter() - start) / 10))))
  jax.block_until_ready(hold(a))
  return lambda: hold(a)


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

  gpu = jax.default_backend() == "gpu"
  hold = gpu_hold(HOLD_S) if gpu else None
  result = {"device": str(jax.devices()[0].device_kind), "platform": jax.default_backend()}
  for impl in IMPLS:
    fwd = stack(impl)
    compiled = {"fwd": jax.jit(fwd).lower(x, w1s, w2s, gs).compile(),
                "fwd_bwd": jax.jit(forward_backward(fwd)).lower(x, w1s, w2s, dy, gs).compile()}
    step = train_step(impl)
    weights = [[w.copy() for w in w1s], [w.copy() for w in w2s]]  # the step consumes its own copies

    def train():
      loss, weights[0], weights[1] = step(weights[0], weights[1], x, dy, gs)
      return loss

    calls = {"fwd": lambda: compiled["fwd"](x, w1s, w2s, gs),
             "fwd_bwd": lambda: compiled["fwd_bwd"](x, w1s, w2s, dy, gs), "train_step": train}
    result[impl] = {}
    for mode, call in calls.items():
      t = measure(lambda i: call(), jax.block_until_ready,
                  repeats=a.repeats, max_call_s=10.0, budget_s=a.budget_s, sample_s=0.05)
      r = result[impl][mode] = {"us_per_layer": t["s"] / a.layers * 1e6, "timing": t}
      if gpu:
        h = host_seconds(call, hold, lambda busy: not busy.is_ready(), jax.block_until_ready)
        r["host"] = {**h, "us_per_layer": h["s"] / a.layers * 1e6} if "s" in h else h
  print(json.dumps(result))


if __name__ == "__main__":
  main()
