"""Share of jaxmlp's own kernels (setup, activation, quantization, zeroing, bias sums) in one fwd+bwd step.

Run under Nsight Compute, which times each kernel on the device:
  ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \
      python benchmarks/kernel_share.py qwen3 [skewed] [IMPL] > ncu.csv && python benchmarks/kernel_share.py --summarize ncu.csv
or through JAX's profiler (CUPTI: the kernels as they overlap in the step, no Nsight needed):
  python benchmarks/kernel_share.py --trace qwen3 [skewed] [IMPL]
The first form runs fwd+bwd steps of the SwiGLU MLP, as bench.py times IMPL (jaxmlp: bf16, the default;
jaxmlp_fp8 or `fp8`, or another of IMPLS below; moe_layer: the MoE layer of benchmarks/moe_layer.py at its
shape of that name), at a reference shape or ExdxfxM (balanced routing unless named) and profiles two of
them, after warm-up steps (compilation, cuBLAS's first-call setup); the second sums kernel times per
kernel, prints jaxmlp's own kernels as a share of all GPU time of a step, then one step's kernels in the
order they ran. (Under Nsight Compute the MoE layer's process died before its first kernel, three runs of
three on an H100: --trace profiles it.)
"""
import ctypes
import csv
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from collections import defaultdict

import cases

OURS = ("SetupKernel", "ActForwardKernel", "ActBackwardKernel", "ZeroEmptyGroupsKernel", "ColumnSumKernel",
        "GroupSumKernel", "ZeroRowsKernel",
        # the FP8 path's (ffi/cuda/fp8/*_kernels.cu)
        "AbsMaxKernel", "QuantizeElementwiseKernel", "QuantizeTileKernel", "ActAbsMaxKernel", "ActQuantizeKernel",
        "ActBackwardAbsMaxKernel", "ActBackwardQuantizeKernel", "ScalesKernel",
        "RowsAndColumnsKernel", "WeightBlocksKernel", "Vec128ScalesKernel",
        # the MoE layer's (ffi/cuda/moe/*_kernels.cu)
        "TopKKernel", "CountKernel", "ScanKernel", "RankKernel", "ScatterRowsKernel", "CombineKernel")
IMPLS = ("jaxmlp", "jaxmlp_fp8", "jaxmlp_fp8_cached", "jaxmlp_fp8_blockwise", "jaxmlp_fp8_blockwise_cached",
         "jaxmlp_fp8_default_cached",
         "jaxmlp_fp8_cached_fast_bwd", "jaxmlp_fp8_delayed", "jaxmlp_fp8_delayed_cached",
         "jaxmlp_fp8_delayed_cached_fast_bwd", "jaxmlp_fp8_delayed_wgrad16_cached", "jaxmlp_fp8_wgrad16",
         "jaxmlp_fp8_wgrad16_cached", "jaxmlp_fp8_blockwise_wgrad16", "jaxmlp_fp8_blockwise_wgrad16_cached",
         "jaxmlp_master", "jaxmlp_fp8_master", "jaxmlp_fp8_blockwise_master", "jaxmlp_fp8_blockwise_wgrad16_master",
         "moe_layer")
# jaxmlp's own GEMM on small problems: a GEMM, so reported on its own and not counted among OURS.
TILED_GEMM = "TiledGemmKernel"


def step_and_args(shape_name, routing="balanced", impl="jaxmlp"):
  """(jitted fwd+bwd step, its arguments). shape_name: one of cases.ALL_SHAPES, or ExdxfxM (moe_layer: one
  of moe_layer.SHAPES); routing: one of cases.ROUTINGS (unused by moe_layer); impl: one of IMPLS."""
  import jax
  import jax.numpy as jnp
  if impl == "moe_layer":
    import moe_layer
    T, d, E, _, f = shape = moe_layer.SHAPES[shape_name]
    return moe_layer.steps("jaxmlp", shape, moe_layer.make_inputs(T, d, E, f, jnp.bfloat16))["layer"]
  import jax_impls
  s = cases.shape_named(shape_name)
  inputs = jax_impls.impl_inputs(impl, jax_impls.make_inputs(s.E, s.d, s.f, s.M, jnp.bfloat16, seed=0))
  step = jax.jit(jax_impls.forward_backward(jax_impls.forward(impl)))  # the step bench.py times
  return step, (*inputs, jnp.asarray(cases.group_sizes(routing, s.E, s.M)))


def traced_on(path, build):
  """build() -> (jitted fn, args), traced and compiled (run once) with JAXMLP_GEMM_PATH=path (the path is
  picked at trace time; "auto" is the policy's own choice; None leaves the environment as it is)."""
  import jax
  before = os.environ.get("JAXMLP_GEMM_PATH")
  if path is not None:
    os.environ["JAXMLP_GEMM_PATH"] = path
  try:
    fn, args = build()
    jax.block_until_ready(fn(*args))
  finally:
    if before is None:
      os.environ.pop("JAXMLP_GEMM_PATH", None)
    else:
      os.environ["JAXMLP_GEMM_PATH"] = before
  return fn, args


