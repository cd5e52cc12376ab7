"""jaxmlp.grouped_mlp: the expert MLP over rows sorted by expert, one custom call per direction.

  grouped_mlp -> _mlp (custom_vjp) -> mlp_forward / mlp_backward -> "jaxmlp_mlp_fwd" / "jaxmlp_mlp_bwd"
  (ffi/cpu/mlp_cpu.cc; on CUDA one handler per GEMM path, ffi/cuda/mlp/). With an FP8 recipe the call
goes to jaxmlp.fp8.mlp instead. jaxmlp.reference.grouped_mlp defines what both compute. With `gather` (rows
taken from tokens by a dispatch plan) _gathered_mlp instead of _mlp: the engine's FC1 reads the rows from
the tokens ("jaxmlp_mlp_fwd_gathered") where _gemm_path.gathers_in_fc1, elsewhere XLA gathers them first;
with an FP8 recipe jaxmlp.fp8.mlp takes the plan.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _checks, _gemm_path, _groups, _library, dispatch, reference
from ._autodiff import gathered, integer_cotangent, not_differentiable, refuse_forward_mode, summed_like
from ._library import ABSENT, optional
from .activations import Activation, resolve
from .fp8 import delayed
from .fp8 import mlp as fp8_mlp
from .fp8 import recipe as fp8_recipe
from .plan import Plan, check_gather_args, take_rows


def grouped_mlp(x, w1, w2, group_sizes, *, activation: str | Activation = "swiglu", b1=None, b2=None,
                scales=None, check_group_sizes: bool = False, fp8: str | fp8_recipe.Fp8Recipe | None = None,
                zero_padding: bool = True, gather: Plan | None = None, fp8_history=None):
  """Mixture-of-Experts expert MLP over rows sorted by expert: `scales * (act(x @ w1[g] + b1[g]) @ w2[g] + b2[g])`.

  Args:
    x: [M, d] rows sorted by group; group g owns rows [offset_g, offset_g + group_sizes[g]).
    w1: [E, d, 2f] for gated activations (first f columns gate, last f linear part), else [E, d, f].
    w2: [E, f, d].
    group_sizes: [E] integer, on the device. Negative sizes count as 0 and the running total is capped
      at M; rows past the total are padding: output 0, gradient 0.
    activation: a name (swiglu, geglu, reglu, gelu, relu, silu, squared_relu, clamped_swiglu) or a
      jaxmlp.Activation with parameters.
    b1: optional [E, 2f] or [E, f] FC1 bias. b2: optional [E, d] FC2 bias.
    scales: optional [M] per-row factor on the row's whole expert output, b2 included (an MoE's
      router weights); differentiable.
    check_group_sizes: raise ValueError if group_sizes holds negative sizes or sums past M. Concrete
      sizes (NumPy, or a jax.Array outside jit) are checked at once; traced ones (under jit) at run time,
      by a host callback, whose ValueError JAX reports as jax.errors.JaxRuntimeError with the same message
      (costs a device-to-host copy; for debugging).
    fp8: None (x's dtype throughout), "tensorwise", "blockwise" or a jaxmlp.Fp8Recipe: FC1 and FC2,
      forward and backward, as FP8 e4m3 products (the recipes: jaxmlp.fp8.tensorwise,
      jaxmlp.fp8.blockwise; biases and their gradients stay in x's dtype); bfloat16 or float16 operands,
      d and f multiples of 16. w1 and w2 may then be jaxmlp.Fp8Weights (jaxmlp.fp8_weights): weights
      quantized once and reused over calls, with the same results; where fp8 is None, theirs is the recipe.
      By default a call runs in FP8 only at shapes where the recipe was measured at least as fast as bf16
      (enough rows per expert: jaxmlp.Fp8Recipe's `when`), otherwise in x's dtype.
    zero_padding: True: the rows past the groups of the result, and of x's gradient, are zeros. False: they
      may be left unwritten (any values), for a caller that never reads them, as jaxmlp.combine and the
      gradient of jaxmlp.dispatch do not: it saves writing them, most of the rows where the buffer is
      sized for the worst case (the expert-parallel MoE layer's). grouped_mlp itself, with or without fp8,
      reads no row past the groups of x or of the result's cotangent, whatever they hold.
    gather: a jaxmlp.dispatch.Plan: x is then the tokens [T, d] the plan was made for, and the rows are the
      ones jaxmlp.dispatch made (jaxmlp.dispatch.gather(x, gather), [M, d] with M the plan's rows): the
      result is grouped_mlp of those rows, and x's gradient sums each token's rows' gradients. The rows
      are not kept for the backward, which gathers them again: one [M, d] less of activation memory for
      one more gather. With JAXMLP_GEMM_PATH=cutlass or fused on Hopper, for a gated activation (f a
      multiple of 64, 16-bit operands), the engine's FC1 reads the rows from x in its loads, no copy of
      them written (today slower than the copy: backend_info()["cuda"]["gather_in_fc1"]); with
      fp8="tensorwise" (FP8 weight gradients) on a GPU the forward's quantization passes read them from x,
      and the backward needs only their e4m3 copy; elsewhere XLA gathers them first.
    fp8_history: with fp8=jaxmlp.Fp8Recipe("tensorwise", scaling="delayed") (only then), the call site's amax
      history, float32 [4, H] (jaxmlp.fp8_history(H)): x, a, dy and dh are quantized by the largest of
      their last H amaxes, with no amax passes, and the gradient of fp8_history is the updated history (to
      take as the next one, not to add: jaxmlp.fp8.delayed).

  Returns:
    [M, d] in x.dtype (float32, bfloat16 or float16; accumulation in float32).

  Differentiable once, in reverse mode (grad, vjp, value_and_grad, jacrev). Forward mode (jax.jvp,
  jax.jacfwd) and derivatives of the gradient (grad of grad, jax.hessian) are not implemented: use
  jaxmlp.reference.grouped_mlp there.
  """
  act = resolve(activation)
  _checks.check_flag("zero_padding", zero_padding)
  recipe = fp8_recipe.resolve_with_weights(fp8, w1, w2)
  dtype = jnp.result_type(x)
  rows = x
  if gather is not None:
    check_gather_args(x, gather)
    rows = jax.ShapeDtypeStruct((gather.slot_of_row.shape[0], x.shape[1]), dtype)
  shape = _checks.check_mlp(rows, fp8_recipe.checked_as(w1, dtype), fp8_recipe.checked_as(w2, dtype), group_sizes,
                            act, b1, b2, scales)
  if gather is not None and 0 in (shape.M, shape.d, shape.f, *gather.row_of_slot.shape):
    # An empty problem runs the reference below, and a plan of no choices (k 0) holds padding rows alone:
    # the rows first.
    x, gather = dispatch.gather(x, gather), None
  if recipe is not None:
    fp8_recipe.check_call(x, recipe, shape, w1, w2)
  delayed.check(fp8_history, None if recipe is None else recipe.scaling)
  # A call that runs in x's dtype observes no amax and gives the history back as it was.
  kept = (lambda y: y) if fp8_history is None else (lambda y: delayed.unchanged(y, fp8_history))
  shape = dataclasses.replace(shape, in_use=_gemm_path.expected_rows(shape.M))
  if check_group_sizes:
    _groups.check_at_run_time(group_sizes, shape.M)
  group_sizes = _groups.host_sizes_as_int32(group_sizes, shape.M)
  if 0 in (shape.M, shape.d, shape.f):
    # An empty problem leaves only biases and zeros to compute, and the handlers take no zero-sized
    # operands (they launch kernels sized by them): the reference, which defines the semantics, does it.
    w1, w2 = (fp8_recipe.weights_of(w).astype(dtype) for w in (w1, w2))
    return kept(reference.grouped_mlp(x, w1, w2, group_sizes, activation=act, b1=b1, b2=b2, scales=scales))
  refuse_forward_mode(x, w1, w2, b1, b2, scales, fp8_history)
  x, b1, b2, scales = gathered(x, b1, b2, scales)
  run = fp8_recipe.as_run(recipe, shape, w1, w2)  # the recipe, with its products' precisions decided
  gather = None if gather is None else Plan(*gathered(*gather))
  if run is not None:
    return fp8_mlp.grouped_mlp(x, w1, w2, group_sizes, b1, b2, scales, act, run, shape, zero_padding, gather,
                               fp8_history)
  if recipe is not None:  # not in FP8 at this shape: Fp8Weights' weights, whose gradient they take
    w1, w2 = (fp8_recipe.weights_of(w).astype(dtype) for w in (w1, w2))
  if gather is not None:
    return kept(_gathered_mlp(x, gather, *gathered(w1, w2), group_sizes, b1, b2, scales, act, shape, zero_padding))
  return kept(_mlp(x, *gathered(w1, w2), group_sizes, b1, b2, scales, act, shape, zero_padding))


# The operands were checked once, in grouped_mlp: the rules get their sizes (`shape`, static and
# hashable) instead of checking them again.
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _mlp(x, w1, w2, group_sizes, b1, b2, scales, act, shape, zero_padding):
  return _mlp_fwd(x, w1, w2, group_sizes, b1, b2, scales, act, shape, zero_padding)[0]


def _mlp_fwd(x, w1, w2, group_sizes, b1, b2, scales, act, shape, zero_padding):
  y, h = not_differentiable(mlp_forward, x, w1, w2, group_sizes, b1, b2, scales, act, shape, zero_padding)
  # Residuals: the inputs and the FC1 output; the activation output is recomputed in the backward.
  return y, (x, w1, w2, group_sizes, b1, b2, scales, h)


def _mlp_bwd(act, shape, zero_padding, res, dy):
  x, w1, w2, group_sizes, b1, b2, scales, h = res
  grads = not_differentiable(mlp_backward, x, w1, w2, group_sizes, b1, b2, scales, h, dy, act, shape, zero_padding)
  dx, dw1, dw2, db1, db2, dscales = map(summed_like, grads, (x, w1, w2, b1, b2, scales))
  return dx, dw1, dw2, integer_cotangent(group_sizes), db1, db2, dscales


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


# _mlp over rows gathered from tokens x by a dispatch plan: the residuals hold the tokens, not the rows, which
# the backward gathers again (the weight gradient of FC1 reads them); x's gradient is a combine of the rows'.
@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _gathered_mlp(x, plan, w1, w2, group_sizes, b1, b2, scales, act, shape, zero_padding):
  return _gathered_mlp_fwd(x, plan, w1, w2, group_sizes, b1, b2, scales, act, shape, zero_padding)[0]


def _gathered_mlp_fwd(x, plan, w1, w2, group_sizes, b1, b2, scales, act, shape, zero_padding):
  y, h = not_differentiable(mlp_forward, x, w1, w2, group_sizes, b1, b2, scales, act, shape, zero_padding, plan)
  return y, (x, plan, w1, w2, group_sizes, b1, b2, scales, h)


def _gathered_mlp_bwd(act, shape, zero_padding, res, dy):
  x, plan, w1, w2, group_sizes, b1, b2, scales, h = res
  rows = take_rows(x, plan.slot_of_row, plan.row_of_slot.shape[1])
  # The rows' gradients past the groups hold no choice, which the combine does not read: left unwritten.
  grads = not_differentiable(mlp_backward, rows, w1, w2, group_sizes, b1, b2, scales, h, dy, act, shape, False)
  drows, dw1, dw2, db1, db2, dscales = map(summed_like, grads, (rows, w1, w2, b1, b2, scales))
  dx = dispatch.combine(drows, plan)  # each token's rows' gradients summed
  return dx, Plan(None, None, None), dw1, dw2, integer_cotangent(group_sizes), db1, db2, dscales


_gathered_mlp.defvjp(_gathered_mlp_fwd, _gathered_mlp_bwd)


def _mlp_path_and_workspace(dtype, s: _checks.MlpShape, act: Activation, forward: bool, b1, b2) -> tuple[str, int]:
  path = _gemm_path.cuda_path(dtype, s.d, s.f, s.F1, problem=(s.E, s.rows_in_use, s.d, s.F1),
                              mlp="forward" if forward else "backward",
                              fusable=_gemm_path.fc1_fusable(s.f))
  biases = b1 is not None or b2 is not None
  ws = _library.cuda_module().mlp_workspace_bytes(path, forward, s.M, s.d, s.f, s.F1, s.E,
                                                  _library.dtype_code(dtype), biases)
  return path, ws


def mlp_forward(x, w1, w2, group_sizes, b1, b2, scales, act: Activation, s: _checks.MlpShape,
                zero_padding: bool = True, gather: Plan | None = None):
  """One custom call: FC1, activation, FC2. Returns (y [M, d], h [M, F1]), h being the saved FC1 output
  (its rows past the groups unwritten on CUDA; y's too unless zero_padding). The CPU handler writes zeros
  there whatever zero_padding says. With `gather`, x holds the tokens the plan's rows are taken from: the
  engine's FC1 reads them in its loads where _gemm_path.gathers_in_fc1, elsewhere XLA gathers them first."""
  dt = x.dtype
  slots = () if gather is None else (gather.slot_of_row,)
  args = (x, *slots, w1, w2, _groups.handler_sizes(group_sizes, s.M), optional(b1, dt), optional(b2, dt),
          optional(scales, dt))
  outs = [((s.M, s.d), dt), ((s.M, s.F1), dt)]
  attrs = _library.activation_attrs(act)

  def rows_first(x, *a):  # the operands of "jaxmlp_mlp_fwd": the rows (gathered by XLA) and the rest
    return (x, *a) if not slots else (take_rows(x, a[0], gather.row_of_slot.shape[1]), *a[1:])

  def cpu(*a):
    return _library.call("jaxmlp_mlp_fwd", outs, *rows_first(*a), **attrs)

  def cuda(*a):
    path, ws = _mlp_path_and_workspace(dt, s, act, True, b1, b2)
    options = dict(workspace=ws, zero_padding=np.int32(zero_padding), **attrs)
    if slots and _gemm_path.gathers_in_fc1(path, act, s.f):
      return _library.call("jaxmlp_mlp_fwd_gathered", outs, *a, top_k=np.int32(gather.row_of_slot.shape[1]),
                           fc2_on_engine=np.int32(path == "cutlass"), **options)
    return _library.call(f"jaxmlp_mlp_fwd_{path}", outs, *rows_first(*a), **options)

  return _library.on_platforms(*args, cpu=cpu, cuda=cuda)


def mlp_backward(x, w1, w2, group_sizes, b1, b2, scales, h, dy, act: Activation, s: _checks.MlpShape,
                 zero_padding: bool = True):
  """One custom call for the whole backward: (dx, dw1, dw2, db1, db2, dscales), None where absent; dx's rows
  past the groups unwritten on CUDA unless zero_padding."""
  dt = x.dtype
  args = (x, w1, w2, _groups.handler_sizes(group_sizes, s.M), optional(b1, dt), optional(b2, dt),
          optional(scales, dt), h, dy.astype(dt))
  outs = [((s.M, s.d), dt), ((s.E, s.d, s.F1), dt), ((s.E, s.f, s.d), dt),
          ((s.E, s.F1) if b1 is not None else ABSENT, dt), ((s.E, s.d) if b2 is not None else ABSENT, dt),
          ((s.M,) if scales is not None else ABSENT, dt)]
  attrs = _library.activation_attrs(act)

  def cpu(*a):
    return _library.call("jaxmlp_mlp_bwd", outs, *a, **attrs)

  def cuda(*a):
    path, ws = _mlp_path_and_workspace(dt, s, act, False, b1, b2)
    # dh is written over the residual h (dead after this call): one [M, F1] buffer less at the peak.
    dh = ((s.M, s.F1), dt)
    return _library.call(f"jaxmlp_mlp_bwd_{path}", outs + [dh], *a, workspace=ws, input_output_aliases={7: 6},
                         zero_padding=np.int32(zero_padding), **attrs)[:6]

  dx, dw1, dw2, db1, db2, ds = _library.on_platforms(*args, cpu=cpu, cuda=cuda)
  return (dx, dw1, dw2, db1 if b1 is not None else None, db2 if b2 is not None else None,
          ds if scales is not None else None)
