"""How much faster is jaxmlp than what you would use otherwise? One command, on your GPU:

  python benchmarks/bench.py
  python benchmarks/bench.py --shapes qwen3,dsv3 --routing skewed --impls jaxmlp,ragged_dot,torch
  python benchmarks/bench.py --write-results    # also update benchmarks/RESULTS.md and RESULTS.png

Measures the SwiGLU expert MLP (forward, and fwd+bwd through jax.vjp) with jaxmlp.grouped_mlp,
jax.lax.ragged_dot (jaxmlp.reference), tokamax.ragged_dot, torch._grouped_mm and its FP8 form over
torch._scaled_grouped_mm (eager and under torch.compile) and a dense GEMM of equal FLOPs; the host
overhead of a stack of small layers (wall time, and the host's own time) with XLA command buffers off
and on; and the peak memory of fwd+bwd. Without a GPU it runs tiny shapes on the CPU backend and says so.
Writes bench.json, bench.md and bench.png to --out and prints the Markdown at the end.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import cases
import report

HERE = Path(__file__).resolve().parent
IMPLS = ("jaxmlp", "jaxmlp_fp8", "jaxmlp_fp8_blockwise", "jaxmlp_fp8_cached", "jaxmlp_fp8_blockwise_cached",
         "jaxmlp_fp8_cached_fast_bwd", "ragged_dot", "tokamax", "torch", "torch_compile", "torch_fp8",
         "torch_fp8_compile", "dense")
# The script (in benchmarks/) and its flags for each torch impl.
TORCH_IMPLS = {"torch": ["torch_mlp.py"], "torch_compile": ["torch_mlp.py", "--compile"],
               "torch_fp8": ["torch_fp8_mlp.py"], "torch_fp8_compile": ["torch_fp8_mlp.py", "--compile"]}

# Command buffers (CUDA graphs) are chosen by an XLA flag that is read once, when JAX initialises its
# backend, hence one subprocess per setting. "default" leaves XLA_FLAGS as the user has it.
COMMAND_BUFFER_FLAGS = {
    "off": "--xla_gpu_enable_command_buffer=",
    "default": None,
    "on": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL",
}
# The overhead stack's layer: tiny on the GPU by design; smaller still on the CPU, to keep the run short.
OVERHEAD_LAYER = {"gpu": dict(E=8, d=256, f=512, M=256, dtype="bfloat16"),
                  "cpu": dict(E=4, d=64, f=128, M=64, dtype="float32")}

PROBE = """
import json, jax
d = jax.devices()[0]
print(json.dumps({"platform": d.platform, "device": d.device_kind}))
"""


def parse_args():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", help=f"comma-separated, from {', '.join(cases.ALL_SHAPES)}, or {cases.CUSTOM_SHAPE} "
                 f"(default: {', '.join(cases.GPU_SHAPES)} on a GPU, {', '.join(cases.CPU_SHAPES)} on the CPU)")
  p.add_argument("--routing", default=",".join(cases.DEFAULT_ROUTINGS),
                 help=f"comma-separated, from {', '.join(cases.ROUTINGS)} "
                 f"(default: {', '.join(cases.DEFAULT_ROUTINGS)})")
  p.add_argument("--impls", help=f"comma-separated, from {', '.join(IMPLS)} (default: all that are installed; "
                 "without a GPU all but the torch and FP8 ones)")
  p.add_argument("--repeats", type=int, help="timed samples per measurement (default 10 on GPU, 5 on CPU)")
  p.add_argument("--max-call-s", type=float, default=2.0,
                 help="a call slower than this is timed once and marked too slow (default 2)")
  p.add_argument("--budget-s", type=float, help="time budget per measurement (default 10 s on GPU, 2 s on CPU)")
  p.add_argument("--sets", type=int, default=2, help="input sets rotated between calls, so weights are "
                 "not served from L2 (default 2)")
  p.add_argument("--layers", type=int, default=16, help="layers in the host-overhead stack (default 16)")
  p.add_argument("--overhead", action=argparse.BooleanOptionalAction, default=True,
                 help="measure host overhead with command buffers off and on (default: yes)")
  p.add_argument("--out", type=Path, default=HERE / "results", help="where bench.json/.md/.png go")
  p.add_argument("--write-results", action="store_true",
                 help="also write benchmarks/RESULTS.md and benchmarks/RESULTS.png")
  a = p.parse_args()
  if a.shapes:
    a.shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    for name in a.shapes or [""]:
      try:
        cases.shape_named(name)
      except ValueError as e:
        p.error(f"--shapes: {e}")
  a.routing = _choices("--routing", a.routing, cases.ROUTINGS)
  a.impls = _choices("--impls", a.impls, IMPLS) if a.impls else None
  for flag, value, least in (("--repeats", a.repeats, 1), ("--sets", a.sets, 1), ("--layers", a.layers, 1),
                             ("--budget-s", a.budget_s, 0), ("--max-call-s", a.max_call_s, 0)):
    if value is not None and value < least:
      p.error(f"{flag} must be at least {least}, got {value}")
  return a


def _choices(flag: str, value: str, allowed) -> list[str]:
  chosen = [v.strip() for v in value.split(",") if v.strip()]
  bad = [v for v in chosen if v not in allowed]
  if bad or not chosen:
    sys.exit(f"{flag}: {', '.join(bad) or 'nothing chosen'}; expected some of {', '.join(allowed)}")
  return chosen


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def run_json(cmd: list[str], env: dict, timeout: float = 1800) -> dict:
  """Runs a helper script and returns the JSON object it prints last on stdout."""
  proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                        env={**os.environ, **env})
  if proc.returncode != 0:
    tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
    raise RuntimeError(f"exit status {proc.returncode}: {tail}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


class Progress:
  """One line per measurement on stderr: [n/total] case impl mode time rate (or the error)."""

  def __init__(self, total: int, unit: str, scale: float):
    self.done, self.total, self.unit, self.scale = 0, total, unit, scale

  def step(self, text: str) -> None:
    self.done += 1
    log(f"[{self.done:3d}/{self.total}] {text}")

  def __call__(self, label: str, impl: str, mode: str, t: dict, flops: float) -> None:
    line = f"{label:<18} {impl:<13} {mode:<7}"
    if "error" in t:
      self.step(f"{line} error: {t['error'][:200]}")
      return
    note = "  (1 call, too slow)" if t.get("status") == "too slow" else ""
    self.step(f"{line} {t['s'] * 1e3:10.3f} ms {report.num(flops / t['s'] / self.scale):>9} {self.unit}{note}")


def main():
  args = parse_args()
  wall_start = datetime.datetime.now()
  child_env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # helpers must leave the GPU memory to others
  probe = run_json([sys.executable, "-c", PROBE], child_env)
  mode = "gpu" if probe["platform"] == "gpu" else "cpu"
  if mode == "cpu":
    os.environ["JAX_PLATFORMS"] = child_env["JAX_PLATFORMS"] = "cpu"
    log("No GPU visible to JAX: running tiny shapes on the CPU backend. These are CPU numbers, useful only "
        "to check that the benchmark works.")
  device = probe["device"] if mode == "gpu" else _cpu_name()
  shape_names = args.shapes or list(cases.GPU_SHAPES if mode == "gpu" else cases.CPU_SHAPES)
  defaults = dict(repeats=10, budget_s=10.0) if mode == "gpu" else dict(repeats=5, budget_s=2.0)
  timing = dict(repeats=defaults["repeats"] if args.repeats is None else args.repeats,
                max_call_s=args.max_call_s, sets=args.sets,
                budget_s=defaults["budget_s"] if args.budget_s is None else args.budget_s)
  dtype = "bfloat16" if mode == "gpu" else "float32"

  case_list = make_cases(shape_names, args.routing)
  impls = args.impls or list(IMPLS)
  skipped = {i: why for i in impls if (why := skip_reason(i, mode, named=args.impls is not None))}
  runnable = [i for i in impls if i not in skipped]
  for case in case_list:
    case["impls"].update({i: {"status": "skipped", "reason": why} for i, why in skipped.items()})
  overhead_variants = (COMMAND_BUFFER_FLAGS if mode == "gpu" else {"n/a (CPU)": None}) if args.overhead else {}
  progress = Progress(2 * len(case_list) * len(runnable) + len(overhead_variants), *report.flop_unit(mode))

  # Subprocesses first: once JAX starts in this process it holds most of the GPU memory.
  torch_meta = {}
  for impl in TORCH_IMPLS:
    if impl in runnable:
      torch_meta.update(run_torch(impl, case_list, mode, dtype, timing, progress))
  overhead = (run_overhead(args.layers, mode, overhead_variants, timing, child_env, progress)
              if args.overhead else None)

  # Only now may this process initialise JAX.
  import jax
  import jaxlib
  import jaxmlp
  import jax_impls

  for case in case_list:
    label = f"{case['shape']}/{case['routing']}"
    case["impls"].update(jax_impls.run_case(
        cases.shape_named(case["shape"]), case["group_sizes"], [i for i in runnable if i not in TORCH_IMPLS],
        dtype, timing, lambda impl, m, t: progress(label, impl, m, t, case["flops"][m])))

  info = jaxmlp.backend_info()
  cuda = info.get("cuda", {})
  results = {
      "meta": {
          "date": wall_start.astimezone().isoformat(timespec="seconds"),
          "mode": mode, "platform": probe["platform"], "device": device, "dtype": dtype,
          "command": shlex.join([Path(sys.executable).name] + sys.argv),
          "versions": {"python": platform.python_version(), "jax": jax.__version__,
                       "jaxlib": jaxlib.__version__, "jaxmlp": jaxmlp.__version__,
                       "tokamax": _version("tokamax"), "torch": _version("torch"), "triton": _version("triton"), **torch_meta},
          "cublas": {k: v for k, v in cuda.items() if "cublas" in k.lower()},
          "gemm_path": (f"{cuda['gemm_path']} ({cuda.get('why', '')}); small problems such as the host-overhead "
                        f"layer: {cuda.get('small_gemm_path')} ({cuda.get('small_why', '')})")
                       if "gemm_path" in cuda else None,
          "backend_info": info, "timing": timing,
          "seconds": round((datetime.datetime.now() - wall_start).total_seconds(), 1),
      },
      "cases": case_list,
      "overhead": overhead,
  }
  report.write_outputs(results, args.out, args.write_results)
  failed = report.failed_checks(results)
  if failed:
    log("CORRECTNESS CHECK FAILED (timings of these are not meaningful):\n  " + "\n  ".join(failed))
    sys.exit(1)


def make_cases(shape_names: list[str], routings: list[str]) -> list[dict]:
  """One record per shape and routing; measurements are added under "impls"."""
  out = []
  for name in shape_names:
    shape = cases.shape_named(name)
    for routing in routings:
      sizes = cases.group_sizes(routing, shape.E, shape.M)
      out.append({"shape": name, "routing": routing, "E": shape.E, "d": shape.d, "f": shape.f, "M": shape.M,
                  "group_sizes": sizes.tolist(), "flops": cases.flops(shape, sizes), "impls": {}})
  return out


def skip_reason(impl: str, mode: str, named: bool) -> str | None:
  """Why `impl` is not measured here, or None. Decided without importing torch or JAX."""
  package = "torch" if impl in TORCH_IMPLS else impl
  if "fp8" in impl and mode == "cpu":
    return "FP8 takes 16-bit operands; the CPU run is float32"
  if package in ("torch", "tokamax") and importlib.util.find_spec(package) is None:
    return f"{package} is not installed"
  if package == "torch" and mode == "cpu" and not named:
    # The CPU run is a quick self-check of the JAX side. torch's CPU speed hangs on its OpenMP setup
    # (on a 2-vCPU VM its default threads made each call ~100x slower), and it pays a process per case.
    return "CPU mode: runs only when named in --impls"
  return None


def run_torch(impl: str, case_list: list[dict], mode: str, dtype: str, timing: dict, progress) -> dict:
  """torch._grouped_mm or its FP8 form, eager or compiled (`impl`, a key of TORCH_IMPLS), on every case,
  one subprocess each. Returns the torch versions for the metadata."""
  meta = {}
  for case in case_list:
    script, *flags = TORCH_IMPLS[impl]
    cmd = [sys.executable, str(HERE / script), *flags,
           "--device", "cuda" if mode == "gpu" else "cpu", "--E", str(case["E"]), "--d", str(case["d"]),
           "--f", str(case["f"]), "--group-sizes", ",".join(map(str, case["group_sizes"])),
           "--sets", str(timing["sets"]), "--repeats", str(timing["repeats"]),
           "--max-call-s", str(timing["max_call_s"]), "--budget-s", str(timing["budget_s"])]
    label = f"{case['shape']}/{case['routing']}"
    try:
      r = run_json(cmd, {})
    except Exception as e:  # e.g. a shape torch._grouped_mm rejects: record it and go on
      case["impls"][impl] = {"status": "error", "error": str(e)}
      for m in ("fwd", "fwd_bwd"):
        progress(label, impl, m, {"error": str(e)}, case["flops"][m])
      continue
    meta.update(r.pop("versions"))
    if r["status"] == "skipped":  # a CPU-only torch next to a GPU JAX
      case["impls"][impl] = r
      log(f"{impl}: {r['reason']}")
      continue
    tol = cases.TOLERANCE["fp8" if impl.startswith("torch_fp8") else dtype]
    worst = max(r["check"].values())
    r["check"] = {**r["check"], "max": worst, "tolerance": tol, "ok": worst <= tol}
    case["impls"][impl] = r
    for m in ("fwd", "fwd_bwd"):
      progress(label, impl, m, r[m], case["flops"][m])
  return meta


def run_overhead(layers: int, mode: str, variants: dict, timing: dict, child_env: dict, progress) -> dict:
  """overhead.py once per command-buffer setting in `variants` (name: XLA flag, or None for none)."""
  layer = OVERHEAD_LAYER[mode]
  out = {"config": {"layers": layers, **layer}, "variants": {}}
  user_flags = os.environ.get("XLA_FLAGS", "")
  for name, flag in variants.items():
    xla_flags = f"{user_flags} {flag}".strip() if flag is not None else user_flags
    cmd = [sys.executable, str(HERE / "overhead.py"), "--layers", str(layers),
           "--repeats", str(timing["repeats"]), "--budget-s", str(timing["budget_s"])]
    cmd += [arg for k, v in layer.items() for arg in (f"--{k}", str(v))]
    try:
      # The overhead runs alone, so it may preallocate: without XLA's preallocated pool buffer addresses
      # can change between steps and XLA re-records its command buffers, which is the overhead measured.
      r = run_json(cmd, {**child_env, "XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_FLAGS": xla_flags})
    except Exception as e:
      out["variants"][name] = {"flag": flag, "xla_flags": xla_flags, "error": str(e)}
      progress.step(f"overhead, command buffers {name}: error: {e}")
      continue
    out["variants"][name] = {"flag": flag, "xla_flags": xla_flags, **r}
    host = lambda impl: r[impl]["train_step"].get("host", {}).get("us_per_layer")
    progress.step(f"overhead, command buffers {name:<9}: " + ", ".join(
        f"{impl} fwd+bwd {report.num(r[impl]['fwd_bwd']['us_per_layer'])} µs/layer"
        + (f" (host, train step: {report.num(host(impl))})" if mode == "gpu" else "")
        for impl in ("jaxmlp", "ragged_dot")))
  return out


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def _cpu_name() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "CPU"


if __name__ == "__main__":
  main()
