"""FP8 against bf16 with their samples taken in turn: the issue's FP8 targets as ratios that the clock's drift
under the GPU's power cap cannot tilt (bench.py times each implementation after the other, seconds apart).

For each shape, the fwd+bwd steps of the named implementations (bench.py's, built by kernel_share.py) are
timed round after round, one sample of about 0.1 s of each per round in a shuffled order
(timing.measure_alternating), and reported as medians and as speedups over the first implementation.

  python benchmarks/fp8_in_turn.py --shapes dsv3,mixtral,gptoss,qwen3 --rounds 10

An implementation named IMPL@PATH is IMPL compiled with JAXMLP_GEMM_PATH=PATH (the path is chosen at trace
time), so two GEMM paths of one implementation can be timed in turn: --impls
jaxmlp_fp8_cached,jaxmlp_fp8_cached@cutlass (the tensorwise recipe's row products on the CUTLASS engine).
"""
import argparse
import json
import sys
from pathlib import Path

import kernel_share
from timing import measure_alternating

DEFAULT_IMPLS = "jaxmlp,jaxmlp_fp8_cached,jaxmlp_fp8_blockwise_cached,jaxmlp_fp8,jaxmlp_fp8_blockwise"


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", default="dsv3,mixtral,gptoss,qwen3")
  p.add_argument("--routing", default="balanced")
  p.add_argument("--impls", default=DEFAULT_IMPLS, help="comma-separated, the first is the baseline "
                 f"(default {DEFAULT_IMPLS})")
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--out", type=Path, default=None, help="also write fp8_in_turn.json there")
  a = p.parse_args()
  impls = a.impls.split(",")
  for impl in impls:
    if impl.split("@")[0] not in kernel_share.IMPLS:
      sys.exit(f"--impls: {impl!r}: expected one of {', '.join(kernel_share.IMPLS)}")
  results = new_results()
  for shape in a.shapes.split(","):
    steps = {impl: compiled_step(shape, a.routing, impl) for impl in impls}
    measure_shape(results, shape, {impl: (lambda i, s=s: s[0](*s[1])) for impl, s in steps.items()}, a.rounds)
    del steps
  report(results, impls, a, "fwd+bwd", "fp8_in_turn.json")


def compiled_step(shape: str, routing: str, impl: str):
  """kernel_share.step_and_args of IMPL, run once (compiled) under JAXMLP_GEMM_PATH=PATH for IMPL@PATH."""
  name, _, path = impl.partition("@")
  return kernel_share.traced_on(path or None, lambda: kernel_share.step_and_args(shape, routing, name))


def new_results() -> dict:
  import jax
  return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "command": " ".join(sys.argv),
          "shapes": {}}


def measure_shape(results: dict, shape: str, calls: dict, rounds: int) -> None:
  """Times `calls` ({name: call(i)}) in turn into results["shapes"][shape]; a line on stderr."""
  import jax
  results["shapes"][shape] = measure_alternating(calls, jax.block_until_ready, rounds=rounds)
  line = ", ".join(f"{name} {t['s'] * 1e3:.3f} ms" for name, t in results["shapes"][shape].items())
  print(f"{shape}: {line}", file=sys.stderr, flush=True)


def report(results: dict, names: list, a, what: str, filename: str) -> None:
  """The JSON (under a.out, where given) and the table of speedups over names[0]."""
  if a.out:
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / filename).write_text(json.dumps(results, indent=1))
  base = names[0]
  print(f"\n{results['device']}, jax {results['jax']}, {a.routing} routing, {what}, medians of {a.rounds} rounds "
        f"taken in turn, shuffled; speedup over {base} (minimums' ratio in brackets)\n")
  print("| shape | " + " | ".join(names) + " |")
  print("|---" * (len(names) + 1) + "|")
  for shape, t in results["shapes"].items():
    cells = [f"{t[base]['s'] * 1e3:.3f} ms"] + [
        f"{t[base]['s'] / t[n]['s']:.2f}x ({t[base]['min_s'] / t[n]['min_s']:.2f}x)" for n in names[1:]]
    print(f"| {shape} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
