"""The FP8 recipes on a GPU: their custom calls (CUDA only; handlers in ffi/cuda/fp8/) and each recipe's
Implementation over them.

  tensorwise  one call quantizes a weight tensor ("jaxmlp_fp8_tensor_weights"); one call runs each direction
              ("jaxmlp_mlp_fp8_fwd" / "_bwd"), the quantization passes and the activation inside;
  blockwise   each quantizer and each of the six products is a call ("jaxmlp_fp8_block_*",
              "jaxmlp_gemm_fp8_blocks"); the activation and its derivative run inside the quantizers of a
              and dh, and the recipe's glue between the calls is jaxmlp.fp8.blockwise's own.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .. import _gemm_path, _library
from .._checks import MlpShape
from .._groups import Groups
from .._library import ABSENT, optional
from ..activations import Activation
from ..gemm import grouped_gemm
from . import blockwise, tensorwise
from .quantize import Implementation, fp8_weight_gradients

E4M3 = jnp.float8_e4m3fn


def fp8_status() -> tuple[bool, str]:
  """Whether this process's CUDA device and cuBLAS run the FP8 grouped MLP, and why (not)."""
  if _library._cuda is None:
    return False, _library.CUDA_BUILD_ERROR
  status = _library.cuda_status()
  if not status:
    return False, "no CUDA device"
  if not status.get("grouped_available"):
    return False, "FP8 runs on the cuBLASLt grouped GEMM, which is unavailable: " + status.get("grouped_reason", "")
  major = int(status.get("compute_capability", "0.0").split(".")[0])
  if major != 9:
    return False, (f"compute capability {status['compute_capability']}: the FP8 path is built and tested for "
                   "Hopper (9.x) only")
  return True, "cuBLASLt grouped GEMM, FP8 e4m3 with one scale per tensor (tensorwise) or per block (blockwise)"


def _module_or_raise():
  """The CUDA extension, for a CUDA branch on a device that runs FP8 (RuntimeError otherwise)."""
  ok, why = fp8_status()
  if not ok:
    raise RuntimeError(f"fp8: this GPU cannot run the FP8 grouped MLP: {why}")
  return _library._cuda


# ---- tensorwise ------------------------------------------------------------------------------------------
def tensor_weights(w, dtype):
  """tensorwise.quantize_weights of w.astype(dtype) on the GPU: (q [E, K, N] e4m3, amax float32 [], q
  transposed [E, N, K]). Its kernels read 16-bit weights: wider ones are rounded by XLA first (a copy)."""
  _module_or_raise()
  w = w.astype(dtype)
  E, K, N = w.shape
  q, amax, qt = _library.call("jaxmlp_fp8_tensor_weights", [((E, K, N), E4M3), ((1,), jnp.float32),
                                                             ((E, N, K), E4M3)], w)
  return q, amax[0], qt


def reads_tokens(recipe, residuals: bool) -> bool:
  """Whether the recipe's forward on CUDA reads a dispatch plan's rows from the tokens (_mlp_forward's
  `gather`): tensorwise, whose backward then needs x's e4m3 copy alone (with FP8 weight gradients, or none)."""
  return recipe.name == tensorwise.SCHEME.name and (fp8_weight_gradients(recipe) or not residuals)


