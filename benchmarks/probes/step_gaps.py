"""Where a step's wall time goes beyond its kernels: launch gaps inside a step, gaps between steps, or
slower kernels under sustained load (clocks under the power cap).

For each case (SHAPE ROUTING IMPL, as benchmarks/kernel_share.py takes them): a traced burst of steps
launched back to back right after warm-up, then six seconds of them timed four at a time (the GPU's SM
clock and power sampled by nvidia-smi meanwhile), then the same traced burst again. Per burst: the kernels'
time per step, the span per step (first kernel's start to last's end over the burst) and the idle time.

  python benchmarks/probes/step_gaps.py dsv3:balanced:jaxmlp_fp8_blockwise_cached dsv3:balanced:jaxmlp
"""
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_share  # noqa: E402

BURST = 4


def traced_burst(step, args):
  import jax
  kernels = kernel_share.traced_kernels(lambda: jax.block_until_ready([step(*args) for _ in range(BURST)]))
  spans = sorted((start, start + ns) for _, ns, start in kernels)
  busy, idle, until = 0.0, 0.0, spans[0][0]
  for s, e in spans:
    idle += max(0.0, s - until)
    busy += max(0.0, e - max(s, until))
    until = max(until, e)
  per_step_us = 1e-3 / BURST
  return {"kernels_us": busy * per_step_us, "span_us": (until - spans[0][0]) * per_step_us,
          "idle_us": idle * per_step_us, "launches": len(spans) / BURST}


def sustained(step, args, seconds=6.0):
  import jax
  smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
                          "-lms", "100"], stdout=subprocess.PIPE, text=True)
  times = []
  start = time.perf_counter()
  while time.perf_counter() - start < seconds:
    t = time.perf_counter()
    out = None
    for _ in range(4):
      out = step(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t) / 4)
  smi.terminate()
  rows = [l.split(",") for l in smi.communicate()[0].splitlines() if l.count(",") == 2]
  clocks = [float(r[0]) for r in rows]
  power = [float(r[1]) for r in rows]
  return {"wall_us": statistics.median(times) * 1e6, "first_wall_us": times[0] * 1e6, "last_wall_us": times[-1] * 1e6,
          "sm_mhz": (min(clocks), statistics.median(clocks), max(clocks)) if clocks else None,
          "power_w": (statistics.median(power), max(power)) if power else None}


def main():
  import jax
  rows = []
  for case in sys.argv[1:]:
    shape, routing, impl = case.split(":")
    step, args = kernel_share.step_and_args(shape, routing, impl)
    for _ in range(3):
      jax.block_until_ready(step(*args))
    cold = traced_burst(step, args)
    loop = sustained(step, args)
    hot = traced_burst(step, args)
    rows.append((case, cold, loop, hot))
    print(case, json.dumps({"cold": cold, "sustained": loop, "hot": hot}), flush=True)
  print(f"\n{'case':44s} {'kern cold':>9s} {'span':>7s} {'idle':>6s} {'launch':>6s} | {'wall':>7s} {'sm MHz min/med':>14s}"
        f" {'W med/max':>9s} | {'kern hot':>8s} {'span':>7s} {'idle':>6s}")
  for case, c, s, h in rows:
    mhz = f"{s['sm_mhz'][0]:.0f}/{s['sm_mhz'][1]:.0f}" if s["sm_mhz"] else "-"
    pw = f"{s['power_w'][0]:.0f}/{s['power_w'][1]:.0f}" if s["power_w"] else "-"
    print(f"{case:44s} {c['kernels_us']:9.0f} {c['span_us']:7.0f} {c['idle_us']:6.0f} {c['launches']:6.0f} | "
          f"{s['wall_us']:7.0f} {mhz:>14s} {pw:>9s} | {h['kernels_us']:8.0f} {h['span_us']:7.0f} {h['idle_us']:6.0f}")


if __name__ == "__main__":
  main()
