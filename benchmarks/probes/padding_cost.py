"""What the expert-parallel layer's padding rows cost the expert MLP, on one GPU.

Over P devices the layer sizes each device's expert MLP for the dropless worst case: P * min(k, E/P) / k
times the rows it gets on average (4x over four GPUs at top-8), the rows past the groups being padding
(jaxmlp.expert_parallel). Here the expert path of one device of that layer (dispatch, MLP, combine),
fwd+bwd, once on a buffer of exactly its rows and once on the padded buffer with the same groups, timed
in turn, in bf16 and in each FP8 recipe (at every shape: Fp8Recipe when="always"), and the padded buffer
once more with zero_padding=False (the padding rows left unwritten, as the MoE layer asks where the
experts run without FP8).
The difference is what the passes over the padding rows cost (benchmarks/RESULTS-moe-layer.md).

  python benchmarks/probes/padding_cost.py             # the Qwen3 layer over four GPUs: 32 experts a device
  python benchmarks/probes/padding_cost.py --pad 2 --experts 64   # over two
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jaxmlp  # noqa: E402
from timing import measure_alternating  # noqa: E402


def mlp_step(rows, buffer_rows, experts, d, f, dtype, fp8, zero_padding=True):
  """call(i): fwd+bwd of the layer's expert path, dispatch -> grouped_mlp -> combine, as one device of the
  expert-parallel layer runs it: over `buffer_rows` tokens (one choice each, the gathered tokens of every
  device) of which `rows` choose this device's experts, in equal groups, and the others another device's
  (an expert id past the local ones: dropped, no row). The dispatched buffer has a row per choice, so the
  rows past the groups are padding; buffer_rows == rows is the exact case."""
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (buffer_rows, d), dtype)
  dy = jax.random.normal(keys[1], (buffer_rows, d), dtype)
  w1 = jax.random.normal(keys[2], (experts, d, 2 * f), dtype) / d**0.5
  w2 = jax.random.normal(keys[3], (experts, f, d), dtype) / f**0.5
  local = jnp.arange(rows, dtype=jnp.int32) * experts // rows  # sorted, equal groups
  choices = jnp.concatenate([local, jnp.full((buffer_rows - rows,), experts, jnp.int32)])[:, None]
  recipe = fp8 and jaxmlp.Fp8Recipe(fp8, when="always")

  def loss(x, w1, w2):
    x_rows, sizes, plan = jaxmlp.dispatch.dispatch(x, choices, experts, zero_padding=zero_padding)
    y_rows = jaxmlp.grouped_mlp(x_rows, w1, w2, sizes, fp8=recipe, zero_padding=zero_padding)
    y = jaxmlp.dispatch.combine(y_rows, plan, zero_padding=zero_padding)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return lambda i: step(x, w1, w2)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rows", type=int, default=65536, help="the device's rows in groups (default: 8192 tokens x top-8)")
  p.add_argument("--pad", type=int, default=4, help="the buffer's rows over --rows (P * min(k, E/P) / k)")
  p.add_argument("--experts", type=int, default=32, help="the device's experts (E/P)")
  p.add_argument("--d", type=int, default=2048)
  p.add_argument("--f", type=int, default=768)
  p.add_argument("--recipes", default="bf16,tensorwise,blockwise")
  p.add_argument("--rounds", type=int, default=8)
  a = p.parse_args()
  gpu = jax.default_backend() == "gpu"
  if not gpu:  # a check that the script runs: a tiny shape on the CPU
    a.rows, a.experts, a.d, a.f, a.rounds = 256, 4, 128, 128, 2
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {a.experts} experts, {a.rows} rows in groups, "
        f"buffers of {a.rows} and {a.pad * a.rows} rows, d={a.d}, f={a.f}, bf16, fwd+bwd")
  for recipe in a.recipes.split(","):
    fp8 = None if recipe == "bf16" else recipe
    calls = {"exact": mlp_step(a.rows, a.rows, a.experts, a.d, a.f, jnp.bfloat16, fp8),
             "padded": mlp_step(a.rows, a.pad * a.rows, a.experts, a.d, a.f, jnp.bfloat16, fp8)}
    if fp8 is None:
      calls["unwritten"] = mlp_step(a.rows, a.pad * a.rows, a.experts, a.d, a.f, jnp.bfloat16, fp8, False)
    t = measure_alternating(calls, jax.block_until_ready, rounds=a.rounds)
    exact = t["exact"]["s"]
    print(f"{recipe}: {exact * 1e3:.3f} ms exact; padded {a.pad}x: " + ", ".join(
        f"{t[c]['s'] * 1e3:.3f} ms {c} (+{(t[c]['s'] - exact) * 1e3:.3f} ms, {t[c]['s'] / exact:.3f}x)"
        for c in calls if c != "exact"))


if __name__ == "__main__":
  main()