def run(*args, **kwargs):
  """Two profiled steps after two unprofiled ones, for Nsight Compute (--profile-from-start off)."""
  import jax
  step, step_args = step_and_args(*args, **kwargs)
  for _ in range(2):
    jax.block_until_ready(step(*step_args))
  cuda = ctypes.CDLL("libcuda.so.1")  # the profiled window: ncu --profile-from-start off
  cuda.cuProfilerStart()
  for _ in range(2):
    jax.block_until_ready(step(*step_args))
  cuda.cuProfilerStop()


def trace(*args, **kwargs):
  """[(kernel name, ns, start in ns)] of two steps after two unprofiled ones, in launch order, from JAX's
  profiler: the events on the GPU's stream lines of its trace."""
  import jax
  step, step_args = step_and_args(*args, **kwargs)
  for _ in range(2):
    jax.block_until_ready(step(*step_args))
  return traced_kernels(lambda: [jax.block_until_ready(step(*step_args)) for _ in range(2)])


def traced_kernels(run):
  """[(kernel name, ns, start in ns)] of the kernels that run() puts on the GPU's streams, in launch order,
  from JAX's profiler."""
  return [(name, ns, start) for start, ns, _, _, name in traced_stream_kernels(run)]


def traced_stream_kernels(run):
  """[(start ns, ns, GPU's name, stream id, kernel name)] of the kernels that run() puts on the GPUs'
  streams, by start, from JAX's profiler."""
  import jax
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir):
      run()
    path, = glob.glob(f"{log_dir}/plugins/profile/*/*.trace.json.gz")
    with gzip.open(path) as f:
      events = json.load(f)["traceEvents"]
  gpus = {e["pid"]: e["args"]["name"] for e in events
          if e.get("name") == "process_name" and "/device:GPU" in e["args"]["name"]}
  streams = {(e["pid"], e["tid"]) for e in events
             if e.get("name") == "thread_name" and e["pid"] in gpus and e["args"]["name"].startswith("Stream")}
  if gpus and not streams:
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name" and e["pid"] in gpus}
    raise SystemExit(f"no stream lines among the GPU's: {sorted(names)}")
  return sorted((e["ts"] * 1e3, e["dur"] * 1e3, gpus[e["pid"]], e["tid"], e["name"]) for e in events
                if e.get("ph") == "X" and (e["pid"], e.get("tid")) in streams)


def ncu_kernels(path):
  """[(kernel name, ns, None)] in launch order from an Nsight Compute CSV of gpu__time_duration.sum (which
  times each kernel alone: no start times)."""
  with open(path) as f:
    lines = [l for l in f if l.startswith('"')]
  units = {"nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}
  return [(row["Kernel Name"], float(row["Metric Value"].replace(",", "")) * units[row["Metric Unit"]], None)
          for row in csv.DictReader(lines) if row.get("Metric Name") == "gpu__time_duration.sum"]


def summarize(measured):
  """Prints the kernel times of two steps, [(kernel name, ns, start ns or None)] in launch order: per kernel
  of ours (the name up to its template arguments), the rest summed; then the second step's kernels in order,
  with the idle time before each where the starts are known (a traced step: launch gaps, host waits)."""
  if not measured:
    raise SystemExit("no GPU kernels were measured")
  per_kind = defaultdict(float)
  kernels = []  # (ours' short name, or the kernel's name, ns) in launch order
  for name, ns, _ in measured:
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
  second = len(kernels) // 2
  starts = [start for _, _, start in measured[second:]]
  if starts[0] is None:
    print("the second step's kernels in launch order:")
    for label, ns in kernels[second:]:
      print(f"{ns / 1e3:10.1f} us  {label}")
    return
  ends = [start + ns for (_, ns, start) in measured[second:]]
  busy = sum(ns for _, ns in kernels[second:])
  print(f"the second step: {(max(ends) - starts[0]) / 1e3:.1f} us from its first kernel's start to its last's end, "
        f"{busy / 1e3:.1f} us of kernels; its kernels in launch order, with the GPU's idle time before each:")
  busy_until = starts[0]  # the latest end of the kernels before
  for (label, ns), start, end in zip(kernels[second:], starts, ends):
    print(f"{ns / 1e3:10.1f} us  idle {max(0.0, start - busy_until) / 1e3:6.1f}  {label}")
    busy_until = max(busy_until, end)


if __name__ == "__main__":
  if sys.argv[1] == "--summarize":
    summarize(ncu_kernels(sys.argv[2]))
  else:
    profile = sys.argv[1] == "--trace"
    args = ["jaxmlp_fp8" if a == "fp8" else a for a in sys.argv[1 + profile:]]
    impl = next((a for a in args if a in IMPLS), "jaxmlp")
    shape_and_routing = [a for a in args if a not in IMPLS]
    if profile:
      summarize(trace(*shape_and_routing, impl=impl))
    else:
      run(*shape_and_routing, impl=impl)
