"""jaxmlp.ragged_dot as a drop-in for jax.lax.ragged_dot, and fuzzing of both ops with hypothesis."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (GROUP_SIZE, TOLERANCE, check_close, check_padding_rows_zero, float32_backends, rel_error,
                      skip_unless_served)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxmlp
import numpy_reference as ref

# The kinds of cases jax's own ragged_dot tests use: (m, k, n, group_sizes), including sum < m and
# sizes that are not multiples of anything.
CASES = [
    (64, 32, 16, [16, 16, 16, 16]),
    (45, 7, 11, [10, 0, 20, 15]),
    (40, 8, 24, [5, 10]),  # sum(group_sizes) < m
    (8, 128, 64, [8]),
    (128, 64, 32, [0, 0, 128, 0]),
    (33, 16, 16, [3, 1, 4, 1, 5, 9, 2, 6]),
    (0, 8, 16, [3, 0]),  # empty dimensions
    (16, 0, 8, [8, 8]),
    (16, 8, 0, [8, 8]),
]


@pytest.mark.matrix
@pytest.mark.parametrize("m, k, n, sizes", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_matches_lax_ragged_dot_and_its_gradients(backend, rng, m, k, n, sizes, dtype):
  skip_unless_served(backend, dtype, k, n, empty=0 in (m, k, n))
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)), dtype)
  gs = jnp.asarray(sizes, jnp.int32)
  dout = jnp.asarray(rng.standard_normal((m, n)), dtype)
  out, vjp = jax.vjp(lambda a, b: jaxmlp.ragged_dot(a, b, gs), lhs, rhs)
  dl, dr = vjp(dout)
  with jax.default_device(jax.devices("cpu")[0]):
    want, want_vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs), *(np.asarray(v, np.float32) for v in (lhs, rhs)))
    want_dl, want_dr = want_vjp(np.asarray(dout, np.float32))
  tol = TOLERANCE[jnp.dtype(dtype).name]
  assert out.shape == (m, n) and out.dtype == dtype
  assert rel_error(out, want) < tol
  check_close(out, ref.ragged_dot(lhs, rhs, sizes), tol, "out")
  check_close(dl, want_dl, tol, "dlhs")
  check_close(dr, want_dr, tol, "drhs")
  assert dl.dtype == dr.dtype == dtype
  check_padding_rows_zero(m, sizes, out)


def test_preferred_element_type(backend, rng):
  lhs = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((2, 16, 8)), jnp.bfloat16)
  gs = jnp.asarray([12, 20], jnp.int32)
  out = jaxmlp.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
  assert out.dtype == jnp.float32
  assert rel_error(out, ref.ragged_dot(lhs, rhs, [12, 20])) < 1e-5  # float32 output: no bf16 rounding


@pytest.mark.parametrize("dtype, out_dtype", [(jnp.float32, jnp.bfloat16), (jnp.float32, jnp.float16),
                                              (jnp.float16, jnp.bfloat16), (jnp.bfloat16, jnp.float16),
                                              (jnp.float16, jnp.float32)])
def test_an_output_dtype_other_than_the_inputs_is_rounded_once(backend, rng, dtype, out_dtype):
  """preferred_element_type other than the inputs' dtype: the products are computed in float32 and
  rounded once, so each element is within out_dtype's rounding error (2^-8 relative for bfloat16, 2^-11
  for float16) of the exact product of the inputs; rounding an input to a narrower dtype first would be
  off by far more where the sum cancels."""
  skip_unless_served(backend, dtype, 32, 16)
  lhs = jnp.asarray(rng.standard_normal((64, 32)), dtype)
  rhs = jnp.asarray(rng.standard_normal((3, 32, 16)), dtype)
  sizes = [20, 0, 40]
  out = jaxmlp.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32), preferred_element_type=out_dtype)
  assert out.dtype == out_dtype
  want = ref.ragged_dot(np.asarray(lhs, np.float64), np.asarray(rhs, np.float64), sizes)
  err = np.abs(np.asarray(out, np.float64) - want)
  # Plus float32's accumulation error, ~1e-7 of the largest terms.
  assert (err <= 2.0 ** -(jnp.finfo(out_dtype).nmant + 1) * np.abs(want) + 1e-5 * np.abs(want).max()).all()
  assert not err[sum(sizes):].any()


def test_group_offset_is_not_implemented():
  with pytest.raises(NotImplementedError, match="group_offset"):
    jaxmlp.ragged_dot(jnp.ones((4, 2)), jnp.ones((1, 2, 3)), jnp.asarray([4], jnp.int32),
                      group_offset=jnp.asarray([0], jnp.int32))


@pytest.mark.parametrize("op", [jaxmlp.ragged_dot, jaxmlp.reference.ragged_dot], ids=["jaxmlp", "reference"])
def test_bad_shapes_raise_type_error_naming_the_argument(op):
  """TypeError, as jax.lax.ragged_dot raises for these."""
  with pytest.raises(TypeError, match=r"lhs: got shape \(4,\), expected \[m, k\]"):
    op(jnp.ones((4,)), jnp.ones((1, 3, 3)), jnp.asarray([4], jnp.int32))
  with pytest.raises(TypeError, match=r"rhs: got shape \(1, 3, 3\), expected \[g, 2, n\]"):
    op(jnp.ones((4, 2)), jnp.ones((1, 3, 3)), jnp.asarray([4], jnp.int32))
  with pytest.raises(TypeError, match=r"group_sizes: got shape \(2,\), expected \[1\]"):
    op(jnp.ones((4, 2)), jnp.ones((1, 2, 3)), jnp.asarray([4, 0], jnp.int32))
  with pytest.raises(TypeError, match=r"group_sizes: expected an integer array"):
    op(jnp.ones((4, 2)), jnp.ones((1, 2, 3)), jnp.asarray([4.0]))
  for lhs, rhs, sizes in (((4,), (1, 3, 3), [4]), ((4, 2), (1, 3, 3), [4]), ((4, 2), (1, 2, 3), [4, 0])):
    with pytest.raises(TypeError):  # jax.lax's own type for the same mistakes
      jax.lax.ragged_dot(jnp.ones(lhs), jnp.ones(rhs), jnp.asarray(sizes, jnp.int32))


# jax's own ragged_dot test cases (tests/lax_test.py testRaggedDot: (m, k, n, groups) in every floating dtype,
# float64 under jax_enable_x64) and the integer product jax.lax computes: the dtypes jaxmlp's grouped GEMM
# does not take run on jax.lax.ragged_dot itself, so the values and gradients are jax.lax's.
@pytest.mark.matrix
@pytest.mark.parametrize("m, k, n, num_groups", [(64, 4, 3, 1), (64, 9, 8, 2)])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_jax_ragged_dot_cases_in_every_floating_dtype(rng, m, k, n, num_groups, dtype):
  with jax.enable_x64(dtype == "float64"):
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((num_groups, k, n)), dtype)
    gs = jnp.asarray(np.diff(np.sort(np.r_[0, rng.integers(0, m + 1, num_groups - 1), m])), jnp.int32)
    got, got_vjp = jax.vjp(lambda a, b: jaxmlp.ragged_dot(a, b, gs), lhs, rhs)
    want, want_vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs), lhs, rhs)
    dout = jnp.asarray(rng.standard_normal((m, n)), dtype)
    assert got.dtype == want.dtype == jnp.dtype(dtype)
    tol = 1e-12 if dtype == "float64" else TOLERANCE[dtype]
    check_close(got, want, tol, "out")
    for g, w, name in zip(got_vjp(dout), want_vjp(dout), ("dlhs", "drhs")):
      assert g.dtype == w.dtype
      check_close(g, w, tol, name)


# tokamax's ragged_dot test cases (ops/ragged_dot/test_base.py: 8 groups of a 1024 x 128 x 256 product,
# uint32 group sizes, padding rows, zero groups, preferred_element_type, the VJP under a precision preset),
# against jax.lax.ragged_dot with float32 output at full precision, as tokamax checks them. Its quantized
# (qwix) operands and its own GroupSizes type are tokamax's, not jax.lax's.
@pytest.mark.parametrize("case", ["simple-bfloat16", "simple-float32", "padded", "zero-groups", "preferred-none",
                                  "preferred-bfloat16", "preferred-float32", "vjp"])
def test_tokamax_ragged_dot_cases(rng, case):
  dtype = jnp.float32 if case == "simple-float32" else jnp.bfloat16
  a = jnp.asarray(rng.standard_normal((1024, 128)), dtype)
  b = jnp.asarray(rng.standard_normal((8, 128, 256)), dtype)
  sizes = jnp.full((8,), 128, jnp.uint32)
  if case in ("padded", "zero-groups"):
    sizes = jnp.asarray(rng.integers(0, 128, 8), jnp.int32)
  f32 = dict(preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
  want = lambda a, b, sizes: jax.lax.ragged_dot(a.astype(jnp.float32), b.astype(jnp.float32), sizes, **f32)  # noqa
  patterns = [np.unpackbits(np.uint8(i)).astype(bool) for i in (0, 1, 37, 128, 170, 255)] if case == "zero-groups" \
      else [np.ones(8, bool)]
  for keep in patterns:
    gs = jnp.where(keep, sizes, 0)
    count = int(np.sum(gs))
    if case.startswith("preferred"):
      out_type = {"none": None, "bfloat16": jnp.bfloat16, "float32": jnp.float32}[case.split("-")[1]]
      got = jaxmlp.ragged_dot(a, b, gs, preferred_element_type=out_type)
      assert got.dtype == (out_type or jnp.bfloat16)
    elif case == "vjp":
      f = lambda a, b: jaxmlp.ragged_dot(a, b, gs, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32,  # noqa
                                         preferred_element_type=jnp.float32)
      got, vjp = jax.vjp(f, a, b)
      expected, want_vjp = jax.vjp(lambda a, b: want(a, b, gs), a.astype(jnp.float32), b.astype(jnp.float32))
      dout = jax.nn.standardize(expected).astype(jnp.bfloat16)
      for g, w, name in zip(vjp(dout.astype(jnp.float32)), want_vjp(dout.astype(jnp.float32)), ("da", "db")):
        check_close(g, w, TOLERANCE["bfloat16"], name)
    else:
      got = jaxmlp.ragged_dot(a, b, gs, **f32)
    check_close(got[:count], want(a, b, gs)[:count], TOLERANCE[jnp.dtype(got.dtype).name], case)
    assert not np.asarray(got[count:], np.float32).any()


def test_integer_product_as_jax_lax(rng):
  """int8 x int8 -> int32, exactly jax.lax.ragged_dot's."""
  lhs = jnp.asarray(rng.integers(-128, 128, (40, 16)), jnp.int8)
  rhs = jnp.asarray(rng.integers(-128, 128, (3, 16, 8)), jnp.int8)
  gs = jnp.asarray([10, 0, 25], jnp.int32)
  got = jaxmlp.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.int32)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.int32))
  assert not np.asarray(got[35:]).any()  # rows past the groups


