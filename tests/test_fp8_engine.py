"""The tensorwise FP8 recipe's row products (FC1, FC2, the data gradients) on the CUTLASS engine's FP8 kernels
(JAXMLP_GEMM_PATH=cutlass; ffi/cuda/gemm/cutlass_fp8_nt*.cu) against the CPU emulation, on a GPU that runs
both the FP8 path and the engine."""
import jax
import jax.numpy as jnp
import pytest
from conftest import check_close, check_padding_rows_zero, engine_launches, launched
from fp8_cases import BLOCK_CASES, CUDA_TOLERANCE, fp8_reason, inputs, run

import jaxmlp
from jaxmlp import _library

# The engine's FP8 kernels: without and with the 2x1 cluster (experts of more than 4M weights, more than one
# 128-row tile a group: FC1 and dx here), k-tiles cut short (d = 272) and groups across tile edges.
ENGINE_CASES = {**BLOCK_CASES, "clustered": (1024, 2048, 1536, [700, 0, 300, 3])}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(ENGINE_CASES))
@pytest.mark.parametrize("fast, fp8_wgrad", [("none", True), ("forward", True), ("both", True), ("none", False)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("biases", [False, True])
def test_cuda_fp8_on_the_engine_equals_the_cpu_emulation(rng, monkeypatch, case, fast, fp8_wgrad, dtype, biases):
  """JAXMLP_GEMM_PATH=cutlass runs the tensorwise recipe's row products (FC1, FC2, the data gradients) on the
  CUTLASS engine's FP8 kernels (the launch counts show it; the weight gradients, FP8 or 16-bit, on cuBLASLt),
  with the same semantics: the CPU emulation's results within CUDA_TOLERANCE, and y and dx's padding rows zero
  where the poisoned outputs held NaN."""
  status = _library.cuda_status()
  reason = fp8_reason() or (None if status.get("cutlass_available") else status.get("cutlass_reason"))
  if reason:
    pytest.skip(reason)
  M, d, f, sizes = ENGINE_CASES[case]
  args, gs, dy = inputs(rng, M, d, f, sizes, "swiglu", getattr(jnp, dtype), b1=biases, b2=biases)
  recipe = jaxmlp.Fp8Recipe("tensorwise", fast_accumulation=fast != "none",
                            backward_fast_accumulation=fast == "both", fp8_weight_gradients=fp8_wgrad)
  results = {}
  for platform in ("cpu", "cuda"):
    device = jax.devices(platform)[0]
    with jax.default_device(device):
      if platform == "cuda":
        monkeypatch.setenv("JAXMLP_GEMM_PATH", "cutlass")
        since = engine_launches()
      y, grads = run(jaxmlp.grouped_mlp, jax.device_put(args, device), jax.device_put(gs, device),
                     jax.device_put(dy, device), "swiglu", fp8=recipe, zero_padding=True)
      results[platform] = {"y": y, **grads}
  if sum(sizes):
    assert launched(since)["fp8_nt"] == 4, launched(since)  # FC1, FC2, da, dx
  for k in results["cpu"]:
    check_close(results["cuda"][k], results["cpu"][k], CUDA_TOLERANCE, k)
  check_padding_rows_zero(M, sizes, results["cuda"]["y"], results["cuda"]["x"])
