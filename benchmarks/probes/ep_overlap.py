"""Whether XLA runs the expert-parallel layer's collectives under its experts' work, on the GPUs of one host.

For each expert_chunks count: a traced burst of fwd+bwd steps of benchmarks/moe_expert_parallel.py's layer
over all GPUs (JAX's profiler), then per GPU the time its NCCL kernels ran, the part of it during which a
kernel of another stream also ran (overlapped), and the rest (exposed: the experts waited), per step.
An NCCL kernel's time includes its wait for the peers, so "exposed" bounds what the exchange costs.

  python benchmarks/probes/ep_overlap.py --chunks 1,2,4
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_share import traced_stream_kernels  # noqa: E402
from moe_expert_parallel import SHAPES, layer_step  # noqa: E402


def gpu_kernels(run):
  """{GPU's name: [(start ns, end ns, stream, kernel name)]} of the kernels run() puts on the GPUs."""
  kernels = defaultdict(list)
  for start, ns, gpu, stream, name in traced_stream_kernels(run):
    kernels[gpu].append((start, start + ns, stream, name))
  return kernels


def covered(interval, others):
  """ns of `interval` during which at least one of `others` (sorted, merged) runs."""
  start, end = interval
  return sum(max(0.0, min(end, b) - max(start, a)) for a, b in others if a < end and b > start)


def merged(intervals):
  out = []
  for a, b in sorted(intervals):
    if out and a <= out[-1][1]:
      out[-1][1] = max(out[-1][1], b)
    else:
      out.append([a, b])
  return out


def summarize(kernels, steps):
  """Per GPU, per step: ms of NCCL kernels, of them overlapped by another stream's kernels, exposed."""
  rows = {}
  for gpu, ks in sorted(kernels.items()):
    nccl = [k for k in ks if "nccl" in k[3].lower()]
    compute = [k for k in ks if "nccl" not in k[3].lower()]
    union = merged([(a, b) for a, b, *_ in compute])
    nccl_ns = sum(b - a for a, b, *_ in nccl)
    over_ns = sum(covered((a, b), union) for a, b, *_ in nccl)
    busy_ns = sum(b - a for a, b in merged([(a, b) for a, b, *_ in ks]))
    rows[gpu] = {"nccl ms": nccl_ns / steps / 1e6, "overlapped ms": over_ns / steps / 1e6,
                 "exposed ms": (nccl_ns - over_ns) / steps / 1e6, "busy ms": busy_ns / steps / 1e6,
                 "nccl kernels": len(nccl) // steps, "streams": len({k[2] for k in ks})}
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--chunks", default="1,2,4")
  p.add_argument("--shape", choices=list(SHAPES), default="qwen3")
  p.add_argument("--steps", type=int, default=5)
  a = p.parse_args()
  devices = jax.devices()
  if len(devices) < 2 or jax.default_backend() != "gpu":
    sys.exit("needs 2 or more GPUs")
  print(f"{len(devices)}x {devices[0].device_kind}, jax {jax.__version__}, shape {a.shape} {SHAPES[a.shape]}")
  for c in (int(c) for c in a.chunks.split(",")):
    step = layer_step(SHAPES[a.shape], devices, jnp.bfloat16, chunks=c)
    for i in range(3):
      jax.block_until_ready(step(i))
    rows = summarize(gpu_kernels(lambda: jax.block_until_ready([step(i) for i in range(a.steps)])), a.steps)
    for gpu, r in rows.items():
      print(f"chunks {c} {gpu}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in r.items()))


if __name__ == "__main__":
  main()