@pytest.mark.parametrize("lhs, rhs", [((2**31, 2), (1, 2, 3)), ((4, 2**31), (1, 2**31, 3)), ((4, 2), (1, 2, 2**31)),
                                      ((4, 2), (2**30, 2, 3))])
def test_extents_past_the_kernels_run_on_jax_lax(lhs, rhs):
  """Abstract operands (nothing that large is allocated): sizes jaxmlp's kernels cannot index with int32
  are traced to jax.lax.ragged_dot, not to a custom call."""
  args = (jax.ShapeDtypeStruct(lhs, jnp.bfloat16), jax.ShapeDtypeStruct(rhs, jnp.bfloat16),
          jax.ShapeDtypeStruct(rhs[:1], jnp.int32))
  assert jax.eval_shape(jaxmlp.ragged_dot, *args).shape == (lhs[0], rhs[2])
  text = str(jax.make_jaxpr(jaxmlp.ragged_dot)(*args))
  assert "ragged_dot_general" in text and "ffi_call" not in text


@float32_backends
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 48), d=st.integers(1, 12), f=st.integers(1, 12),
       sizes=st.lists(GROUP_SIZE, min_size=1, max_size=5),
       act=st.sampled_from(jaxmlp.ACTIVATIONS), seed=st.integers(0, 2**31))
