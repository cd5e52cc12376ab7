"""The MoE layer, part by part, fwd+bwd: router (logits, softmax, top-k), dispatch (sort by expert, row
gather, router weights to the rows), the expert MLP (jaxmlp.grouped_mlp, weights fused as scales),
combine (each token's rows summed in float32), and the whole layer (jaxmlp.moe.router_logits and
jaxmlp.moe.moe, the aux loss included). Two JAX routing/dispatch/combine paths in one run:

  jaxmlp     jaxmlp.dispatch's custom calls (the router's top-k, a counting sort on the device, gathers
             both ways);
  argsort    jaxmlp.reference_moe, the layer's original path (jax.lax.top_k, jnp.argsort, a gather, a
             scatter-add);

and beside them a PyTorch layer built the usual way (torch_moe_layer.py: argsort, index_select,
torch._grouped_mm, index_add), in a subprocess because JAX preallocates GPU memory. Target: the jaxmlp
layer within 1.10x of its expert MLP alone. Random routing (softmax of random logits), bf16 on a GPU; on
the CPU float32, for a quick self-check (the tiny shape).

  python benchmarks/moe_layer.py --shapes qwen3,mixtral --out /tmp/moe_layer
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxmlp
from jaxmlp import moe as moe_lib
from timing import measure, measure_alternating

HERE = Path(__file__).resolve().parent
# name: (T tokens, d model width, E experts, k top-k, f expert hidden width)
SHAPES = {"qwen3": (8192, 2048, 128, 8, 768), "mixtral": (16384, 4096, 8, 2, 14336), "tiny": (64, 32, 4, 2, 48)}
PARTS = ("router", "dispatch", "mlp", "combine", "layer")
PATHS = {"jaxmlp": "jaxmlp", "argsort": "reference"}  # path name: jaxmlp.moe impl of dispatch/combine


def make_inputs(T, d, E, f, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (T, d), dtype)
  wr = jax.random.normal(keys[1], (d, E), jnp.float32) * d ** -0.5
  w1 = (jax.random.normal(keys[2], (E, d, 2 * f), jnp.float32) * d ** -0.5).astype(dtype)
  w2 = (jax.random.normal(keys[3], (E, f, d), jnp.float32) * f ** -0.5).astype(dtype)
  dy = jax.random.normal(keys[4], (T, d), dtype)
  return x, wr, w1, w2, dy


def vjp_step(f, n_diff):
  """jit(args -> (outputs, gradients of the first n_diff args for cotangents `cts`, passed last)."""
  def step(*args):
    diff, rest, cts = args[:n_diff], args[n_diff:-1], args[-1]
    out, vjp = jax.vjp(lambda *a: f(*a, *rest), *diff)
    return out, vjp(cts)
  return jax.jit(step)


def steps(path: str, shape: tuple, inputs):
  """{part: (jitted fwd+bwd step, its arguments)} of one dispatch path; intermediate inputs of each part
  computed once from the layer's own forward."""
  T, d, E, k, f = shape
  x, wr, w1, w2, dy = inputs
  ops = moe_lib.DISPATCHERS[PATHS[path]]

  def router(x, wr):
    weights, _, _ = moe_lib.route(moe_lib.router_logits(x, wr), k, impl=PATHS[path])
    return weights

  def dispatch(x, weights, experts):
    rows, _, plan = ops.dispatch(x, experts, E)
    return rows, ops.row_weights(weights, plan)

  def mlp(rows, scales, w1, w2, group_sizes):
    return jaxmlp.grouped_mlp(rows, w1, w2, group_sizes, scales=scales.astype(rows.dtype))

  def combine(y_rows, plan):
    return ops.combine(y_rows, plan)

  def layer(x, wr, w1, w2):
    expert_mlp = lambda rows, gs, scales: mlp(rows, scales, w1, w2, gs)
    y, aux = moe_lib.moe(x, moe_lib.router_logits(x, wr), expert_mlp, top_k=k, aux_loss_coef=1e-2,
                         z_loss_coef=1e-3, impl=PATHS[path])
    return y, aux["aux_loss"]

  weights, experts, _ = jax.jit(lambda x, wr: moe_lib.route(moe_lib.router_logits(x, wr), k, impl=PATHS[path]))(x, wr)
  rows, group_sizes, plan = jax.jit(lambda x, e: ops.dispatch(x, e, E))(x, experts)
  scales = jax.jit(ops.row_weights)(weights, plan)
  y_rows = jax.jit(mlp)(rows, scales, w1, w2, group_sizes)
  return {
      "router": (vjp_step(router, 2), (x, wr, weights)),
      "dispatch": (vjp_step(dispatch, 2), (x, weights, experts, (rows, scales))),
      "mlp": (vjp_step(mlp, 4), (rows, scales, w1, w2, group_sizes, y_rows)),
      "combine": (vjp_step(combine, 1), (y_rows, plan, dy)),
      "layer": (vjp_step(layer, 4), (x, wr, w1, w2, (dy, jnp.ones((), jnp.float32)))),
  }


def run_torch(shape, mode: str, timing: dict) -> dict:
  T, d, E, k, f = shape
  cmd = [sys.executable, str(HERE / "torch_moe_layer.py"), "--T", str(T), "--d", str(d), "--E", str(E),
         "--k", str(k), "--f", str(f), "--device", "cuda" if mode == "gpu" else "cpu",
         "--repeats", str(timing["repeats"]), "--budget-s", str(timing["budget_s"])]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=HERE)
  except subprocess.TimeoutExpired:
    return {"status": "error", "error": "timed out"}
  if proc.returncode:
    return {"status": "error", "error": proc.stderr[-2000:]}
  return json.loads(proc.stdout)


