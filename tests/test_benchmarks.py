"""The benchmark command runs end to end (CPU mode here): tables, JSON and the overhead stack."""
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def test_benchmark_runs_on_the_cpu(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, str(BENCH), "--shapes", "tiny", "--routing", "balanced", "--impls", "jaxmlp,ragged_dot",
         "--repeats", "1", "--budget-s", "0.1", "--layers", "2", "--out", str(tmp_path)]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  results = json.loads((tmp_path / "bench.json").read_text())
  assert results["meta"]["mode"] == "cpu"
  (case,) = results["cases"]
  for impl in ("jaxmlp", "ragged_dot"):
    for mode in ("fwd", "fwd_bwd"):
      assert case["impls"][impl][mode]["s"] > 0
  assert case["impls"]["jaxmlp"]["check"]["ok"]
  (overhead,) = results["overhead"]["variants"].values()
  assert all(overhead[impl]["fwd_bwd"]["us_per_layer"] > 0 for impl in ("jaxmlp", "ragged_dot"))
  md = (tmp_path / "bench.md").read_text()
  assert "## Host overhead" in md and "- Command: `" in md


def test_benchmark_rejects_bad_arguments(tmp_path):
  for args, message in ((["--sets", "0"], "--sets must be at least 1"),
                        (["--shapes", "qwen3,nope"], "--shapes: nope")):
    proc = subprocess.run([sys.executable, str(BENCH), *args, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
