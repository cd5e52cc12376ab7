"""jaxmlp.dispatch (dispatch, row_weights, combine) against a float64 NumPy reference written here as plain
loops, and against jaxmlp.reference_moe (the argsort path) on every backend; outputs are poisoned."""
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BACKENDS, TOLERANCE, check_close, cuda_reason

from jaxmlp import _library
from jaxmlp import dispatch as D
from jaxmlp import reference_moe

# Dispatch and combine have one CUDA handler each (no GEMM path): cpu and cuda-fallback cover them.
backends = pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] in ("cpu", "cuda-fallback")],
                                   indirect=True)

# (T, k, E, capacity, pad_to): drops, k > 1, one token, one expert, padding multiples (those marked full
# only with --full: the others cover drops, padding, one token and one expert too).
CASES = [
    pytest.param(37, 2, 5, None, 1, marks=pytest.mark.full),
    (37, 3, 4, 6, 1),
    pytest.param(50, 8, 16, None, 16, marks=pytest.mark.full),
    (64, 2, 8, 10, 128),
    pytest.param(300, 4, 3, 250, 1, marks=pytest.mark.full),  # long runs of one expert, drops in every choice round
    (1, 1, 1, None, 1),
    pytest.param(1, 2, 1, None, 4, marks=pytest.mark.full),
    pytest.param(20, 2, 1, 5, 1, marks=pytest.mark.full),
    (9, 2, 3, 0, 1),  # capacity 0: every choice dropped
]


