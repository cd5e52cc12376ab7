"""benchmarks/moe_layer.py and moe_expert_parallel.py run end to end (CPU mode here, the tiny shape): every
part of both JAX paths timed, the two layers agree, and the reports are written."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "moe_layer.py"
EXPERT_PARALLEL_BENCH = BENCH.parent / "moe_expert_parallel.py"


@pytest.mark.full
def test_moe_layer_benchmark_runs_on_the_cpu(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, str(BENCH), "--no-torch", "--repeats", "1", "--budget-s", "0.1", "--out", str(tmp_path)]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  results = json.loads((tmp_path / "moe_layer.json").read_text())
  assert results["meta"]["mode"] == "cpu"
  case = results["cases"]["tiny"]
  for path in ("jaxmlp", "argsort"):
    for part in ("router", "dispatch", "mlp", "combine", "layer"):
      assert case["paths"][path][part]["s"] > 0, (path, part)
  assert case["check"]["y"] < 1e-5 and case["check"]["dx"] < 1e-5, case["check"]
  assert case["paths"]["torch"]["status"] == "skipped"
  assert case["alternating"]["layer"]["samples"] == case["alternating"]["mlp"]["samples"] == 1
  assert case["alternating"]["layer"]["s"] > 0 and case["alternating"]["mlp"]["s"] > 0
  md = (tmp_path / "moe_layer.md").read_text()
  assert "| jaxmlp |" in md and "with their samples taken in turn (1 rounds)" in md


def test_moe_layer_benchmark_rejects_unknown_shapes(tmp_path):
  proc = subprocess.run([sys.executable, str(BENCH), "--shapes", "nope", "--out", str(tmp_path)],
                        capture_output=True, text=True, timeout=120, cwd=tmp_path,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode != 0 and "--shapes: 'nope'" in proc.stderr


@pytest.mark.full
def test_expert_parallel_benchmark_runs_on_host_devices(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  cmd = [sys.executable, str(EXPERT_PARALLEL_BENCH), "--repeats", "1", "--budget-s", "0.1", "--out", str(tmp_path),
         "--chunks", "1,2"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads((tmp_path / "moe_expert_parallel.json").read_text())["rows"]
  assert set(rows) == {"layer, all_gather, 1 devices", "layer, all_gather, 2 devices",
                       "layer, all_gather in 2 chunks, 2 devices"}
  assert all(row["s"] > 0 for row in rows.values())
  assert "| layer, all_gather, 2 devices |" in (tmp_path / "moe_expert_parallel.md").read_text()


def test_expert_parallel_benchmark_rejects_unknown_exchanges(tmp_path):
  proc = subprocess.run([sys.executable, str(EXPERT_PARALLEL_BENCH), "--exchanges", "all_gather,nope",
                         "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode != 0 and "--exchanges: unknown 'nope'" in proc.stderr
