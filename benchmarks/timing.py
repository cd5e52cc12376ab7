"""Device-synchronised wall-clock timing shared by the JAX driver and the torch subprocess, and the
host's own time per call.

Framework-free: the caller passes `call(i)` (launch one call on input set i, return its output) and
`sync(out)` (wait until that output, and so every call before it on the stream, is done).
"""
from __future__ import annotations

import random
import statistics
import time


def measure(call, sync, *, repeats: int, max_call_s: float, budget_s: float, sample_s: float = 0.02) -> dict:
  """Median seconds per call.

  One untimed call first (compilation, autotuning, library initialisation), then one timed call that
  both warms up and sizes the samples. Each sample launches k calls back to back, rotating input sets,
  and waits once: k is chosen so a sample lasts about `sample_s`, so short calls are measured at the
  rate a training loop would see rather than at Python's launch latency. Sampling stops after
  `repeats` samples, or once `budget_s` is spent and min(3, `repeats`) samples are taken. A call
  slower than `max_call_s` is reported from that single call and marked "too slow", so one
  pathological implementation cannot stall the whole run.
  """
  start = time.perf_counter()
  sync(call(0))
  first_call_s = time.perf_counter() - start

  one = _sample(call, sync, 1, 1)
  result = {"first_call_s": first_call_s}
  if one > max_call_s:
    return {**result, "s": one, "min_s": one, "samples": 1, "calls_per_sample": 1, "status": "too slow"}

  k = max(1, min(200, round(sample_s / one)))
  samples: list[float] = []
  budget_start = time.perf_counter()
  while len(samples) < repeats and (len(samples) < 3 or time.perf_counter() - budget_start < budget_s):
    samples.append(_sample(call, sync, k, first=len(samples) * k))
  return {**result, "s": statistics.median(samples), "min_s": min(samples), "samples": len(samples),
          "calls_per_sample": k, "status": "ok"}


def measure_alternating(calls: dict, sync, *, rounds: int, sample_s: float = 0.1, seed: int = 0) -> dict:
  """Median seconds per call of each of `calls` ({name: call(i)}), their samples taken in turn, round
  after round, so that every call meets the same clocks: under a power cap the GPU's clock drifts over
  seconds, and calls timed one after the other can differ by more than the difference between them.
  The order is shuffled in each round: the clock at a sample's start follows the power its predecessor
  drew, and a fixed order would always hand the same call the clock left by the same neighbour. Samples
  last about `sample_s` (k calls each, sized as in `measure`), long beside the power limiter's reaction."""
  rng = random.Random(seed)
  k = {}
  for name, call in calls.items():
    sync(call(0))
    k[name] = max(1, min(200, round(sample_s / _sample(call, sync, 1, 1))))
  samples = {name: [] for name in calls}
  order = list(calls)
  for r in range(rounds):
    rng.shuffle(order)
    for name in order:
      samples[name].append(_sample(calls[name], sync, k[name], first=r * k[name]))
  return {name: {"s": statistics.median(v), "min_s": min(v), "samples": len(v), "calls_per_sample": k[name]}
          for name, v in samples.items()}


def _sample(call, sync, k: int, first: int) -> float:
  start = time.perf_counter()
  out = None
  for i in range(first, first + k):
    out = call(i)  # earlier outputs are released as we go; the stream runs the calls in order
  sync(out)
  return (time.perf_counter() - start) / k


def host_seconds(call, hold, still_running, sync, *, calls: int = 8, samples: int = 7) -> dict:
  """Median host seconds per call: the time to dispatch `calls` calls while the device is still busy with
  work enqueued just before them (`hold()` enqueues it and returns a handle; `still_running(handle)`
  says whether the device is still on it), so that no dispatch waits for the device. That is what the
  host spends per call in a loop whose pace the device sets, where the wall time shows only the larger
  of the two.

  A sample whose hold ended before its dispatches did may have waited for the device (a full launch
  queue blocks the host, for one) and is discarded; the next samples then dispatch half as many calls.
  Reports "not measured" if even single calls outlast the hold.
  """
  per_call: list[float] = []
  counted = 0  # calls of the last valid sample
  while calls >= 1 and len(per_call) < samples:
    busy = hold()
    out = call()  # untimed: the first call after an idle host runs cold
    start = time.perf_counter()
    for _ in range(calls):
      out = call()
    elapsed = time.perf_counter() - start
    valid = still_running(busy)
    sync(out)
    if valid:
      per_call.append(elapsed / calls)
      counted = calls
    else:
      calls //= 2
  if not per_call:
    return {"status": "not measured", "reason": "single calls outlasted the device work held before them"}
  return {"s": statistics.median(per_call), "min_s": min(per_call), "samples": len(per_call),
          "calls_per_sample": counted, "status": "ok"}