def numpy_dispatch(x, experts, E, capacity, pad_to):
  """The semantics as loops: choices served choice-major then in token order; ids outside [0, E) dropped."""
  T, k = experts.shape
  cap = math.inf if capacity is None else capacity
  counts, kept = np.zeros(E, np.int64), [[] for _ in range(E)]
  for j in range(k):
    for t in range(T):
      e = int(experts[t, j])
      if 0 <= e < E:
        counts[e] += 1
        if len(kept[e]) < cap:
          kept[e].append(t * k + j)
  sizes = np.array([-(-len(s) // pad_to) * pad_to for s in kept], np.int64)
  offsets = np.concatenate([[0], np.cumsum(sizes)])
  R = min(T * k, E * cap) + E * (pad_to - 1)  # every kept choice could be kept, with each group's padding
  rows, row_of_slot, slot_of_row = np.zeros((R, x.shape[1])), -np.ones(T * k, np.int64), -np.ones(R, np.int64)
  for e in range(E):
    for i, s in enumerate(kept[e]):
      r = offsets[e] + i
      rows[r], row_of_slot[s], slot_of_row[r] = x[s // k], r, s
  return rows, sizes, row_of_slot.reshape(T, k), slot_of_row, counts


def numpy_combine(rows, row_of_slot, weights):
  T, k = row_of_slot.shape
  y = np.zeros((T, rows.shape[1]))
  for t in range(T):
    for j in range(k):
      if row_of_slot[t, j] >= 0:
        y[t] += (1.0 if weights is None else weights[t, j]) * rows[row_of_slot[t, j]]
  return y


def random_case(rng, T, k, E, d, dtype, invalid=True):
  x = rng.standard_normal((T, d)).astype(np.float32)
  lo, hi = (-3, E + 3) if invalid else (0, E)  # ids out of range: negative and >= E
  experts = rng.integers(lo, hi, (T, k)).astype(np.int32)
  weights = rng.random((T, k)).astype(np.float32)
  return jnp.asarray(x, dtype), experts, weights


@backends
@pytest.mark.parametrize("T,k,E,capacity,pad_to", CASES)
def test_dispatch_matches_numpy(backend, rng, T, k, E, capacity, pad_to):
  x, experts, _ = random_case(rng, T, k, E, 21, jnp.bfloat16)  # odd rows: the CUDA gather's 2-byte copies
  rows, group_sizes, plan = jax.jit(D.dispatch, static_argnums=2, static_argnames=("capacity", "pad_to"))(
      x, experts, E, capacity=capacity, pad_to=pad_to)
  want = numpy_dispatch(np.asarray(x, np.float64), experts, E, capacity, pad_to)
  got = (rows, group_sizes, plan.row_of_slot, plan.slot_of_row, plan.counts)
  for name, g, w in zip(("rows", "group_sizes", "row_of_slot", "slot_of_row", "counts"), got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float64), w, err_msg=name)  # a gather is exact
  for g, w in zip(jax.tree.leaves((rows, group_sizes, plan)),
                  jax.tree.leaves(reference_moe.dispatch(x, experts, E, capacity=capacity, pad_to=pad_to))):
    np.testing.assert_array_equal(g, w)


@backends
def test_dispatch_drops_every_out_of_range_id(backend, rng):
  """Ids far outside [0, E), in a wider integer dtype, must neither wrap into range nor index out of bounds."""
  x, _, _ = random_case(rng, 16, 2, 4, 8, jnp.float32)
  experts = np.array([[2**15 - 1, -(2**15)], [4, -1]] * 8, np.int16)
  experts[3] = [1, 3]
  rows, group_sizes, plan = D.dispatch(x, jnp.asarray(experts), 4)
  np.testing.assert_array_equal(plan.counts, [0, 1, 0, 1])
  np.testing.assert_array_equal(group_sizes, [0, 1, 0, 1])
  assert (np.asarray(plan.row_of_slot) >= 0).sum() == 2 and not np.asarray(rows)[2:].any()


@pytest.mark.matrix
@backends
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("T,k,E,capacity,pad_to", CASES[:5] + CASES[6:])
def test_combine_and_gradients_match_numpy(backend, rng, dtype, weighted, T, k, E, capacity, pad_to):
  """combine(rows * c, plan, weights) for per-row factors c, and its gradients in x and the weights
  through dispatch (jax.vjp), against the float64 loops; also the same through row_weights."""
  d = 42 if dtype == "float32" else 24  # CUDA: 8-byte gathers, 1-wide combine; 16-byte gathers, 8-wide combine
  x, experts, weights = random_case(rng, T, k, E, d, dtype)
  R = reference_moe.num_rows(T, k, E, capacity, pad_to)
  c = rng.standard_normal((R, 1)).astype(np.float32)
  dy = rng.standard_normal((T, d)).astype(np.float32)

  def layer(x, w):
    rows, _, plan = D.dispatch(x, experts, E, capacity=capacity, pad_to=pad_to)
    return D.combine(rows * jnp.asarray(c, rows.dtype), plan, w if weighted else None)

  y, vjp = jax.vjp(jax.jit(layer), x, jnp.asarray(weights))
  dx, dw = vjp(jnp.asarray(dy, y.dtype))
  assert y.dtype == x.dtype and dx.dtype == x.dtype

  x64 = np.asarray(x, np.float64)
  _, _, row_of_slot, _, _ = numpy_dispatch(x64, experts, E, capacity, pad_to)
  w64 = weights.astype(np.float64) if weighted else np.ones((T, k))
  c64 = np.append(np.asarray(jnp.asarray(c, x.dtype), np.float64)[:, 0], 0)  # row -1 (dropped): factor 0
  kept = row_of_slot >= 0
  factor = w64 * c64[row_of_slot]  # token t's factor of its own row, per choice
  tol = TOLERANCE[dtype]
  check_close(y, x64 * factor.sum(1, keepdims=True), tol, "y")
  check_close(dx, dy * factor.sum(1, keepdims=True), tol, "dx")
  # dweights is a dot product over d that cancels, so its reference takes what the op is given: dy and
  # each row times its factor in x's dtype (bfloat16 rounding of those alone reached 3% on one token).
  dy_given = np.asarray(jnp.asarray(dy, x.dtype), np.float64)
  if weighted:
    scaled_rows = np.asarray(jnp.asarray(x64[:, None] * c64[row_of_slot][..., None], x.dtype), np.float64)
    want_dw = (scaled_rows * dy_given[:, None]).sum(-1)
    check_close(dw, want_dw, tol, "dweights")
    np.testing.assert_array_equal(np.asarray(dw)[~kept], 0)

  # The same contraction with the weights applied to the rows (grouped_mlp's scales) instead, the product
  # in float32 as grouped_mlp takes it: in bfloat16 JAX's gradient would sum over d in bfloat16 (4% off).
  def layer_scaled(x, w):
    rows, _, plan = D.dispatch(x, experts, E, capacity=capacity, pad_to=pad_to)
    scales = D.row_weights(w, plan)[:, None] if weighted else 1.0
    return D.combine((rows.astype(jnp.float32) * (c * scales)).astype(rows.dtype), plan)

  y2, vjp2 = jax.vjp(jax.jit(layer_scaled), x, jnp.asarray(weights))
  dx2, dw2 = vjp2(jnp.asarray(dy, y.dtype))
  check_close(y2, x64 * factor.sum(1, keepdims=True), tol, "y (row_weights)")
  if weighted:
    c32 = np.append(c[:, 0].astype(np.float64), 0)
    check_close(dw2, c32[row_of_slot] * (dy_given * x64).sum(1, keepdims=True), tol, "dweights (row_weights)")


@backends
@pytest.mark.parametrize("weighted", [False, True])
def test_unwritten_padding_changes_no_value_that_is_read(backend, rng, weighted):
  """zero_padding=False: the kept rows, the plan, combine's result and the gradients in x and the weights
  are those of zero_padding=True, bit for bit; on CUDA the rows past the last group are then left
  unwritten (poisoned: NaN) in the rows and in their gradient, and neither op reads them."""
  T, k, E, capacity, d = 37, 3, 8, 20, 24  # about 14 choices an expert: rows past each group
  x, experts, weights = random_case(rng, T, k, E, d, "bfloat16")
  dy = jnp.asarray(rng.standard_normal((T, d)), x.dtype)

  def layer(x, w, zero_padding):
    rows, sizes, plan = D.dispatch(x, experts, E, capacity=capacity, zero_padding=zero_padding)
    y = D.combine(rows * jnp.asarray(2, rows.dtype), plan, w if weighted else None, zero_padding=zero_padding)
    return y, (rows, sizes, plan)

  runs = {}
  for zero_padding in (True, False):
    y, vjp, (rows, sizes, plan) = jax.vjp(jax.jit(lambda x, w: layer(x, w, zero_padding)), x,
                                          jnp.asarray(weights), has_aux=True)
    runs[zero_padding] = (y, rows[:int(sizes.sum())], sizes, *plan, *vjp(dy))
  for want, got in zip(runs[True], runs[False]):
    np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))
  assert int(runs[True][2].sum()) < reference_moe.num_rows(T, k, E, capacity)  # the case has such rows


@backends
@pytest.mark.parametrize("weighted", [pytest.param(False, marks=pytest.mark.full), True])
def test_combine_matches_the_argsort_reference(backend, rng, weighted):
  """Results and gradients equal jaxmlp.reference_moe's (argsort, gather, scatter-add) through jax.vjp."""
  T, k, E, d = 45, 3, 6, 32
  x, experts, weights = random_case(rng, T, k, E, d, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((T, d)), jnp.float32)

  def layer(ops, x, w):
    rows, group_sizes, plan = ops.dispatch(x, experts, E, capacity=20, pad_to=8)
    return ops.combine(jnp.tanh(rows), plan, w if weighted else None)

  results = []
  for ops in (D, reference_moe):
    y, vjp = jax.vjp(lambda x, w: layer(ops, x, w), x, jnp.asarray(weights))
    results.append((y, *vjp(dy)))
  for name, got, want in zip(("y", "dx", "dweights"), *results):
    check_close(got, want, 1e-5, name)


@backends
def test_combine_numpy_plan_and_poisoned_outputs(backend, rng):
  """combine on a plan made here, with rows nothing points to and an index out of range in each map:
  those are treated as none (no out-of-bounds access), and every output element is written."""
  T, k, R, d = 5, 2, 12, 16
  rows = jnp.asarray(rng.standard_normal((R, d)), jnp.float32)
  row_of_slot = np.array([[0, 3], [-1, 7], [2, -1], [11, 40], [-5, 1]], np.int32)
  slot_of_row = -np.ones(R, np.int32)
  for s, r in enumerate(row_of_slot.reshape(-1)):
    if 0 <= r < R:
      slot_of_row[r] = s
  slot_of_row[5] = 999  # out of range: a padding row
  plan = D.Plan(jnp.asarray(row_of_slot), jnp.asarray(slot_of_row), jnp.zeros((3,), jnp.int32))
  weights = rng.random((T, k)).astype(np.float32)
  clean = np.where((row_of_slot >= 0) & (row_of_slot < R), row_of_slot, -1)
  want = numpy_combine(np.asarray(rows, np.float64), clean, weights)
  y, vjp = jax.vjp(lambda r, w: D.combine(r, plan, w), rows, jnp.asarray(weights))
  check_close(y, want, 1e-5, "y")
  drows, dw = vjp(jnp.ones_like(y))
  assert np.isfinite(drows).all() and np.isfinite(dw).all()
  assert not np.asarray(drows)[[4, 5, 6, 8, 9, 10]].any() and np.asarray(dw)[3, 1] == 0


@backends
@pytest.mark.parametrize("weighted", [False, True])
def test_combine_backward_on_a_plan_whose_maps_disagree(backend, rng, weighted):
  """A plan that dispatch would not make: a row that two choices point to, and rows whose slot_of_row names
  a choice that points elsewhere. The backward is still the documented one on every backend: drows[r] by
  slot_of_row (CUDA writes most rows from their token's side, the rest by slot_of_row), dweights[s] by
  row_of_slot, every element written."""
  T, k, R, d = 4, 2, 6, 16
  rows = jnp.asarray(rng.standard_normal((R, d)), jnp.float32)
  row_of_slot = np.array([[0, 1], [1, 2], [3, -1], [5, 4]], np.int32)  # slots 1 and 2 both point to row 1
  slot_of_row = np.array([0, 1, 3, 0, 7, 6], np.int32)  # row 3 names slot 0, which points to row 0
  plan = D.Plan(jnp.asarray(row_of_slot), jnp.asarray(slot_of_row), jnp.zeros((3,), jnp.int32))
  weights = rng.random((T, k)).astype(np.float32) if weighted else None
  dy = rng.standard_normal((T, d)).astype(np.float32)
  args = (rows,) if weights is None else (rows, jnp.asarray(weights))
  _, vjp = jax.vjp(lambda *a: D.combine(a[0], plan, *a[1:]), *args)
  grads = vjp(jnp.asarray(dy))
  w = np.ones(T * k) if weights is None else weights.reshape(-1).astype(np.float64)
  want_drows = np.stack([w[s] * dy[s // k] for s in slot_of_row])
  check_close(grads[0], want_drows, 1e-6, "drows")
  if weighted:
    r64, flat = np.asarray(rows, np.float64), row_of_slot.reshape(-1)
    want_dw = [dy[s // k] @ r64[flat[s]] if flat[s] >= 0 else 0.0 for s in range(T * k)]
    check_close(grads[1], np.reshape(want_dw, (T, k)), 1e-5, "dweights")


def test_rejects_bad_arguments():
  x, experts = jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32)
  for call, message in (
      (lambda: D.dispatch(x[0], experts, 4), r"x: got shape \(8,\), expected \[T, d\]"),
      (lambda: D.dispatch(x, experts[:3], 4), r"experts: got shape \(3, 2\), expected \[T, k\] = \[4, k\]"),
      (lambda: D.dispatch(x, experts, 0), "num_experts: got 0"),
      (lambda: D.dispatch(x, experts, 4, capacity=-1), "capacity: got -1"),
      (lambda: D.dispatch(x, experts, 4, pad_to=0), "pad_to: got 0"),
  ):
    with pytest.raises(ValueError, match=message):
      call()
  with pytest.raises(TypeError, match="experts: got dtype float32, expected an integer dtype"):
    D.dispatch(x, experts.astype(jnp.float32), 4)
  rows, _, plan = D.dispatch(x, experts, 4)
  for call in (lambda: D.dispatch(x, experts, 4, zero_padding=1), lambda: D.combine(rows, plan, zero_padding=None)):
    with pytest.raises(TypeError, match="zero_padding: expected True or False, got (1|None)"):
      call()
  # Extents the kernels cannot index (int32), on abstract operands: nothing that large is allocated.
  abstract = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  for x_, experts_, options, message in (
      (abstract(2**31, 8), abstract(2**31, 1, dtype=jnp.int32), {}, r"x: got shape \(2147483648, 8\), T = 2147483648"),
      (abstract(4, 2**31), experts, {}, r"x: got shape \(4, 2147483648\), d = 2147483648 must be below 2\^31"),
      (abstract(2**30, 8), abstract(2**30, 2, dtype=jnp.int32), {}, r"experts: .*T \* k = 2147483648 must be"),
      (x, experts, dict(num_experts=2**20, pad_to=4096), r"num_experts, pad_to: the dispatched rows, R = 4293918728"),
  ):
    with pytest.raises(ValueError, match=message):
      jax.eval_shape(lambda x_, e_: D.dispatch(x_, e_, **{"num_experts": 4, **options}), x_, experts_)
  rows, _, plan = D.dispatch(x, experts, 4)
  with pytest.raises(ValueError, match=re.escape("rows: got shape (7, 8), expected [R, d] = [8, d]")):
    D.combine(rows[:7], plan)
  with pytest.raises(ValueError, match=re.escape("weights: got shape (4, 3), expected [T, k] = [4, 2]")):
    D.combine(rows, plan, jnp.zeros((4, 3)))


HUGE_CAPACITY_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import jaxmlp  # registers the targets
    T, k, E, d, R = 8, 2, 4, 4, 1
    x = jnp.ones((T, d), jnp.float32)
    experts = jnp.asarray(np.arange(T * k).reshape(T, k) % E, jnp.int32)
    outs = [jax.ShapeDtypeStruct(s, t) for s, t in (((R, d), x.dtype), ((E,), jnp.int32), ((E,), jnp.int32),
                                                    ((T, k), jnp.int32), ((R,), jnp.int32))]
    call = jax.ffi.ffi_call("jaxmlp_dispatch", outs, vmap_method="sequential")
    f = jax.jit(lambda x, e: call(x, e, num_experts=np.int64(E), capacity=np.int64(2**62), pad_to=np.int64(1)))
    try:
      jax.block_until_ready(f(x, experts))
      print("no error")
    except Exception as e:
      print("error:", e)
""")


def test_cpu_dispatch_target_rejects_rows_too_few_for_a_huge_capacity():
  """The CPU target called directly (no Python checks) with a capacity so large that E * capacity overflows
  int64 (4 * 2**62 wraps to 0) and rows too few for the kept choices: the handler must reject the call (its
  row bound clamps the capacity to T * k first), not write slot_of_row out of bounds. In a subprocess, since
  the out-of-bounds write it guards against can abort the process (heap corruption)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-P", "-c", HUGE_CAPACITY_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "dispatch's rows has 1 rows, need 16" in out.stdout, out.stdout[-3000:]


def router_scores(rng, T, E):
  """Softmax-like scores with the cases a top-k must order as jax.lax.top_k does: ties (lowest index
  first), +0 against -0, infinities and NaNs of both signs."""
  s = rng.standard_normal((T, E)).astype(np.float32)
  s[0] = 0.25                                    # all tied
  s[1, ::3] = s[1, 0]                            # some tied
  s[2] = -0.0
  s[2, ::2] = 0.0                                # +0 ranks above -0
  s[3, :3] = [np.inf, -np.inf, np.nan][:E]
  s[4, 1::4] = -np.nan
  s[5] = rng.integers(0, 3, E)                   # many ties among few values
  return s


@backends
@pytest.mark.parametrize("T,E,k", [(64, 128, 8), (37, 5, 5), (40, 200, 3), (9, 1, 1), (33, 33, 32), (20, 300, 17)])
def test_top_k_is_jax_lax_top_k(backend, rng, T, E, k):
  scores = jnp.asarray(router_scores(rng, T, E))
  values, indices = D.top_k(scores, k)
  want_values, want_indices = jax.lax.top_k(scores, k)
  np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
  np.testing.assert_array_equal(np.asarray(values).view(np.uint32), np.asarray(want_values).view(np.uint32))
  # Independently of XLA: row t's values are its scores at the indices, in descending order, all distinct.
  s = np.asarray(scores)
  finite = np.isfinite(s).all(1)
  got = np.asarray(values)[finite]
  assert (np.diff(got, axis=1) <= 0).all()
  np.testing.assert_array_equal(got, np.take_along_axis(s[finite], np.asarray(indices)[finite], 1))
  assert all(len(set(row)) == k for row in np.asarray(indices).tolist())
  ct = rng.standard_normal((T, k)).astype(np.float32)
  grad = jax.grad(lambda s: jnp.sum(D.top_k(s, k)[0] * ct))(scores)
  want = np.zeros((T, E), np.float32)
  np.put_along_axis(want, np.asarray(want_indices), ct, 1)
  np.testing.assert_array_equal(np.asarray(grad), want)


def test_top_k_rejects_bad_arguments():
  with pytest.raises(ValueError, match="scores: got float32 \\(4,\\), expected float32 \\[T, E\\]"):
    D.top_k(jnp.zeros((4,)), 1)
  with pytest.raises(ValueError, match="scores: got bfloat16"):
    D.top_k(jnp.zeros((4, 3), jnp.bfloat16), 1)
  with pytest.raises(ValueError, match="k: got 4, expected 1 <= k <= E = 3"):
    D.top_k(jnp.zeros((4, 3)), 4)
  assert D.top_k(jnp.zeros((0, 3)), 2)[1].shape == (0, 2)


def test_empty_problems_need_no_custom_call():
  rows, group_sizes, plan = D.dispatch(jnp.zeros((0, 8)), jnp.zeros((0, 2), jnp.int32), 4, pad_to=4)
  assert rows.shape == (12, 8) and not rows.any() and not group_sizes.any()
  assert D.combine(rows, plan).shape == (0, 8)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_layer_fwd_bwd_holds_no_sort_and_no_scatter(capacity_factor):
  """The MoE layer's training step, lowered: the argsort, its gather's scatter-add, the combine's
  scatter-add and the router's top_k (which XLA on a GPU runs as a sort of each row) are gone."""
  nnx = pytest.importorskip("flax.nnx")
  import jaxmlp.nnx

  def lowered(impl):
    moe = jaxmlp.nnx.MoE(8, 16, 32, 2, capacity_factor=capacity_factor, impl=impl, rngs=nnx.Rngs(0))

    def loss(moe, x):
      y, aux = moe(x)
      return jnp.sum(y) + aux["aux_loss"]
    return jax.jit(nnx.grad(loss)).lower(moe, jnp.ones((16, 16))).as_text()

  text = lowered("jaxmlp")
  assert "stablehlo.sort" not in text and "stablehlo.scatter" not in text and "top_k" not in text.replace(
      "jaxmlp_top_k", "")
  assert "jaxmlp_dispatch" in text and "jaxmlp_combine" in text and "jaxmlp_top_k" in text
  reference = lowered("reference")
  assert "stablehlo.sort" in reference and "chlo.top_k" in reference  # the checks can fail


# ---- CUDA only: sizes past one sort block, command buffers ------------------------------------------

@pytest.mark.skipif(_library._cuda is None, reason="built without the CUDA handlers")
def test_cuda_module_registers_the_targets_and_sizes_the_workspace():
  """What the CUDA branch needs from jaxmlp._cuda at trace time (checked wherever it is built, GPU or not):
  the three targets, and a workspace of one counter per sort block (2048 choices) and expert, plus E offsets."""
  assert {"jaxmlp_dispatch", "jaxmlp_combine", "jaxmlp_combine_bwd"} <= set(_library._cuda.registrations())
  assert _library._cuda.dispatch_workspace_bytes(2048, 128) >= (1 + 1) * 128 * 4
  assert _library._cuda.dispatch_workspace_bytes(65536, 128) >= (32 + 1) * 128 * 4


def skip_without_cuda():
  reason = cuda_reason("fallback")
  if reason:
    pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("T,k,E,capacity,pad_to", [(4096, 8, 128, 300, 128), (8192, 2, 8, None, 1),
                                                   (3000, 4, 1536, 10, 16)])
def test_cuda_dispatch_at_moe_sizes(rng, T, k, E, capacity, pad_to):
  """Many sort blocks (2048 choices each), skewed routing (geometric: the small ids overflow their
  capacity, with drops across blocks), the largest E the CUDA sort takes; twice, bitwise equal."""
  skip_without_cuda()
  x, _, weights = random_case(rng, T, k, E, 256, jnp.bfloat16)
  experts = (rng.geometric(0.02, (T, k)) % (E + 2) - 1).astype(np.int32)  # small ids first; -1 and E: dropped
  with jax.default_device(_library.cuda_devices()[0]):
    @jax.jit
    def layer(x, w):
      rows, _, plan = D.dispatch(x, experts, E, capacity=capacity, pad_to=pad_to)
      return D.combine(rows, plan, w)
    out = D.dispatch(x, experts, E, capacity=capacity, pad_to=pad_to)
    y1, y2 = layer(x, jnp.asarray(weights)), layer(x, jnp.asarray(weights))
  want = numpy_dispatch(np.asarray(x, np.float64), experts, E, capacity, pad_to)
  got = (out[0], out[1], out[2].row_of_slot, out[2].slot_of_row, out[2].counts)
  for name, g, w in zip(("rows", "group_sizes", "row_of_slot", "slot_of_row", "counts"), got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float64), w, err_msg=name)
  check_close(y1, numpy_combine(want[0], want[2], weights), TOLERANCE["bfloat16"], "y")
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y2, np.float32))  # no atomics


COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jaxmlp import _library, dispatch as D
    rng = np.random.default_rng(0)
    T, k, E, d = 2048, 4, 16, 256
    x = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
    experts = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
    weights = jnp.asarray(rng.random((T, k)), jnp.float32)
    def loss(x, w):
      rows, _, plan = D.dispatch(x, experts, E, capacity=600, pad_to=16)
      y = D.combine(jnp.tanh(rows), plan, w) + D.combine(rows, plan)
      return jnp.sum(y.astype(jnp.float32) ** 2)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    losses = []
    for i in range(30):
      if i == 10:
        warm = _library._cuda.handler_host_calls()
      v, g = jax.block_until_ready(step(x, weights))
      losses.append(float(v))
    assert len(set(losses)) == 1
    print(json.dumps({"host_calls": _library._cuda.handler_host_calls() - warm, "loss": float(v),
                      "grads": [np.asarray(a, np.float32).tolist() for a in g]}))
""")


@pytest.mark.gpu
def test_dispatch_and_combine_inside_command_buffers():
  """The handlers are captured into an XLA command buffer (sync-free) and give identical results."""
  skip_without_cuda()

  def run(flags):
    env = dict(os.environ, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_PREALLOCATE="true")
    out = subprocess.run([sys.executable, "-P", "-c", COMMAND_BUFFER_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])

  with_cb = run("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
  without = run("--xla_gpu_enable_command_buffer=")
  # Per step: dispatch, 2 combines, their 2 backwards, dispatch's backward (a combine): 6 host executions.
  assert without["host_calls"] == 20 * 6
  assert with_cb["host_calls"] == 0, "the dispatch custom calls were not replayed from a command buffer"
  for a, b in zip(with_cb["grads"], without["grads"]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The loss is XLA's own sum of y^2, which a command buffer's program may reduce in another order (once,
  # on a 4-GPU H200 machine, 1 unit in the last place of 1.4e7).
  np.testing.assert_allclose(with_cb["loss"], without["loss"], rtol=1e-6)


@backends
def test_inside_shard_map(backend, rng):
  """Data parallel: each device dispatches and combines its own tokens (the results' types vary over the
  mesh axis, as the operands' do); values and gradients equal the single-device calls, shard by shard."""
  devices = jax.devices("cpu") if backend == "cpu" else _library.cuda_devices()
  mesh = jax.make_mesh((len(devices),), ("dev",), devices=devices)
  n, T, k, E, d = len(devices), 24, 2, 4, 16
  x, experts, weights = random_case(rng, n * T, k, E, d, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((n * T, d)), jnp.float32)

  def layer(x, experts, w):
    rows, _, plan = D.dispatch(x, experts, E, capacity=8, pad_to=4)
    return D.combine(jnp.tanh(rows), plan, w)

  def step(x, experts, w, dy):
    y, vjp = jax.vjp(lambda x, w: layer(x, experts, w), x, w)
    return y, *vjp(dy)

  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=jax.P("dev"), out_specs=jax.P("dev")))
  put = lambda a: jax.device_put(jnp.asarray(a), jax.sharding.NamedSharding(mesh, jax.P("dev")))  # noqa: E731
  got = sharded(put(x), put(experts), put(weights), put(dy))
  for i in range(n):
    part = slice(i * T, (i + 1) * T)
    want = step(x[part], jnp.asarray(experts[part]), jnp.asarray(weights[part]), dy[part])
    for name, g, w in zip(("y", "dx", "dweights"), got, want):
      np.testing.assert_allclose(np.asarray(g)[part], w, rtol=1e-6, atol=1e-6, err_msg=name)