def test_fuzz_grouped_mlp(backend, m, d, f, sizes, act, seed):
  rng = np.random.default_rng(seed)
  gated = act in ref.GATED
  x = rng.standard_normal((m, d)).astype(np.float32)
  w1 = rng.standard_normal((len(sizes), d, 2 * f if gated else f)).astype(np.float32)
  w2 = rng.standard_normal((len(sizes), f, d)).astype(np.float32)
  gs = np.asarray(sizes, np.int32)
  dy = rng.standard_normal((m, d)).astype(np.float32)
  y, vjp = jax.vjp(lambda x, w1, w2: jaxmlp.grouped_mlp(x, w1, w2, jnp.asarray(gs), activation=act), x, w1, w2)
  dx, dw1, dw2 = vjp(jnp.asarray(dy))
  want_y, want = ref.grouped_mlp(x, w1, w2, gs, act, dy=dy)
  assert rel_error(y, want_y) < 1e-4
  for got, k in ((dx, "x"), (dw1, "w1"), (dw2, "w2")):
    assert rel_error(got, want[k]) < 1e-4, k
  check_padding_rows_zero(m, gs, y, dx)


@float32_backends
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 40), k=st.integers(1, 10), n=st.integers(1, 10),
       sizes=st.lists(GROUP_SIZE, min_size=1, max_size=5),
       seed=st.integers(0, 2**31))