def _mlp_forward(x, w1q, w2q, groups: Groups, b1, b2, scales, act: Activation, recipe, s: MlpShape,
                 residuals: bool, zero_padding: bool, gather=None, delayed=None):
  """The forward's custom call: (y [M, d], with `residuals` what the backward takes: h [M, F1], amax [4]
  float32 of x, w1, w2, a, x's e4m3 copy xt [d, L] (tensorwise.transposed_padded's layout; with 16-bit weight
  gradients x itself), q(w1), q(w2); with `delayed`, x's and a's amaxes as observed). y's rows past the
  groups are zeros, whatever zero_padding says. gather: (slot_of_row [M] int32, k) where x holds the tokens a
  plan takes the rows from (reads_tokens), which the quantization passes read in place. delayed: amaxes [4]
  (x, a, dy, dh) to scale by (tensorwise.forward's)."""
  cuda = _module_or_raise()
  dt = x.dtype
  (w1, aw1, w1t), (w2, aw2, w2t) = w1q, w2q
  engine, fp8_wgrad = _gemm_path.fp8_on_engine(dt, s.d, s.f), fp8_weight_gradients(recipe)
  assert gather is None or reads_tokens(recipe, residuals), "the backward would need the rows"
  ws = cuda.mlp_fp8_workspace_bytes(True, engine, fp8_wgrad, s.M, s.d, s.f, s.F1, s.E, _library.dtype_code(dt),
                                    False, False, False)
  xt = (s.d, tensorwise.padded_length(s.M, s.E, tensorwise.PAD)) if residuals and fp8_wgrad else ABSENT
  outs = [((s.M, s.d), dt), ((s.M, s.F1), dt), ((4,), jnp.float32), (xt, E4M3),
          ((2,) if delayed is not None else ABSENT, jnp.float32)]
  slot_of_row, top_k = (optional(None, jnp.int32), 1) if gather is None else gather
  given = optional(None if delayed is None else delayed[:2], jnp.float32)
  y, h, amax, xt, seen = _library.call(
      "jaxmlp_mlp_fp8_fwd", outs, x, w1, w2, groups.given, optional(b1, dt), optional(b2, dt), optional(scales, dt),
      w1t, w2t, jnp.stack([aw1, aw2]), slot_of_row, given, workspace=ws, **_library.activation_attrs(act),
      fast_accumulation=bool(recipe.fast_accumulation), engine=engine, top_k=np.int32(top_k))
  if not residuals:
    return y, None
  return y, (h, amax, xt if fp8_wgrad else x, w1, w2) + ((seen,) if delayed is not None else ())


def _mlp_backward(residuals, groups: Groups, b1, b2, scales, act: Activation, recipe, s: MlpShape, dy,
                  zero_padding: bool, delayed=None):
  """The backward's custom call, from the forward's residuals: (dx, dw1, dw2, db1, db2, dscales), None where
  absent; dx's rows past the groups zeros, whatever zero_padding says; with `delayed` (tensorwise.backward's)
  a seventh result, the amaxes [4] of x, a, dy, dh as observed."""
  cuda = _module_or_raise()
  h, amax, xt, w1q, w2q = residuals[:5]  # xt: x itself with 16-bit weight gradients
  dt = h.dtype
  engine, fp8_wgrad = _gemm_path.fp8_on_engine(dt, s.d, s.f), fp8_weight_gradients(recipe)
  ws = cuda.mlp_fp8_workspace_bytes(False, engine, fp8_wgrad, s.M, s.d, s.f, s.F1, s.E, _library.dtype_code(dt),
                                    b1 is not None, b2 is not None, scales is not None)
  outs = [((s.M, s.d), dt), ((s.E, s.d, s.F1), dt), ((s.E, s.f, s.d), dt),
          ((s.E, s.F1) if b1 is not None else ABSENT, dt), ((s.E, s.d) if b2 is not None else ABSENT, dt),
          ((s.M,) if scales is not None else ABSENT, dt), ((2,) if delayed is not None else ABSENT, jnp.float32)]
  given = optional(None if delayed is None else delayed[2:], jnp.float32)
  dx, dw1, dw2, db1, db2, dscales, seen = _library.call(
      "jaxmlp_mlp_fp8_bwd", outs, xt, w1q, w2q, groups.given, optional(b1, dt), optional(b2, dt),
      optional(scales, dt), h, dy, amax, given, workspace=ws, **_library.activation_attrs(act),
      fast_accumulation=bool(recipe.backward_fast_accumulation), engine=engine, fp8_weight_gradients=fp8_wgrad)
  grads = (dx, dw1, dw2, db1 if b1 is not None else None, db2 if b2 is not None else None,
           dscales if scales is not None else None)
  return grads if delayed is None else (*grads, jnp.concatenate([residuals[5], seen]))


TENSORWISE = Implementation(tensor_weights, _mlp_forward, _mlp_backward)


# ---- blockwise -------------------------------------------------------------------------------------------
def block_weights(w, dtype):
  """blockwise.quantize_weights of w.astype(dtype) on the GPU: (q [E, K, N] e4m3, exponents [E, ceil(K /
  128), ceil(N / 128)] int32, q transposed [E, N, K]). The kernel rounds w (float32 master weights too) to
  dtype as it reads it: one pass over w, no 16-bit copy."""
  _module_or_raise()
  if w.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):  # the kernel's types: float64 rounded by XLA
    w = w.astype(dtype)
  q, qt, e = _library.call("jaxmlp_fp8_block_weights", _weight_block_outputs(*w.shape), w,
                           dtype=np.int32(_library.dtype_code(dtype)))
  return q, e, qt


