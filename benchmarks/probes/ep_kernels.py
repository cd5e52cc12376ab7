"""Where the expert-parallel layer's extra time goes: one GPU's kernels in a fwd+bwd step of the layer over
all GPUs against the one-GPU layer's, kernel by kernel (JAX's profiler).

Each GPU of the P-GPU layer does the one-GPU layer's work (benchmarks/moe_expert_parallel.py), so a kernel
whose time grows there is the cost of expert parallelism: the collectives, or a pass over the dropless
buffers' padding rows (P * min(k, E/P) / k times the rows in use).

  python benchmarks/probes/ep_kernels.py [--fp8 blockwise] [--steps 5]
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_share import traced_stream_kernels  # noqa: E402
from moe_expert_parallel import SHAPES, layer_step  # noqa: E402


def short(name: str) -> str:
  """A kernel's name up to its template or argument list (XLA's fusions keep their names)."""
  found = re.search(r"(\w+)\s*[<(]", name)
  return (found.group(1) if found else name)[:60]


def kernel_us(step, steps: int) -> dict[str, float]:
  """{kernel: µs per step} on the first GPU that step() runs on."""
  for i in range(3):
    jax.block_until_ready(step(i))
  kernels = traced_stream_kernels(lambda: jax.block_until_ready([step(i) for i in range(steps)]))
  first = min(gpu for _, _, gpu, _, _ in kernels)
  times = defaultdict(float)
  for _, ns, gpu, _, name in kernels:
    if gpu == first:
      times[short(name)] += ns / steps / 1e3
  return times


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--fp8", choices=("tensorwise", "blockwise"), default=None)
  p.add_argument("--shape", choices=list(SHAPES), default="qwen3")
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--top", type=int, default=25)
  a = p.parse_args()
  devices = jax.devices()
  if len(devices) < 2 or jax.default_backend() != "gpu":
    sys.exit("needs 2 or more GPUs")
  one = kernel_us(layer_step(SHAPES[a.shape], devices[:1], jnp.bfloat16, fp8=a.fp8), a.steps)
  many = kernel_us(layer_step(SHAPES[a.shape], devices, jnp.bfloat16, fp8=a.fp8), a.steps)
  print(f"{len(devices)}x {devices[0].device_kind}, jax {jax.__version__}, {a.shape} {SHAPES[a.shape]}, "
        f"fp8 {a.fp8}: kernel µs per step on one GPU, 1 GPU against {len(devices)}")
  print(f"{'all kernels':60s} {sum(one.values()):9.1f} {sum(many.values()):9.1f} "
        f"{sum(many.values()) - sum(one.values()):+9.1f}")
  names = sorted(set(one) | set(many), key=lambda k: -abs(many.get(k, 0) - one.get(k, 0)))
  for k in names[:a.top]:
    print(f"{k:60s} {one.get(k, 0):9.1f} {many.get(k, 0):9.1f} {many.get(k, 0) - one.get(k, 0):+9.1f}")


if __name__ == "__main__":
  main()
