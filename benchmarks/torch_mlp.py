"""The PyTorch comparison: a SwiGLU expert MLP over torch._grouped_mm, forward and fwd+bwd (autograd),
eager or under torch.compile (--compile: inductor fuses the activation and its backward into Triton
kernels; the grouped GEMMs stay torch._grouped_mm's).

Run by bench.py in its own process, because JAX preallocates most of the GPU memory in the process
that initialises it. Prints one JSON object on stdout; errors go to stderr. bf16 on the GPU; with
--device cpu (bench.py's CPU mode) float32, and no memory figure.

  python benchmarks/torch_mlp.py --E 8 --d 1024 --f 2048 --group-sizes 512,512,512,512,512,512,512,512
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from timing import measure


def mlp(x, w1, w2, offs):
  """x [M, d], w1 [E, d, 2f], w2 [E, f, d], offs = cumsum(group sizes) as int32: what a PyTorch MoE
  layer writes today (eager, torch's own activation kernels)."""
  f = w2.shape[1]
  h = torch._grouped_mm(x, w1, offs=offs)
  return torch._grouped_mm(F.silu(h[:, :f]) * h[:, f:], w2, offs=offs)


def reference(x, w1, w2, sizes):
  """Per-expert float32 loop: a slow but obviously correct check of `mlp`."""
  f = w2.shape[1]
  out, start = [], 0
  for g, n in enumerate(sizes):
    h = x[start:start + n].float() @ w1[g].float()
    out.append((F.silu(h[:, :f]) * h[:, f:]) @ w2[g].float())
    start += n
  return torch.cat(out)


def make_inputs(E, d, f, M, device, dtype, seed):
  gen = torch.Generator(device=device).manual_seed(seed)
  def randn(*shape, scale=1.0):
    return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)
  x = randn(M, d).requires_grad_()
  w1 = randn(E, d, 2 * f, scale=d ** -0.5).requires_grad_()
  w2 = randn(E, f, d, scale=f ** -0.5).requires_grad_()
  return x, w1, w2, randn(M, d)


def forward_backward(run, x, w1, w2, dy, offs):
  """(y, dx, dw1, dw2) of the MLP `run` for the output cotangent dy, as the JAX side: the backward
  starts from dy as a layer inside a model would (no loss computed here, whose cost would count
  against torch)."""
  y = run(x, w1, w2, offs)
  return (y, *torch.autograd.grad(y, (x, w1, w2), grad_outputs=dy))


def check(run, inputs, offs, sizes) -> dict:
  """Relative errors (Frobenius norm) of the MLP `run`: the forward's y and the fwd+bwd step's
  (y, dx, dw1, dw2), against `reference` in float32, differentiated by autograd."""
  x, w1, w2, dy = inputs
  exact = [t.detach().float().requires_grad_() for t in (x, w1, w2)]
  want_y = reference(*exact, sizes)
  want = (want_y.detach(), want_y.detach(), *torch.autograd.grad(want_y, exact, grad_outputs=dy.float()))
  with torch.no_grad():
    y = run(x, w1, w2, offs)
  got = (y, *forward_backward(run, *inputs, offs))
  names = ("y", "y (fwd+bwd)", "dx", "dw1", "dw2")
  return {name: float((g.detach().float() - w).norm() / w.norm().clamp_min(1e-30))
          for name, g, w in zip(names, got, want)}


def main(mlp_fn=mlp, doc=__doc__, cpu_skip=None):
  """Checks and times `mlp_fn` (torch_fp8_mlp.py passes its FP8 MLP, its docstring as `doc`, and as
  `cpu_skip` why it has no CPU run) and prints the JSON object bench.py reads."""
  p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--E", type=int, required=True)
  p.add_argument("--d", type=int, required=True)
  p.add_argument("--f", type=int, required=True)
  p.add_argument("--group-sizes", required=True, help="comma-separated, summing to M")
  p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
  p.add_argument("--compile", action="store_true", help="run the MLP under torch.compile")
  p.add_argument("--sets", type=int, default=2, help="input sets to rotate (keeps weights out of L2)")
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--max-call-s", type=float, default=2.0)
  p.add_argument("--budget-s", type=float, default=10.0)
  a = p.parse_args()

  sizes = [int(s) for s in a.group_sizes.split(",")]
  if len(sizes) != a.E:
    sys.exit(f"--group-sizes has {len(sizes)} entries, expected E = {a.E}")
  result = {"versions": {"torch": torch.__version__, "torch_cuda": torch.version.cuda}}
  cuda = a.device == "cuda"
  if cuda and not torch.cuda.is_available():
    print(json.dumps({**result, "status": "skipped", "reason": "torch sees no CUDA device"}))
    return
  if cpu_skip and not cuda:
    print(json.dumps({**result, "status": "skipped", "reason": cpu_skip}))
    return
  if a.compile and not cuda:
    print(json.dumps({**result, "status": "skipped",
                      "reason": "torch.compile traces torch._grouped_mm for bfloat16 only; the CPU run is float32"}))
    return
  result["device"] = torch.cuda.get_device_name() if cuda else "cpu"
  dtype = torch.bfloat16 if cuda else torch.float32
  M = sum(sizes)
  offs = torch.tensor(sizes, device=a.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
  sync = torch.cuda.synchronize if cuda else (lambda: None)

  inputs = make_inputs(a.E, a.d, a.f, M, a.device, dtype, seed=0)
  run = torch.compile(mlp_fn) if a.compile else mlp_fn
  result["check"] = check(run, inputs, offs, sizes)  # compiles, under --compile: before anything is timed
  if cuda:
    # Memory first, with a single input set alive: the peak counts inputs, gradients and
    # temporaries, like the JAX side's compiled memory analysis.
    sync()
    torch.cuda.reset_peak_memory_stats()
    forward_backward(run, *inputs, offs)
    sync()
    result["peak_bytes"] = torch.cuda.max_memory_allocated()

  sets = [inputs] + [make_inputs(a.E, a.d, a.f, M, a.device, dtype, seed=i) for i in range(1, a.sets)]
  timing = dict(repeats=a.repeats, max_call_s=a.max_call_s, budget_s=a.budget_s)
  with torch.no_grad():  # inference forward, like the JAX forward (no residuals kept)
    result["fwd"] = measure(lambda i: run(*sets[i % len(sets)][:3], offs), lambda _: sync(), **timing)
  result["fwd_bwd"] = measure(lambda i: forward_backward(run, *sets[i % len(sets)], offs), lambda _: sync(), **timing)
  result["status"] = "ok"
  print(json.dumps(result))


if __name__ == "__main__":
  main()
