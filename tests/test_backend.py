"""Which backend and GEMM path serve a call, and what jaxmlp.backend_info() says of it: the CUDA path policy
(a GPU's status stubbed where the machine has none), a forced path's effect on CPU calls, and the reasons given
where the CUDA handlers are missing."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_error

import jaxmlp
import numpy_reference as ref
from jaxmlp import _library


def _forced_path_args(rng):
  x, w1, w2 = rng.standard_normal((40, 16)), rng.standard_normal((2, 16, 32)) / 4, rng.standard_normal((2, 16, 16)) / 4
  args = dict(x=x, w1=w1, w2=w2, group_sizes=np.array([15, 25], np.int32))
  return {k: jnp.asarray(v, jnp.int32 if k == "group_sizes" else jnp.float32) for k, v in args.items()}


@pytest.mark.parametrize("path", ["grouped", "cutlass", "fused", "tiled"])
def test_cpu_calls_under_a_forced_cuda_gemm_path(rng, monkeypatch, path):
  """The CUDA branch is traced on every machine with CUDA devices. Forcing its GEMM path leaves CPU calls
  alone where the devices can run the path."""
  monkeypatch.setenv("JAXMLP_GEMM_PATH", path)
  engine = "cutlass" if path == "fused" else path  # the fused path runs FC1 on the CUTLASS engine
  if _library.cuda_devices() and not _library.cuda_status().get(f"{engine}_available"):
    pytest.skip(f"this GPU cannot run the {path} path (test_a_forced_path_the_gpu_cannot_run_fails_at_trace_time)")
  args = _forced_path_args(rng)
  with jax.default_device(jax.devices("cpu")[0]):
    got = jax.jit(lambda a: jaxmlp.grouped_mlp(**a))(args)
  n = {k: np.asarray(v, np.float64) for k, v in args.items()}
  assert rel_error(got, ref.grouped_mlp(n["x"], n["w1"], n["w2"], [15, 25], "swiglu")) < 1e-5


@pytest.mark.parametrize("path", ["grouped", "cutlass", "fused", "tiled"])
def test_a_forced_path_the_gpu_cannot_run_fails_at_trace_time(rng, monkeypatch, path):
  """Where the CUDA devices cannot run the forced path (a GPU made up, whose status says so), every call
  fails at trace time naming the setting, CPU calls too (the CUDA branch is traced), and backend_info says
  why."""
  from jaxmlp import _gemm_path
  if _library._cuda is None:
    pytest.skip("built without the CUDA handlers: backend_info reports the build instead")
  status = {"grouped_available": path != "grouped", "tiled_available": path != "tiled",
            "cutlass_available": path not in ("cutlass", "fused"), "grouped_reason": "made up",
            "tiled_reason": "made up", "cutlass_reason": "made up"}
  monkeypatch.setattr(_library, "cuda_devices", lambda: ("cuda:0",))
  monkeypatch.setattr(_library, "cuda_status", lambda: status)
  monkeypatch.setattr(_gemm_path, "cuda_status", lambda: status)
  monkeypatch.setattr(jaxmlp.backend, "fp8_status", lambda: (False, "made up"))
  monkeypatch.setenv("JAXMLP_GEMM_PATH", path)
  with pytest.raises(RuntimeError, match=f"JAXMLP_GEMM_PATH={path}, but .*: made up"):
    jax.jit(lambda a: jaxmlp.grouped_mlp(**a)).lower(_forced_path_args(rng))
  info = jaxmlp.backend_info()["cuda"]
  assert info["gemm_path"] is None and f"JAXMLP_GEMM_PATH={path}, but" in info["why"]


def test_auto_takes_the_engine_where_it_measured_faster(monkeypatch):
  """The policy alone (a GPU's status stubbed): `auto` runs a grouped_mlp whose FC1 the engine fuses (any
  activation, b1 or not, f a multiple of 64) on the engine within ENGINE_ROWS_PER_GROUP for small experts,
  forward and backward; a larger experts' forward on the fused path within FUSED_ROWS_PER_GROUP; everything
  else (other f, ragged_dot's products) on cuBLASLt; forcing the fused path where the engine cannot run is an
  error naming it."""
  from jaxmlp import _gemm_path
  status = {"grouped_available": True, "tiled_available": True, "cutlass_available": True}
  monkeypatch.setattr(_gemm_path, "cuda_status", lambda: status)
  monkeypatch.delenv("JAXMLP_GEMM_PATH", raising=False)
  E = 128

  def path(rows_per_group, d, f, mlp="forward", fusable=True):
    return _gemm_path.gemm_path(jnp.bfloat16, d, f, 2 * f, problem=(E, rows_per_group * E, d, 2 * f), mlp=mlp,
                                fusable=fusable)[0]

  small, large = (2048, 768), (2880, 2880)  # qwen3's experts (3.1M weights in FC1), gpt-oss's (16.6M)
  low, high = _gemm_path.ENGINE_ROWS_PER_GROUP
  assert path(low, *small) == path(high, *small) == path(low, *small, mlp="backward") == "cutlass"
  assert path(low, *small, fusable=False) == path(low, *small, mlp=None) == "grouped"  # unmeasured; ragged_dot
  assert path(low, *large) == path(high, *large) == "fused"
  assert path(low, *large, mlp="backward") == path(low, *large, fusable=False) == "grouped"
  low, high = _gemm_path.FUSED_ROWS_PER_GROUP
  assert path(low, *small) == "fused"  # one tile a group: no engine, but its fused FC1
  assert path(low - 1, *large) == path(high + 1, *large) == path(high + 1, *small) == "grouped"
  status["cutlass_available"] = False
  assert path(256, *small) == path(256, *large) == "grouped"
  monkeypatch.setenv("JAXMLP_GEMM_PATH", "fused")
  with pytest.raises(RuntimeError, match="JAXMLP_GEMM_PATH=fused, but jaxmlp's CUTLASS engine cannot run"):
    path(256, *small)
  assert _gemm_path.fc1_fusable(768)
  assert not _gemm_path.fc1_fusable(96)  # not whole 64-column pieces (gated: 2f = 192, not whole 128-column tiles)
  # A padded buffer (the expert-parallel layer's): the policy decides by the rows expected in use.
  assert _gemm_path.expected_rows(1000) == 1000
  with _gemm_path.padded_buffers(4.0):
    assert _gemm_path.expected_rows(1000) == 250
  for buffer, rows in ((1000, 480), (1028, 948), (65536, 20480)):  # a factor buffer / rows gives rows (floored: 479)
    with _gemm_path.padded_buffers(buffer / rows):
      assert _gemm_path.expected_rows(buffer) == rows, (buffer, rows)
  assert _gemm_path.expected_rows(1000) == 1000


def test_backend_info_reports_each_platform():
  info = jaxmlp.backend_info()
  assert {"jax", "cpu", "cuda", "summary"} <= set(info)
  assert "built" in info["cuda"]
  assert "emulated" in info["cpu"]["fp8"] and "jax.lax.ragged_dot" in info["cpu"]["ragged_dot"]
  if not info["cuda"]["devices"]:  # a CPU machine: said plainly, not as a failure
    assert info["summary"].startswith("CPU: jaxmlp's C++ handlers run every op, and the FP8 recipes are emulated")
    assert "nothing is missing to run on the CPU" in info["cuda"]["why"] or info["cuda"]["built"]
  if info["cuda"]["devices"]:
    assert info["cuda"]["gemm_path"] in ("grouped", "fallback") and info["cuda"]["why"]
    assert info["cuda"]["small_gemm_path"] in ("tiled", "grouped", "fallback") and info["cuda"]["small_why"]
    assert info["cuda"]["mlp_forward_path"] in ("cutlass", "fused", "grouped", "fallback")
    assert info["cuda"]["mlp_forward_why"]
    assert info["cuda"]["cublaslt_version"] > 0


# Imports jaxmlp with its CUDA extension hidden (None in sys.modules: what Python does for a module that
# is not there) or failing to load (a finder that raises, as a shared library with a missing symbol does).
HIDDEN_CUDA_SCRIPT = """
import importlib.abc, sys
if sys.argv[1] == "missing":
  sys.modules["jaxmlp._cuda"] = None
else:
  class Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
      if name == "jaxmlp._cuda":
        raise ImportError("_cuda.so: undefined symbol: cudaGetDevice")
  sys.meta_path.insert(0, Broken())
import jaxmlp
print(jaxmlp.backend_info()["cuda"]["why"])
"""


@pytest.mark.parametrize("how, says", [
    ("missing", "the jaxmlp._cuda extension was not built ("),  # and the reason CMake recorded
    ("broken", "the jaxmlp._cuda extension failed to load: _cuda.so: undefined symbol: cudaGetDevice"),
])
def test_backend_info_says_why_the_cuda_handlers_are_missing(how, says):
  out = subprocess.run([sys.executable, "-P", "-c", HIDDEN_CUDA_SCRIPT, how], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr
  assert says in out.stdout
