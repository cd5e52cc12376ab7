"""jaxmlp.ragged_dot as a drop-in for jax.lax.ragged_dot, and fuzzing of both ops with hypothesis."""
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
def test_bad_shapes_name_the_argument(op):
  with pytest.raises(ValueError, match=r"lhs: got shape \(4,\), expected \[m, k\]"):
    op(jnp.ones((4,)), jnp.ones((1, 3, 3)), jnp.asarray([4], jnp.int32))
  with pytest.raises(ValueError, match=r"rhs: got shape \(1, 3, 3\), expected \[g, 2, n\]"):
    op(jnp.ones((4, 2)), jnp.ones((1, 3, 3)), jnp.asarray([4], jnp.int32))
  with pytest.raises(ValueError, match=r"rhs: got shape \(0, 2, 3\), expected \[g, 2, n\] with g >= 1"):
    op(jnp.ones((4, 2)), jnp.ones((0, 2, 3)), jnp.zeros((0,), jnp.int32))
  with pytest.raises(ValueError, match=r"group_sizes: got shape \(2,\), expected \[1\]"):
    op(jnp.ones((4, 2)), jnp.ones((1, 2, 3)), jnp.asarray([4, 0], jnp.int32))
  with pytest.raises(TypeError, match=r"lhs, rhs: dtype int32 is not supported"):
    op(jnp.ones((4, 2), jnp.int32), jnp.ones((1, 2, 3), jnp.int32), jnp.asarray([4], jnp.int32))


@pytest.mark.parametrize("lhs, rhs, match", [
    ((2**31, 2), (1, 2, 3), r"lhs: got shape \(2147483648, 2\), m = 2147483648 must be below 2\^31"),
    ((4, 2**31), (1, 2**31, 3), r"lhs: got shape \(4, 2147483648\), k = 2147483648 must be below 2\^31"),
    ((4, 2), (1, 2, 2**31), r"rhs: got shape \(1, 2, 2147483648\), n = 2147483648 must be below 2\^31"),
    ((4, 2), (2**30, 2, 3), r"rhs: got shape \(1073741824, 2, 3\), 1073741824 groups; at most 2\^30 - 1"),
])
def test_extents_the_kernels_cannot_index_fail_at_trace_time(lhs, rhs, match):
  """Abstract operands (nothing that large is allocated): the error comes when the call is traced."""
  args = (jax.ShapeDtypeStruct(lhs, jnp.bfloat16), jax.ShapeDtypeStruct(rhs, jnp.bfloat16),
          jax.ShapeDtypeStruct(rhs[:1], jnp.int32))
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(jaxmlp.ragged_dot, *args)


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
