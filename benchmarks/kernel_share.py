"""Share of jaxmlp's own kernels (setup, activation, quantization, zeroing, bias sums) in one fwd+bwd step.

Run under Nsight Compute, which times each kernel on the device:
  ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \
      python benchmarks/kernel_share.py qwen3 [skewed] [fp8] > ncu.csv && python benchmarks/kernel_share.py --summarize ncu.csv
The first form runs fwd+bwd steps of the SwiGLU MLP (bf16, or FP8 tensorwise with `fp8`) at a reference
shape or ExdxfxM (balanced routing unless named) and profiles two of them, after warm-up steps
(compilation, cuBLAS's first-call setup); the second sums kernel times per kernel and prints jaxmlp's own
kernels as a share of all GPU time of a step.
"""
import ctypes
import csv
import functools
import re
import sys
from collections import defaultdict

import cases

OURS = ("SetupKernel", "ActForwardKernel", "ActBackwardKernel", "ZeroEmptyGroupsKernel", "ColumnSumKernel",
        "ConvertKernel", "ZeroRowsKernel",
        # the FP8 path's (ffi/cuda/fp8_kernels.cu)
        "AbsMaxKernel", "QuantizeElementwiseKernel", "QuantizeTileKernel", "ActAbsMaxKernel", "ActQuantizeKernel",
        "ActBackwardAbsMaxKernel", "ActBackwardQuantizeKernel", "ScalesKernel")
# jaxmlp's own GEMM on small problems: a GEMM, so reported on its own and not counted among OURS.
TILED_GEMM = "TiledGemmKernel"


def run(shape_name, routing="balanced", recipe=None):
  """shape_name: one of cases.ALL_SHAPES, or ExdxfxM; routing: one of cases.ROUTINGS; recipe: an FP8 recipe."""
  import jax
  import jax.numpy as jnp
  import jaxmlp
  import jax_impls
  s = cases.shape_named(shape_name)
  inputs = jax_impls.make_inputs(s.E, s.d, s.f, s.M, jnp.bfloat16, seed=0)
  gs = jnp.asarray(cases.group_sizes(routing, s.E, s.M))
  mlp = functools.partial(jaxmlp.grouped_mlp, fp8=recipe) if recipe else jaxmlp.grouped_mlp
  step = jax.jit(jax_impls.forward_backward(mlp))  # the step bench.py times
  for _ in range(2):
    jax.block_until_ready(step(*inputs, gs))
  cuda = ctypes.CDLL("libcuda.so.1")  # the profiled window: ncu --profile-from-start off
  cuda.cuProfilerStart()
  for _ in range(2):
    jax.block_until_ready(step(*inputs, gs))
  cuda.cuProfilerStop()


def summarize(path):
  per_kind = defaultdict(float)
  with open(path) as f:
    lines = [l for l in f if l.startswith('"')]
  for row in csv.DictReader(lines):
    if row.get("Metric Name") != "gpu__time_duration.sum":
      continue
    ns = float(row["Metric Value"].replace(",", "")) * {"nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}[row["Metric Unit"]]
    name = row["Kernel Name"]
    # One line per kernel of ours (the name up to its template arguments); the rest summed.
    short = re.search(r"(\w+)\s*[<(]", name)
    kind = short.group(1) if short and short.group(1) in (*OURS, TILED_GEMM) else "cuBLAS GEMMs and XLA fusions"
    per_kind[kind] += ns / 2  # two steps were profiled
  total = sum(per_kind.values())
  ours = sum(v for k, v in per_kind.items() if k in OURS)
  for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1]):
    print(f"{k:32s} {v / 1e3:10.1f} us  {100 * v / total:5.1f}%")
  print(f"jaxmlp's own kernels: {ours / 1e3:.1f} us of {total / 1e3:.1f} us per fwd+bwd step = {100 * ours / total:.1f}%")


if __name__ == "__main__":
  if sys.argv[1] == "--summarize":
    summarize(sys.argv[2])
  else:
    run(*[a for a in sys.argv[1:] if a != "fp8"], recipe="tensorwise" if "fp8" in sys.argv[1:] else None)