def test_fuzz_ragged_dot(backend, m, k, n, sizes, seed):
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((m, k)).astype(np.float32)
  rhs = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
  gs = np.asarray(sizes, np.int32)
  out, vjp = jax.vjp(lambda a, b: jaxmlp.ragged_dot(a, b, jnp.asarray(gs)), lhs, rhs)
  dout = rng.standard_normal((m, n)).astype(np.float32)
  dl, dr = vjp(jnp.asarray(dout))
  assert rel_error(out, ref.ragged_dot(lhs, rhs, gs)) < 1e-4
  want_dl = ref.ragged_dot(dout, rhs.transpose(0, 2, 1), gs)
  assert rel_error(dl, want_dl) < 1e-4 if np.any(want_dl) else not np.asarray(dl).any()
  want_dr = ref.ragged_dot_rhs_grad(lhs, dout, gs)
  assert rel_error(dr, want_dr) < 1e-4 if np.any(want_dr) else not np.asarray(dr).any()
  check_padding_rows_zero(m, gs, dl)


# The float32 fuzz tests above run on the fallback only (the grouped and tiled paths are 16-bit): this
# one reaches every path, with row lengths in multiples of 8, sizes from the whole int32 range, and up
# to 300 groups (the device code scans group_sizes in chunks of 32 and 256). At f = 520 the tiled
# kernel splits the FC1 dgrad's 17 k-steps over two blocks, of 9 and 8.
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 300), d=st.sampled_from([8, 16, 72]), f=st.sampled_from([8, 24, 136, 520]),
       sizes=st.one_of(st.lists(GROUP_SIZE, min_size=1, max_size=6),
                       st.lists(st.integers(-1, 3), min_size=129, max_size=300)),
       seed=st.integers(0, 2**31))