def table(results: dict) -> str:
  lines = []
  for name, case in results["cases"].items():
    lines += [f"### {name}: T={case['T']}, d={case['d']}, E={case['E']}, top-{case['k']}, f={case['f']}, "
              f"{case['dtype']}, fwd+bwd in ms", "",
              "| path | " + " | ".join(PARTS) + " | layer / mlp |", "|---" * (len(PARTS) + 2) + "|"]
    for path, parts in case["paths"].items():
      if parts.get("status") not in (None, "ok"):
        lines.append(f"| {path} | {parts.get('status')}: {parts.get('reason') or parts.get('error', '')[-200:]} |")
        continue
      ms = [parts[p]["s"] * 1e3 if p in parts else math.nan for p in PARTS]
      lines.append(f"| {path} | " + " | ".join(f"{v:.3f}" for v in ms) + f" | {ms[-1] / ms[2]:.2f}x |")
    alt = case["alternating"]
    lines.append(f"\nTarget, jaxmlp's layer over its MLP with their samples taken in turn ({alt['layer']['samples']} "
                 f"rounds): layer {alt['layer']['s'] * 1e3:.3f} ms, mlp {alt['mlp']['s'] * 1e3:.3f} ms, "
                 f"**{alt['layer']['s'] / alt['mlp']['s']:.3f}x** (minimums {alt['layer']['min_s'] * 1e3:.3f} and "
                 f"{alt['mlp']['min_s'] * 1e3:.3f} ms: {alt['layer']['min_s'] / alt['mlp']['min_s']:.3f}x)")
    lines.append(f"\nCheck: jaxmlp layer vs argsort layer, relative error of y: {case['check']['y']:.2e}, "
                 f"of dx: {case['check']['dx']:.2e}\n")
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default=None, help=f"comma-separated from {', '.join(SHAPES)} "
                 "(default: qwen3,mixtral on a GPU, tiny on the CPU)")
  p.add_argument("--no-torch", action="store_true", help="skip the PyTorch layer")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--budget-s", type=float, default=5.0)
  p.add_argument("--out", type=Path, default=Path("."))
  a = p.parse_args()

  mode = "gpu" if jax.default_backend() == "gpu" else "cpu"
  names = (a.shapes or ("qwen3,mixtral" if mode == "gpu" else "tiny")).split(",")
  for n in names:
    if n not in SHAPES:
      sys.exit(f"--shapes: {n!r}: expected one of {', '.join(SHAPES)}")
  dtype = jnp.bfloat16 if mode == "gpu" else jnp.float32
  timing = dict(repeats=a.repeats, max_call_s=5.0, budget_s=a.budget_s)
  results = {"meta": {"mode": mode, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                      "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}, "cases": {}}
  for name in names:
    shape = SHAPES[name]
    T, d, E, k, f = shape
    inputs = make_inputs(T, d, E, f, dtype)
    case = {"T": T, "d": d, "E": E, "k": k, "f": f, "dtype": jnp.dtype(dtype).name, "paths": {}}
    layer_grads = {}
    for path in PATHS:
      case["paths"][path] = {}
      parts = steps(path, shape, inputs)
      for part, (step, args) in parts.items():
        case["paths"][path][part] = measure(lambda i: step(*args), jax.block_until_ready, **timing)
        print(f"{name} {path} {part}: {case['paths'][path][part]['s'] * 1e3:.3f} ms", file=sys.stderr)
        if part == "layer":
          layer_grads[path] = step(*args)
      case["paths"][path]["status"] = "ok"
      if path == "jaxmlp":  # the target's ratio, from samples of the two taken in turn
        case["alternating"] = measure_alternating(
            {part: (lambda i, step=parts[part][0], args=parts[part][1]: step(*args)) for part in ("mlp", "layer")},
            jax.block_until_ready, rounds=a.repeats)
    (y, _), (dx, *_) = layer_grads["jaxmlp"]
    (y_ref, _), (dx_ref, *_) = layer_grads["argsort"]
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                             / max(np.linalg.norm(np.asarray(b, np.float64)), 1e-30))
    case["check"] = {"y": rel(y, y_ref), "dx": rel(dx, dx_ref)}
    del layer_grads, inputs
    case["paths"]["torch"] = ({"status": "skipped", "reason": "--no-torch"} if a.no_torch
                              else run_torch(shape, mode, timing))
    results["cases"][name] = case
  a.out.mkdir(parents=True, exist_ok=True)
  (a.out / "moe_layer.json").write_text(json.dumps(results, indent=1))
  md = f"## MoE layer parts ({mode}, {results['meta']['device']})\n\n- Command: `{results['meta']['command']}`\n\n"
  (a.out / "moe_layer.md").write_text(md + table(results))
  print(md + table(results))


if __name__ == "__main__":
  main()
