"""Share of jaxmlp's own kernels (setup, activation, quantization, zeroing, bias sums) in one fwd+bwd step.

Run under Nsight Compute, which times each kernel on the device:
  ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \
      python benchmarks/kernel_share.py qwen3 [skewed] [IMPL] > ncu.csv && python benchmarks/kernel_share.py --summarize ncu.csv
The first form runs fwd+bwd steps of the SwiGLU MLP, as bench.py times IMPL (jaxmlp: bf16, the default;
jaxmlp_fp8 or `fp8`, or another of IMPLS below), at a reference
shape or ExdxfxM (balanced routing unless named) and profiles two of them, after warm-up steps
(compilation, cuBLAS's first-call setup); the second sums kernel times per kernel, prints jaxmlp's own
kernels as a share of all GPU time of a step, then one step's kernels in the order they ran.
"""
import ctypes
import csv
import re
import sys
from collections import defaultdict

import cases

OURS = ("SetupKernel", "ActForwardKernel", "ActBackwardKernel", "ZeroEmptyGroupsKernel", "ColumnSumKernel",
        "GroupSumKernel", "ZeroRowsKernel",
        # the FP8 path's (ffi/cuda/fp8_kernels.cu, fp8_block_quantize.cu, fp8_block_gemm_cuda.cu)
        "AbsMaxKernel", "QuantizeElementwiseKernel", "QuantizeTileKernel", "ActAbsMaxKernel", "ActQuantizeKernel",
        "ActBackwardAbsMaxKernel", "ActBackwardQuantizeKernel", "ScalesKernel",
        "RowsAndColumnsKernel", "WeightBlocksKernel", "Vec128ScalesKernel")
IMPLS = ("jaxmlp", "jaxmlp_fp8", "jaxmlp_fp8_cached", "jaxmlp_fp8_blockwise", "jaxmlp_fp8_blockwise_cached",
         "jaxmlp_fp8_cached_fast_bwd")
# jaxmlp's own GEMM on small problems: a GEMM, so reported on its own and not counted among OURS.
TILED_GEMM = "TiledGemmKernel"


def run(shape_name, routing="balanced", impl="jaxmlp"):
  """shape_name: one of cases.ALL_SHAPES, or ExdxfxM; routing: one of cases.ROUTINGS; impl: one of IMPLS."""
  import jax
  import jax.numpy as jnp
  import jax_impls
  s = cases.shape_named(shape_name)
  inputs = jax_impls.impl_inputs(impl, jax_impls.make_inputs(s.E, s.d, s.f, s.M, jnp.bfloat16, seed=0))
  gs = jnp.asarray(cases.group_sizes(routing, s.E, s.M))
  step = jax.jit(jax_impls.forward_backward(jax_impls.forward(impl)))  # the step bench.py times
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
  kernels = []  # (ours' short name, or the kernel's name, ns) in launch order
  for row in csv.DictReader(lines):
    if row.get("Metric Name") != "gpu__time_duration.sum":
      continue
    ns = float(row["Metric Value"].replace(",", "")) * {"nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}[row["Metric Unit"]]
    name = row["Kernel Name"]
    # One line per kernel of ours (the name up to its template arguments); the rest summed.
    short = re.search(r"(\w+)\s*[<(]", name)
    short = short.group(1) if short else None
    kernels.append((short if short in OURS else name[:80], ns))
    kind = short if short in (*OURS, TILED_GEMM) else "cuBLAS GEMMs and XLA fusions"
    per_kind[kind] += ns / 2  # two steps were profiled
  total = sum(per_kind.values())
  ours = sum(v for k, v in per_kind.items() if k in OURS)
  for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1]):
    print(f"{k:32s} {v / 1e3:10.1f} us  {100 * v / total:5.1f}%")
  print(f"jaxmlp's own kernels: {ours / 1e3:.1f} us of {total / 1e3:.1f} us per fwd+bwd step = {100 * ours / total:.1f}%")
  print("the second step's kernels in launch order:")
  for label, ns in kernels[len(kernels) // 2:]:
    print(f"{ns / 1e3:10.1f} us  {label}")


if __name__ == "__main__":
  if sys.argv[1] == "--summarize":
    summarize(sys.argv[2])
  else:
    args = ["jaxmlp_fp8" if a == "fp8" else a for a in sys.argv[1:]]
    impl = next((a for a in args if a in IMPLS), "jaxmlp")
    run(*[a for a in args if a not in IMPLS], impl=impl)