def test_fuzz_bfloat16(backend, m, d, f, sizes, seed):
  rng = np.random.default_rng(seed)
  E = len(sizes)
  bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
  x, w1, w2, dy, dout = bf16(m, d), bf16(E, d, 2 * f), bf16(E, f, d), bf16(m, d), bf16(m, 2 * f)
  gs = jnp.asarray(sizes, jnp.int32)
  y, vjp = jax.vjp(lambda x, w1, w2: jaxmlp.grouped_mlp(x, w1, w2, gs), x, w1, w2)
  got = vjp(dy)
  dot, dot_vjp = jax.vjp(lambda a, b: jaxmlp.ragged_dot(a, b, gs), x, w1)
  dlhs, drhs = dot_vjp(dout)
  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  want_y, want = ref.grouped_mlp(f64(x), f64(w1), f64(w2), sizes, "swiglu", dy=f64(dy))
  total = ref.clamp_sizes(sizes, m)[-1]
  if total == 0:  # no rows: everything is exactly zero
    assert not any(f64(a).any() for a in (y, *got, dot, dlhs, drhs))
    return
  for a, w, name in ((y, want_y, "y"), *zip(got, (want["x"], want["w1"], want["w2"]), ("dx", "dw1", "dw2")),
                     (dot, ref.ragged_dot(f64(x), f64(w1), sizes), "dot"),
                     (dlhs, ref.ragged_dot(f64(dout), f64(w1).transpose(0, 2, 1), sizes), "dlhs"),
                     (drhs, ref.ragged_dot_rhs_grad(f64(x), f64(dout), sizes), "drhs")):
    check_close(a, w, TOLERANCE["bfloat16"], name)
  check_padding_rows_zero(m, sizes, y, got[0], dot, dlhs)


def test_the_implicit_fallback_is_warned_of_once(monkeypatch):
  """A call the sync-free GEMM paths cannot serve (float32, or rows not a multiple of 8) takes the fallback,
  which syncs with the host on every call: traced for a CUDA device (a stand-in on a CPU machine), it warns,
  once per reason; asked for by JAXMLP_GEMM_PATH=fallback, it does not."""
  from jaxmlp import _gemm_path, _library

  class Cuda:  # what a CUDA branch asks the extension at trace time
    @staticmethod
    def gemm_workspace_bytes(path, E):
      return 256

  monkeypatch.setattr(_library, "cuda_devices", lambda: ("cuda:0",))
  monkeypatch.setattr(_library, "_cuda", Cuda)
  monkeypatch.setattr(_gemm_path, "cuda_status", lambda: {"grouped_available": True, "tiled_available": True})
  _gemm_path._warn_once.cache_clear()
  gs = jnp.asarray([3, 5], jnp.int32)
  f32 = (jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((2, 16, 8), jnp.float32))
  unaligned = (jax.ShapeDtypeStruct((8, 12), jnp.bfloat16), jax.ShapeDtypeStruct((2, 12, 8), jnp.bfloat16))
  aligned = (jax.ShapeDtypeStruct((8, 16), jnp.bfloat16), jax.ShapeDtypeStruct((2, 16, 8), jnp.bfloat16))
  trace = lambda lhs, rhs: jax.make_jaxpr(lambda a, b: jaxmlp.ragged_dot(a, b, gs))(lhs, rhs)  # noqa: E731
  with pytest.warns(RuntimeWarning, match="float32 inputs: the call runs on the fallback GEMM path"):
    trace(*f32)
  with pytest.warns(RuntimeWarning, match=r"row lengths \(12, 8\) not all multiples of 8"):
    trace(*unaligned)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    trace(*f32)  # once per reason
    trace(*aligned)  # the grouped path: nothing to say
    _gemm_path._warn_once.cache_clear()
    monkeypatch.setenv("JAXMLP_GEMM_PATH", "fallback")
    trace(*f32)
  _gemm_path._warn_once.cache_clear()
