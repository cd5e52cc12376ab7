"""jaxmlp's bf16 MLP against PyTorch's (torch._grouped_mm, eager and under torch.compile) with their samples
taken in turn, in one process: the README's comparison with PyTorch, out of reach of the clock's drift under
the GPU's power cap (bench.py times torch in a subprocess first, then JAX, seconds to minutes apart).

JAX shares the GPU with torch here, so it allocates on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false, as
bench.py's subprocesses do). For each shape, the fwd+bwd steps (bench.py's jaxmlp step, torch_mlp.py's MLP
and autograd backward from the same cotangent) are timed round after round, one sample of about 0.1 s of
each per round in a shuffled order (timing.measure_alternating). GPU only.

  python benchmarks/torch_in_turn.py --shapes small,qwen3,dsv3,gptoss,mixtral --rounds 8
"""
import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

try:
  import torch
except ImportError:
  sys.exit("torch_in_turn.py: needs PyTorch with CUDA (GPU only)")

import cases  # noqa: E402
import kernel_share  # noqa: E402
import torch_mlp  # noqa: E402
from timing import measure_alternating  # noqa: E402

IMPLS = ("jaxmlp", "torch", "torch_compile")


def torch_step(shape, routing, compiled):
  s = cases.shape_named(shape)
  sizes = cases.group_sizes(routing, s.E, s.M)
  offs = torch.tensor(sizes, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
  x, w1, w2, dy = torch_mlp.make_inputs(s.E, s.d, s.f, s.M, "cuda", torch.bfloat16, seed=0)
  run = torch.compile(torch_mlp.mlp) if compiled else torch_mlp.mlp
  return lambda i: torch_mlp.forward_backward(run, x, w1, w2, dy, offs)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default="small,qwen3,dsv3,gptoss,mixtral")
  p.add_argument("--routing", default="balanced")
  p.add_argument("--rounds", type=int, default=8)
  p.add_argument("--out", type=Path, default=None, help="also write torch_in_turn.json there")
  a = p.parse_args()
  if not torch.cuda.is_available():
    sys.exit("torch_in_turn.py: torch sees no CUDA device (GPU only)")
  import jax

  def sync(out):  # a torch step returns a tuple of tensors, a JAX step a pytree of arrays
    if isinstance(out, tuple) and isinstance(out[0], torch.Tensor):
      torch.cuda.synchronize()
    else:
      jax.block_until_ready(out)

  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "torch": torch.__version__,
             "command": " ".join(sys.argv), "shapes": {}}
  for shape in a.shapes.split(","):
    step, args = kernel_share.step_and_args(shape, a.routing, "jaxmlp")
    calls = {"jaxmlp": lambda i, step=step, args=args: step(*args),
             "torch": torch_step(shape, a.routing, False), "torch_compile": torch_step(shape, a.routing, True)}
    results["shapes"][shape] = measure_alternating(calls, sync, rounds=a.rounds)
    del step, args, calls
    torch.cuda.empty_cache()
    line = ", ".join(f"{impl} {t['s'] * 1e3:.3f} ms" for impl, t in results["shapes"][shape].items())
    print(f"{shape}: {line}", file=sys.stderr, flush=True)
  if a.out:
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "torch_in_turn.json").write_text(json.dumps(results, indent=1))
  print(f"\n{results['device']}, jax {results['jax']}, torch {results['torch']}, {a.routing} routing, bf16 fwd+bwd, "
        f"medians of {a.rounds} rounds taken in turn, shuffled; jaxmlp's speedup over each (minimums' ratio)\n")
  print("| shape | jaxmlp ms | over torch eager | over torch.compile |")
  print("|---|---|---|---|")
  for shape, t in results["shapes"].items():
    j = t["jaxmlp"]
    cells = [f"{t[i]['s'] / j['s']:.2f}x ({t[i]['min_s'] / j['min_s']:.2f}x)" for i in IMPLS[1:]]
    print(f"| {shape} | {j['s'] * 1e3:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