def _weight_block_outputs(E: int, K: int, N: int) -> list:
  """The results of a 128 x 128 quantization of weights [E, K, N]: q, qt and the exponents."""
  return [((E, K, N), E4M3), ((E, N, K), E4M3), ((E, -(-K // 128), -(-N // 128)), jnp.int32)]


def block_adam(w, g, mu, nu, scalars, hyper, dtype):
  """jaxmlp.fp8.adam's blockwise step on the GPU, one kernel: (new w, mu, nu, and the new weights' q,
  exponents, qt as block_weights). The new w, mu and nu take the input's buffers (aliases: in place where
  the caller donates them, else XLA copies the inputs first)."""
  _module_or_raise()
  outs = [(w.shape, jnp.float32)] * 3 + _weight_block_outputs(*w.shape)
  w, mu, nu, q, qt, e = _library.call("jaxmlp_fp8_block_adam", outs, w, g, mu, nu, scalars,
                                      input_output_aliases={0: 0, 2: 1, 3: 2}, **_adam_attributes(hyper, dtype))
  return w, mu, nu, q, e, qt


def tensor_adam(w, g, mu, nu, scalars, delayed, hyper, dtype):
  """jaxmlp.fp8.adam's tensorwise step on the GPU, one kernel: (new w, mu, nu, the new weights' q by the
  delayed amax, their amax, qt). Aliases as block_adam's."""
  _module_or_raise()
  E, K, N = w.shape
  outs = [(w.shape, jnp.float32)] * 3 + [((E, K, N), E4M3), ((E, N, K), E4M3), ((1,), jnp.float32)]
  w, mu, nu, q, qt, amax = _library.call("jaxmlp_fp8_tensor_adam", outs, w, g, mu, nu, scalars,
                                         jnp.reshape(delayed, (1,)), input_output_aliases={0: 0, 2: 1, 3: 2},
                                         **_adam_attributes(hyper, dtype))
  return w, mu, nu, q, amax[0], qt


def _adam_attributes(hyper, dtype) -> dict:
  """adam's constants as the kernels take them (float32, 1 - b computed here in double and rounded once)."""
  return dict(b1=np.float32(hyper.b1), b2=np.float32(hyper.b2), one_minus_b1=np.float32(1 - hyper.b1),
              one_minus_b2=np.float32(1 - hyper.b2), eps=np.float32(hyper.eps), eps_root=np.float32(hyper.eps_root),
              weight_decay=np.float32(hyper.weight_decay), dtype=np.int32(_library.dtype_code(dtype)))


def _gemm_blocks(op: str, lhs, lhs_scales, rhs, rhs_scales, groups: Groups, dtype, zero_padding: bool = True):
  """A product on FP8 tensor cores with cuBLASLt's block scaling (the operands' layouts: ffi/cuda/fp8/):
  "nt" out [M, K] = lhs @ rhs[g].T per group of rows (the rows past the groups zeros with zero_padding,
  else unwritten), "tn" out [E, K, N] = lhs [K, L] @ rhs [N, L].T per group's padded columns. Scales are
  float32 powers of two."""
  cuda = _module_or_raise()
  rows, E = groups.num_rows, groups.num_groups
  code = _library.gemm_op({"nt": "nt", "tn": "tn_padded"}[op])
  out_shape = (rows, rhs.shape[1]) if op == "nt" else (E, lhs.shape[0], rhs.shape[0])
  ws = cuda.gemm_fp8_blocks_workspace_bytes(int(code), rows, E, lhs.shape[1])
  return _library.call("jaxmlp_gemm_fp8_blocks", [(out_shape, dtype)], lhs, lhs_scales, rhs, rhs_scales,
                       groups.given, workspace=ws, op=code, rows=np.int64(rows),
                       zero_padding=np.int32(zero_padding))[0]


def _block_outputs(R: int, C: int, B: int, columns: bool) -> list:
  """The results of a blockwise quantizer of [R, C] in B column blocks: (q, exponents) by rows and, with
  `columns`, by columns (else ABSENT: the rows only)."""
  return [((R, C), E4M3), ((R, -(-C // 128)), jnp.int32), ((C, 128 * B) if columns else ABSENT, E4M3),
          ((B, C) if columns else ABSENT, jnp.int32)]


def _quantizer(v, groups: Groups, columns: bool):
  """blockwise.quantize_rows_and_columns, or without `columns` quantize_rows_in_groups, in one pass over v."""
  _module_or_raise()
  first, rows = blockwise.column_blocks(groups)
  q, e, qt, ec = _library.call("jaxmlp_fp8_block_rows_and_columns",
                               _block_outputs(*v.shape, first.shape[0], columns), v, first, rows)
  return ((q, e), (qt, ec)) if columns else (q, e)


def _activation(h, da, scales, groups: Groups, act: Activation, columns: bool):
  """The quantizer of a = act(h) * scales [R, f] (da None) or of dh [R, F1], computed from h (and da) on
  the way in: blockwise.activation_rows_and_columns or activation_grad_rows_and_columns, or without
  `columns` activation_rows or activation_grad_rows (the rows, and a or dh in h's dtype)."""
  _module_or_raise()
  (R, F1) = h.shape
  C = F1 if da is not None else (F1 // 2 if act.gated else F1)
  first, rows = blockwise.column_blocks(groups)
  outs = _block_outputs(R, C, first.shape[0], columns) + [((R, C) if not columns else ABSENT, h.dtype)]
  q, e, qt, ec, values = _library.call("jaxmlp_fp8_block_activation", outs, h, optional(da, h.dtype),
                                       optional(scales, h.dtype), first, rows, **_library.activation_attrs(act))
  return (q, e), ((qt, ec) if columns else values)


def _scales(e):
  """float32 2^e of the recipe's exponents: the block scales cuBLASLt multiplies by."""
  return jnp.ldexp(jnp.ones(e.shape, jnp.float32), e)


def _rows(lhs, w, groups: Groups, transposed, dtype, zero_padding):
  (q, e), (wq, we) = lhs, w[:2]
  if not transposed:  # FP8 tensor cores read w[g] contiguous along the reduction: the transposed copy [n, k]
    wq, we = w[2], jnp.swapaxes(we, 1, 2)
  we = jnp.pad(we, ((0, 0), (0, 0), (0, -we.shape[2] % 4)))  # cuBLASLt's 128x128 layout: blocks per row to 4
  return _gemm_blocks("nt", q, _scales(e), wq, _scales(we), groups, dtype, zero_padding)


def _columns(lhs, rhs, groups: Groups, dtype):
  (lq, le), (rq, re) = lhs, rhs
  return _gemm_blocks("tn", lq, _scales(le), rq, _scales(re), groups, dtype)


def _group_sums(v, weights, groups: Groups):
  """quantize.group_sums as a grouped product over the rows, [16, M] @ v per group, of a 16-bit lhs whose
  first column is the weights (or ones) and the others zero (16 columns: 16-byte rows for the tensor cores):
  exact 16-bit products, float32 sums in a fixed order (no atomics, as XLA's scatter-add would take)."""
  m = v.shape[0]
  column = jnp.ones((m,), v.dtype) if weights is None else weights.astype(v.dtype)
  lhs = jnp.pad(column[:, None], ((0, 0), (0, 15)))
  return grouped_gemm("tn", lhs, v, groups.given, (groups.num_groups, 16, v.shape[1]), jnp.float32)[:, 0]


def _columns16(lhs, rhs, groups: Groups, dtype):
  """Per group, lhs^T @ rhs over its rows, of 16-bit operands: jaxmlp's grouped GEMM."""
  return grouped_gemm("tn", lhs, rhs, groups.given, (groups.num_groups, lhs.shape[1], rhs.shape[1]), dtype)


BLOCKWISE_PRIMITIVES = blockwise.Primitives(
    quantize_rows_and_columns=lambda v, groups: _quantizer(v, groups, True),
    activation_rows_and_columns=lambda h, scales, groups, act: _activation(h, None, scales, groups, act, True),
    activation_grad_rows_and_columns=lambda h, da, scales, groups, act: _activation(h, da, scales, groups, act,
                                                                                    True),
    quantize_rows_in_groups=lambda v, groups: _quantizer(v, groups, False),
    activation_rows=lambda h, scales, groups, act: _activation(h, None, scales, groups, act, False),
    activation_grad_rows=lambda h, da, scales, groups, act: _activation(h, da, scales, groups, act, False),
    rows=_rows, columns=_columns, columns16=_columns16, group_sums=_group_sums)
BLOCKWISE = blockwise.implementation(BLOCKWISE_PRIMITIVES, block_weights)

IMPLEMENTATIONS = {tensorwise.SCHEME.name: TENSORWISE, blockwise.SCHEME.name: BLOCKWISE}
