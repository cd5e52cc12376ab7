"""The activation in the CUTLASS engine's epilogues (f a multiple of 64): FC1's (b1 added to h, the
activation, gated or not) and FC2's data gradient's (the activation's backward: dh, a_s and the scales'
gradient in partial sums; d at least 4096, ungated 7168), the same values as the activation passes they
replace, on every backend; the engine's launch counts show that the epilogues ran.

On cuda-fused FC1 takes its epilogue, and the same call on the grouped path (cuBLASLt's FC1, whose sums over
d = 64 the engine's equal, then the separate activation pass; the other products are cuBLASLt's on both
paths) gives the same bits: h = x @ w1 rounded, then + b1 rounded again, either way. Every backend matches
the float64 reference, the scales' and biases' gradients included. On cuda-cutlass (d = 4096, ungated 7168)
the step also takes FC2's data-gradient epilogue; the second test checks it against the separate backward
pass bit for bit (the engine takes the epilogue by d). The shapes put groups across tile edges
(128 rows), an empty group first and last, a group of fewer rows than a tile, padding rows holding NaN, and
f = 64 (one tile of gate and up columns in FC1; one half tile in the data gradient and an ungated FC1), 192
(three in FC1, the up columns starting at an odd tile; the data gradient's and an ungated FC1's last tile half
full) or 256 (whole tiles).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (TOLERANCE, check_close, check_padding_rows_zero, engine_launches, launched,
                      skip_unless_served)

import jaxmlp
import numpy_reference as ref

SIZES = [0, 130, 7, 200, 0]  # 337 rows in groups, of M = 400
GATED = ["swiglu", "geglu", "reglu", "clamped_swiglu"]
UNGATED = ["gelu", "relu", "silu", "squared_relu"]


@pytest.mark.parametrize("f", [64, 192, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("act", GATED + UNGATED)
@pytest.mark.parametrize("scales, b1, b2, zero_padding", [(True, True, True, True), (False, False, False, False),
                                                          (True, False, False, False), (False, True, False, False)])
def test_fused_activation_equals_the_activation_pass(backend, rng, monkeypatch, f, dtype, act, scales, b1, b2,
                                                     zero_padding):
  skip_unless_served(backend, dtype)
  # d where FC2's data gradient takes the epilogue; elsewhere the same semantics at a smaller d.
  M, d, E = 400, (4096 if act in GATED else 7168) if backend == "cuda-cutlass" else 64, len(SIZES)
  total = sum(SIZES)
  cast = lambda a: jnp.asarray(a, dtype)
  F1 = 2 * f if act in GATED else f
  x = cast(rng.standard_normal((M, d))).at[total:].set(jnp.nan)
  w1 = cast(rng.standard_normal((E, d, F1)) / np.sqrt(d))
  w2 = cast(rng.standard_normal((E, f, d)) / np.sqrt(f))
  kw = dict(scales=cast(rng.uniform(0.1, 1.0, M)) if scales else None,
            b1=cast(rng.standard_normal((E, F1)) * 0.5) if b1 else None,
            b2=cast(rng.standard_normal((E, d)) * 0.5) if b2 else None)
  dy = cast(rng.standard_normal((M, d))).at[total:].set(jnp.nan)
  sizes = jnp.asarray(SIZES, jnp.int32)
  activation = jaxmlp.Activation(act, alpha=1.702, limit=7.0)
  names = ["y", "dx", "dw1", "dw2", "dscales", "db1", "db2"]

  def run():
    def f_(x, w1, w2, scales, b1, b2):
      return jaxmlp.grouped_mlp(x, w1, w2, sizes, activation=activation, zero_padding=zero_padding,
                                scales=scales, b1=b1, b2=b2)
    y, vjp = jax.vjp(f_, x, w1, w2, kw["scales"], kw["b1"], kw["b2"])
    return (y, *vjp(dy))

  since = engine_launches() if backend in ("cuda-cutlass", "cuda-fused") else None
  fused = run()
  if since is not None:  # the epilogues ran (equal values could not tell): FC1's, and FC2's data gradient's
    ran = launched(since)
    kind = "gated" if act in GATED else "ungated"
    assert ran[f"{kind}_fc1"] > 0, ran
    want = {"gated_dgrad": False, "ungated_dgrad": False, f"{kind}_dgrad": backend == "cuda-cutlass"}
    assert {k: ran[k] > 0 for k in want} == want, ran
  if backend == "cuda-fused":
    monkeypatch.setenv("JAXMLP_GEMM_PATH", "grouped")
    separate = run()
    for name, got, want in zip(names, fused, separate):
      if got is not None:
        rows = slice(0, total) if name in ("y", "dx", "dscales") else slice(None)
        np.testing.assert_array_equal(np.asarray(got[rows], np.float32), np.asarray(want[rows], np.float32), name)

  n = {k: None if v is None else np.asarray(v, np.float64) for k, v in kw.items()}
  xr, dyr = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  xr[total:], dyr[total:] = 0, 0
  want_y, want = ref.grouped_mlp(xr, np.asarray(w1, np.float64), np.asarray(w2, np.float64), np.asarray(SIZES),
                                 act, n["b1"], n["b2"], n["scales"], dy=dyr, alpha=1.702, limit=7.0)
  tol = TOLERANCE[jnp.dtype(dtype).name]
  check_close(fused[0][:total], want_y[:total], tol, "y")
  if act not in ("reglu", "relu"):  # their derivative jumps at 0, where 16-bit rounding of h moves elements across
    for name, got in zip(["x", "w1", "w2", "scales", "b1", "b2"], fused[1:]):
      if got is not None:
        rows = slice(0, total) if name in ("x", "scales") else slice(None)
        check_close(got[rows], want[name][rows], tol, name)
  if zero_padding:
    check_padding_rows_zero(M, SIZES, *(a for a in fused[:2] + fused[4:5] if a is not None))


@pytest.mark.parametrize("f", [64, 192, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("act", GATED + UNGATED)
def test_fused_backward_equals_the_activation_pass(backend, rng, f, dtype, act):
  """The engine takes FC2's data-gradient epilogue from d = 4096 (ungated: 7168) and the product and the
  separate pass below. The same problem at d = 64 and zero-padded to D (x's and dy's columns, w1's rows and
  w2's and b2's columns past 64 zero: every product adds the same terms, then zeros) gives the same h and
  da, and so the same dh: dx's first 64 columns, which the engine computes from dh alone, bit for bit. a_s
  reaches dw2 and the scales' gradient, whose sums are added in another order: within the tolerance."""
  if backend != "cuda-cutlass":
    pytest.skip("the engine's choice by d (cutlass_grouped.cu)")
  M, d, E, D = 400, 64, len(SIZES), 4096 if act in GATED else 7168
  total = sum(SIZES)
  cast = lambda a: jnp.asarray(a, dtype)
  pad = lambda a, axis: jnp.pad(a, [(0, D - d) if i == axis else (0, 0) for i in range(a.ndim)])
  x = cast(rng.standard_normal((M, d))).at[total:].set(jnp.nan)
  w1 = cast(rng.standard_normal((E, d, 2 * f if act in GATED else f)) / np.sqrt(d))
  w2 = cast(rng.standard_normal((E, f, d)) / np.sqrt(f))
  b2 = cast(rng.standard_normal((E, d)) * 0.5)
  scales = cast(rng.uniform(0.1, 1.0, M))
  dy = cast(rng.standard_normal((M, d))).at[total:].set(jnp.nan)
  sizes = jnp.asarray(SIZES, jnp.int32)
  activation = jaxmlp.Activation(act, alpha=1.702, limit=7.0)

  def grads(x, w1, w2, b2, dy):
    mlp = lambda x, w1, w2, s: jaxmlp.grouped_mlp(x, w1, w2, sizes, activation=activation, scales=s, b2=b2)
    return jax.vjp(mlp, x, w1, w2, scales)[1](dy)

  kernel = "gated_dgrad" if act in GATED else "ungated_dgrad"
  since = engine_launches()
  separate = grads(x, w1, w2, b2, dy)
  assert launched(since)[kernel] == 0
  fused = grads(pad(x, 1), pad(w1, 1), pad(w2, 2), pad(b2, 1), pad(dy, 1))
  assert launched(since)[kernel] > 0
  np.testing.assert_array_equal(np.asarray(fused[0][:total, :d], np.float32),
                                np.asarray(separate[0][:total], np.float32), "dx")
  tol = TOLERANCE[jnp.dtype(dtype).name]
  check_close(fused[2][:, :, :d], separate[2], tol, "dw2")
  check_close(fused[3][:total], separate[3][:total], tol, "dscales")
