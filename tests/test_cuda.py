"""CUDA-only checks: realistic sizes on every GEMM path, the automatic choice between them, and the sync-free
paths inside XLA command buffers.

Skipped without a GPU (the `backend` fixture and cuda_reason in conftest.py say why).
"""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOLERANCE, check_close, check_padding_rows_zero, cuda_reason, skip_unless_served

import jaxmlp
import numpy_reference as ref
from jaxmlp import _library
from jaxmlp.fp8.cuda import fp8_status

pytestmark = pytest.mark.gpu
f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731


def check_bf16(got, want, name=""):
  check_close(got, want, TOLERANCE["bfloat16"], name)


@pytest.mark.parametrize("sizes", [
    [512, 0, 1024, 300, 212],             # balanced-ish with an empty group
    [0, 0, 2000, 48, 0],                  # skewed
    [100, 100, 100, 100, 100],            # sum < M: padding rows
])
def test_bf16_mlp_at_moe_sizes(backend, rng, sizes):
  if backend == "cpu":
    pytest.skip("CUDA sizes")
  M, d, f = 2048, 256, 384
  E = len(sizes)
  x = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16)
  w1 = jnp.asarray(rng.standard_normal((E, d, 2 * f)) / np.sqrt(d), jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((E, f, d)) / np.sqrt(f), jnp.bfloat16)
  s = jnp.asarray(rng.uniform(0.2, 1, M), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  y, vjp = jax.vjp(lambda x, w1, w2, s: jaxmlp.grouped_mlp(x, w1, w2, gs, scales=s), x, w1, w2, s)
  got = vjp(dy)
  want_y, want = ref.grouped_mlp(f64(x), f64(w1), f64(w2), sizes, "swiglu", scales=f64(s), dy=f64(dy))
  check_bf16(y, want_y)
  for g, k in zip(got, ("x", "w1", "w2", "scales")):
    check_bf16(g, want[k], k)
  check_padding_rows_zero(M, sizes, y, got[0], got[3])


@pytest.mark.parametrize("E, M", [(70, 512), (1100, 8192)])
def test_more_groups_than_one_pass_of_the_scans(backend, rng, E, M):
  """The device code walks group_sizes in passes: 32 groups on one warp (the tiled kernel; the setup
  kernel up to 32 groups), 256 on a block (the setup kernel beyond, and the zeroing kernel). 70 groups
  take three warp passes or one block pass, 1100 five block passes. A third of the groups are empty or
  negative (the fallback's packed pointer arrays skip them, their weight gradients are zeros), and
  padding rows follow the last group."""
  if backend == "cpu":
    pytest.skip("CUDA group scans")
  d, f = 64, 96
  sizes = rng.integers(1, 12, E)
  sizes[rng.choice(E, E // 3, replace=False)] = rng.integers(-3, 1, E // 3)
  bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  x, w1, w2, b1, b2, dy = bf16(M, d), bf16(E, d, 2 * f), bf16(E, f, d), bf16(E, 2 * f), bf16(E, d), bf16(M, d)
  gs = jnp.asarray(sizes, jnp.int32)
  y, vjp = jax.vjp(lambda x, w1, w2, b1, b2: jaxmlp.grouped_mlp(x, w1, w2, gs, b1=b1, b2=b2), x, w1, w2, b1, b2)
  got = vjp(dy)
  want_y, want = ref.grouped_mlp(f64(x), f64(w1), f64(w2), sizes, "swiglu", b1=f64(b1), b2=f64(b2), dy=f64(dy))
  check_bf16(y, want_y)
  for g, k in zip(got, ("x", "w1", "w2", "b1", "b2")):
    check_bf16(g, want[k], k)
  check_padding_rows_zero(M, sizes, y, got[0])


COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import jax, jax.numpy as jnp, numpy as np
    import jaxmlp
    fp8 = os.environ.get("JAXMLP_TEST_FP8") or None
    rng = np.random.default_rng(0)
    M, d, f, E = 1024, 128, 256, 4
    x = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((E, d, 2 * f)) / 16, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((E, f, d)) / 16, jnp.bfloat16)
    gs = jnp.asarray([300, 0, 500, 100], jnp.int32)
    def loss(x, w1, w2):
      return jnp.sum(jaxmlp.grouped_mlp(x, w1, w2, gs, fp8=fp8).astype(jnp.float32) ** 2)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    from jaxmlp import _library
    # As in a training loop, each step's results are dropped before the next, so XLA reuses the same
    # buffers and replays the captured graph (new buffer addresses would make it re-record).
    losses = []
    for i in range(30):
      if i == 10:  # XLA records a graph per set of buffer addresses it sees; by now it has them all
        warm = _library._cuda.handler_host_calls()
      v, g = jax.block_until_ready(step(x, w1, w2))
      losses.append(float(v))
    assert len(set(losses)) == 1
    print(json.dumps({"host_calls": _library._cuda.handler_host_calls() - warm, "loss": float(v),
                      "grads": [np.asarray(a, np.float32).tolist() for a in g]}))
""")


@pytest.mark.parametrize("path, fp8", [("grouped", None), ("cutlass", None), ("fused", None), ("tiled", None),
                                       ("grouped", "tensorwise"), ("grouped", "blockwise")])
def test_sync_free_paths_inside_command_buffers(path, fp8):
  """The grouped-, CUTLASS-, fused- and tiled-path handlers, and the FP8 recipes' (quantizers and products), are
  captured into an XLA command buffer and give identical results."""
  reason = cuda_reason(path) or (fp8 and not fp8_status()[0] and fp8_status()[1])
  if reason:
    pytest.skip(reason)
  import json

  def run(flags):
    # XLA's own allocator: without preallocation buffer addresses can move between steps, and XLA then
    # re-records the command buffer, which runs the handlers' host code again.
    env = dict(os.environ, JAXMLP_GEMM_PATH=path, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_PREALLOCATE="true",
               JAXMLP_TEST_FP8=fp8 or "")
    out = subprocess.run([sys.executable, "-P", "-c", COMMAND_BUFFER_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])

  with_cb = run("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
  without = run("--xla_gpu_enable_command_buffer=")
  # 20 steady-state steps of one forward and one backward call: 40 host executions (more with FP8: its
  # weights' quantization, and the blockwise recipe's quantizers and products), or none when XLA replays
  # the captured command buffer.
  assert without["host_calls"] == 40 if fp8 is None else without["host_calls"] >= 80
  assert with_cb["host_calls"] == 0, "the jaxmlp custom calls were not replayed from a command buffer"
  assert with_cb["loss"] == without["loss"]
  for a, b in zip(with_cb["grads"], without["grads"]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(_library._cuda is None, reason="built without the CUDA handlers")
def test_workspace_sizes_reject_an_unknown_gemm_path():
  """The CUDA module (built in CI, which has nvcc but no GPU) sizes scratch per path and names the bad one."""
  cuda = _library._cuda
  assert cuda.gemm_workspace_bytes("tiled", 8) < cuda.gemm_workspace_bytes("grouped", 8)  # no cuBLAS workspace
  # A ragged_dot call is one tiled launch, which never splits: the group arrays only, no split-K scratch.
  assert cuda.gemm_workspace_bytes("tiled", 8) <= 1024
  # The fused path carves the engine's arrays and workspace besides cuBLASLt's, as the CUTLASS path does.
  assert cuda.gemm_workspace_bytes("fused", 8) == cuda.gemm_workspace_bytes("cutlass", 8) > \
      cuda.gemm_workspace_bytes("grouped", 8)
  # The bias gradients' float sums, E * max(F1, d) of them, only where there are biases.
  assert (cuda.mlp_workspace_bytes("grouped", False, 256, 256, 512, 1024, 8, 1, True) -
          cuda.mlp_workspace_bytes("grouped", False, 256, 256, 512, 1024, 8, 1, False)) >= 8 * 1024 * 4
  with pytest.raises(ValueError, match="unknown GEMM path 'cublas'"):
    cuda.gemm_workspace_bytes("cublas", 8)
  with pytest.raises(ValueError, match="unknown GEMM path ''"):
    cuda.mlp_workspace_bytes("", True, 256, 256, 512, 1024, 8, 1, False)


def test_small_problems_take_the_tiled_path_and_large_ones_cublas(monkeypatch):
  reason = cuda_reason("tiled")
  if reason:
    pytest.skip(reason)
  from jaxmlp._gemm_path import TILED_MAX_WEIGHTS, gemm_path
  monkeypatch.setenv("JAXMLP_GEMM_PATH", "auto")
  bf16 = jnp.bfloat16
  assert gemm_path(bf16, 256, 1024, problem=(8, 256, 256, 1024))[0] == "tiled"
  assert gemm_path(bf16, 256, 1024, problem=(8, 4096, 256, 1024))[0] == "tiled"
  assert gemm_path(bf16, 1024, 4096, problem=(8, 16, 1024, 4096))[0] != "tiled"  # large weights
  assert gemm_path(bf16, 256, 1024, problem=(8, 1 << 16, 256, 1024))[0] != "tiled"  # much work
  assert gemm_path(bf16, 256, 1020, problem=(8, 256, 256, 1020))[0] != "tiled"  # rows not 16-byte multiples
  assert gemm_path(jnp.float32, 256, 1024, problem=(8, 256, 256, 1024))[0] == "fallback"
  info = jaxmlp.backend_info()["cuda"]
  assert info["small_gemm_path"] == "tiled" and info["tiled_max_weights"] == TILED_MAX_WEIGHTS


def test_tiled_kernel_uses_wgmma_exactly_where_built_for_hopper():
  reason = cuda_reason("tiled")
  if reason:
    pytest.skip(reason)
  info = jaxmlp.backend_info()["cuda"]
  # wgmma needs compute capability 9.0 and code for sm_90a (the default build's 90a-real).
  archs = info["cuda_architectures"].split(",")
  hopper_build = info["compute_capability"] == "9.0" and any(a.startswith("90a") for a in archs)
  expected = "(wgmma)" if hopper_build else "(mma.sync)"
  assert info["tiled_reason"].endswith(expected), (info["tiled_reason"], info["cuda_architectures"])


@pytest.mark.parametrize("sizes", [
    [32] * 8,                             # balanced: the host-overhead layer
    [200, 0, 56, 0, 0, 0, 0, 0],          # skewed, empty groups (zero weight gradients)
    [10, 3, 0, 40, 1, 0, 7, 2],           # sum < M: padding rows
    [300, -5, 2**31 - 1, 9, 0, 0, 0, 1],  # adversarial: negative, huge, past M
])
def test_tiled_path_at_the_host_overhead_layer(monkeypatch, rng, sizes):
  """The layer of the host-overhead benchmark takes the tiled path by itself: long reductions (FC2 and
  the FC1 dgrad: 8 and 16 k-steps, the latter split over 2 blocks), the backward's products in one
  launch, biases and scales, against float64; and ragged_dot at the same size."""
  reason = cuda_reason("tiled")
  if reason:
    pytest.skip(reason)
  monkeypatch.setenv("JAXMLP_GEMM_PATH", "auto")  # this size takes the tiled path by itself
  M, d, f, E = 256, 256, 512, 8
  x = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16)
  w1 = jnp.asarray(rng.standard_normal((E, d, 2 * f)) / np.sqrt(d), jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((E, f, d)) / np.sqrt(f), jnp.bfloat16)
  b1 = jnp.asarray(rng.standard_normal((E, 2 * f)), jnp.bfloat16)
  b2 = jnp.asarray(rng.standard_normal((E, d)), jnp.bfloat16)
  s = jnp.asarray(rng.uniform(0.2, 1, M), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  with jax.default_device(jax.devices("cuda")[0]):
    y, vjp = jax.vjp(lambda *a: jaxmlp.grouped_mlp(*a[:3], gs, b1=a[3], b2=a[4], scales=a[5]), x, w1, w2, b1, b2, s)
    got = vjp(dy)
    lhs, rhs = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16), w1[:, :, :f]
    dout = jnp.asarray(rng.standard_normal((M, f)), jnp.bfloat16)
    out, dot_vjp = jax.vjp(lambda a, b: jaxmlp.ragged_dot(a, b, gs), lhs, rhs)
    dlhs, drhs = dot_vjp(dout)
  from jaxmlp._gemm_path import gemm_path
  assert gemm_path(jnp.bfloat16, d, f, 2 * f, problem=(E, M, d, 2 * f))[0] == "tiled"
  want_y, want = ref.grouped_mlp(f64(x), f64(w1), f64(w2), sizes, "swiglu", b1=f64(b1), b2=f64(b2), scales=f64(s),
                                 dy=f64(dy))
  check_bf16(y, want_y)
  for g, k in zip(got, ("x", "w1", "w2", "b1", "b2", "scales")):
    check_bf16(g, want[k], k)
  # ragged_dot: K = 256 (4 k-steps), its dgrad reduces over 512 (8 k-steps).
  check_bf16(out, ref.ragged_dot(f64(lhs), f64(rhs), sizes))
  check_bf16(dlhs, ref.ragged_dot(f64(dout), f64(rhs).transpose(0, 2, 1), sizes))
  check_bf16(drhs, ref.ragged_dot_rhs_grad(f64(lhs), f64(dout), sizes))
  check_padding_rows_zero(M, sizes, y, got[0], got[5], out, dlhs)


def test_tiled_split_reductions_are_deterministic(monkeypatch, rng):
  """The tiled path splits long reductions over up to 4 blocks (here dx reduces over F1 = 2048: 32
  k-steps, 4 splits); the last block to finish sums the splits in index order, so repeated calls give
  the same bits whichever block finished last."""
  reason = cuda_reason("tiled")
  if reason:
    pytest.skip(reason)
  monkeypatch.setenv("JAXMLP_GEMM_PATH", "tiled")
  M, d, f, E = 512, 64, 1024, 1
  x = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16)
  w1 = jnp.asarray(rng.standard_normal((E, d, 2 * f)) / np.sqrt(d), jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((E, f, d)) / np.sqrt(f), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16)
  gs = jnp.asarray([M], jnp.int32)
  step = jax.jit(lambda x, w1, w2, dy: jax.vjp(lambda x, w1, w2: jaxmlp.grouped_mlp(x, w1, w2, gs), x, w1, w2)[1](dy))
  with jax.default_device(jax.devices("cuda")[0]):
    first = [np.asarray(g) for g in step(x, w1, w2, dy)]
    for _ in range(20):
      for got, want in zip(step(x, w1, w2, dy), first):
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bias_gradients_are_deterministic(backend, rng, dtype):
  """db1 and db2 are summed per block of 64 rows, then per group in block order, without float atomics:
  repeated calls give the same bits. The groups span up to 47 blocks, one is empty, and padding rows
  follow. A changed summation order shows in float32's last bits (the fallback), and after rounding in
  some bfloat16 elements (every path). Against float64 too."""
  if backend == "cpu":
    pytest.skip("the CUDA bias gradient kernels")
  skip_unless_served(backend, dtype, 128, 256)
  M, d, f = 8192, 128, 256
  sizes = [3000, 0, 1, 2500, 1700]
  E = len(sizes)
  make = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, dtype)  # noqa: E731
  x, w1, w2 = make(M, d), make(E, d, 2 * f, scale=d**-0.5), make(E, f, d, scale=f**-0.5)
  b1, b2, dy = make(E, 2 * f), make(E, d), make(M, d)
  s = jnp.asarray(rng.uniform(0.2, 1, M), dtype)
  gs = jnp.asarray(sizes, jnp.int32)
  mlp = lambda x, w1, w2, b1, b2, s: jaxmlp.grouped_mlp(x, w1, w2, gs, b1=b1, b2=b2, scales=s)  # noqa: E731
  step = jax.jit(lambda *a: jax.vjp(mlp, *a[:6])[1](a[6])[3:5])
  first = [np.asarray(g) for g in step(x, w1, w2, b1, b2, s, dy)]
  _, want = ref.grouped_mlp(f64(x), f64(w1), f64(w2), sizes, "swiglu", b1=f64(b1), b2=f64(b2), scales=f64(s),
                            dy=f64(dy))
  for got, k in zip(first, ("b1", "b2")):
    check_close(got, want[k], TOLERANCE[jnp.dtype(dtype).name], k)
  for _ in range(10):
    for got, want_bits in zip(step(x, w1, w2, b1, b2, s, dy), first):
      np.testing.assert_array_equal(np.asarray(got), want_bits)
