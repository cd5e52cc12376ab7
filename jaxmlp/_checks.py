"""Trace-time validation shared by the API and the reference: every error names the argument and the
shape it expected."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from .activations import GATED, NAMES, Activation

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class MlpShape:
  M: int  # rows (tokens, sorted by expert; padding rows at the end)
  d: int  # model width
  f: int  # hidden width per expert
  F1: int  # FC1 output width: 2f for gated activations, f otherwise
  E: int  # experts (groups)
  in_use: int | None = None  # rows expected in use where M is a padded buffer's (None: M)

  @property
  def rows_in_use(self) -> int:
    """The rows the shape-based choices (the GEMM path, FP8's `when`) decide by."""
    return self.M if self.in_use is None else self.in_use


def _shape(a) -> tuple[int, ...]:
  return tuple(np.shape(a))


def _fail(name: str, got, expected: str):
  raise ValueError(f"{name}: got shape {tuple(got)}, expected {expected}")


# The handlers take dimensions and row counts as int32 (ffi CheckExtents), and the CUDA GEMM paths
# keep 64-bit per-group arrays of a few entries per group and product, indexed below 2^30 groups
# (GroupedGemms::Prepare). Checked here, at trace time, so that such shapes fail at the call, naming the
# argument, rather than in the handler (or, for E near 2^30, when the workspace is allocated).
INDEX_LIMIT = 2**31
GROUPS_LIMIT = 2**30


def check_flag(name: str, value) -> None:
  """Raises a TypeError naming the argument unless value is a Python bool (a static choice, not data)."""
  if not isinstance(value, bool):
    raise TypeError(f"{name}: expected True or False, got {value!r}")


def is_static(size) -> bool:
  """Whether a dimension is a number, not a symbolic one (jax.export's shape polymorphism): the handlers
  check a symbolic one's size when the call runs."""
  return isinstance(size, (int, np.integer))


def check_extents(name: str, shape, **dims: int) -> None:
  """Raises ValueError naming `name` (of shape `shape`) when one of `dims` (label=size) is 2^31 or more."""
  for label, size in dims.items():
    if is_static(size) and size >= INDEX_LIMIT:
      raise ValueError(f"{name}: got shape {tuple(shape)}, {label} = {size} must be below 2^31 (jaxmlp's kernels "
                       "index rows and columns with int32)")


def check_groups(name: str, shape, E: int) -> None:
  if E >= GROUPS_LIMIT:
    raise ValueError(f"{name}: got shape {tuple(shape)}, {E} groups; at most 2^30 - 1 (the CUDA GEMM paths' "
                     "per-group arrays)")


def check_group_sizes(group_sizes, E: int | None = None, name: str = "group_sizes") -> None:
  if not hasattr(group_sizes, "dtype"):
    raise TypeError(f"{name}: expected an integer array ([E] int32, on the device), got {type(group_sizes).__name__}")
  if len(_shape(group_sizes)) != 1 or (E is not None and _shape(group_sizes)[0] != E):
    _fail(name, _shape(group_sizes), f"[{'E' if E is None else E}] (one size per group)")
  if not jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer):
    raise TypeError(f"{name}: expected an integer dtype (int32), got {jnp.result_type(group_sizes)}")


GATED_NAMES = ", ".join(n for n in NAMES if n in GATED)
UNGATED_NAMES = ", ".join(n for n in NAMES if n not in GATED)


def check_mlp(x, w1, w2, group_sizes, act: Activation, b1=None, b2=None, scales=None, *,
              float64: bool = False) -> MlpShape:
  """Validates the grouped MLP operands (see jaxmlp.grouped_mlp) and returns their sizes.

  float64: also accept float64 operands (jaxmlp.reference, under jax_enable_x64).
  """
  w1_dims = f"[E, d, {'2f' if act.gated else 'f'}]"
  if len(_shape(x)) != 2:
    _fail("x", _shape(x), "[M, d]")
  M, d = _shape(x)
  if len(_shape(w1)) != 3:
    _fail("w1", _shape(w1), w1_dims)
  E, _, F1 = _shape(w1)
  if E == 0:
    _fail("w1", _shape(w1), f"[E, {d}, {'2f' if act.gated else 'f'}] with E >= 1 (at least one expert)")
  if _shape(w1)[1] != d:
    _fail("w1", _shape(w1), f"{w1_dims} = [{E}, {d}, {F1}] (d from x)")
  if act.gated and F1 % 2:
    _fail("w1", _shape(w1), f"[E, d, 2f] with an even last dimension for the gated {act.name!r}")
  f = F1 // 2 if act.gated else F1
  if len(_shape(w2)) != 3 or _shape(w2)[0] != E or _shape(w2)[2] != d:
    _fail("w2", _shape(w2), f"[E, f, d] = [{E}, {f}, {d}] (E and f from w1, d from x)")
  if _shape(w2)[1] != f:
    _fail_widths(w1, w2, act)
  check_extents("x", _shape(x), M=M, d=d)
  check_extents("w1", _shape(w1), F1=F1)
  check_groups("w1", _shape(w1), E)
  check_group_sizes(group_sizes, E)
  if b1 is not None and _shape(b1) != (E, F1):
    _fail("b1", _shape(b1), f"[E, {'2f' if act.gated else 'f'}] = [{E}, {F1}]")
  if b2 is not None and _shape(b2) != (E, d):
    _fail("b2", _shape(b2), f"[E, d] = [{E}, {d}]")
  if scales is not None and _shape(scales) != (M,):
    _fail("scales", _shape(scales), f"[M] = [{M}]")
  dtype = jnp.result_type(x)
  allowed = FLOAT_DTYPES + ((jnp.dtype(jnp.float64),) if float64 else ())
  if dtype not in allowed:
    raise TypeError(f"x: dtype {dtype} is not supported; expected float32, bfloat16 or float16"
                    + (" (or float64)" if float64 else " (float64: jaxmlp.reference, under jax_enable_x64)"))
  for name, a in (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2), ("scales", scales)):
    if a is not None and jnp.result_type(a) != dtype:
      raise TypeError(f"{name}: dtype {jnp.result_type(a)} differs from x.dtype {dtype}; "
                      "cast the operands to one dtype")
  return MlpShape(M=M, d=d, f=f, F1=F1, E=E)


def _fail_widths(w1, w2, act: Activation):
  """w1's FC1 width does not fit w2's hidden width f. w2 says what f is; w1 is blamed, with the gating
  that decides its width."""
  E, d, F1 = _shape(w1)
  f = _shape(w2)[1]
  if act.gated:
    hint = (f"the gated {act.name!r} takes the gate and the linear part in w1, 2f columns"
            + (f" (w1 is f wide: for an ungated MLP use one of {UNGATED_NAMES})" if F1 == f else ""))
    expected = f"[E, d, 2f] = [{E}, {d}, {2 * f}]"
  else:
    hint = (f"{act.name!r} is not gated, so w1 has f columns"
            + (f" (w1 is 2f wide: for a gated MLP use one of {GATED_NAMES})" if F1 == 2 * f else ""))
    expected = f"[E, d, f] = [{E}, {d}, {f}]"
  raise ValueError(f"w1: got shape {_shape(w1)}, expected {expected} (f = {f} from w2 {_shape(w2)}): {hint}")


def check_ragged_dot(lhs, rhs, group_sizes, preferred_element_type=None):
  """Validates jaxmlp.ragged_dot's operands as jax.lax.ragged_dot would, with a TypeError naming the
  argument; returns (the dtype they are multiplied in, the output dtype)."""
  if len(_shape(lhs)) != 2:
    raise TypeError(f"lhs: got shape {_shape(lhs)}, expected [m, k]")
  k = _shape(lhs)[1]
  if len(_shape(rhs)) != 3 or _shape(rhs)[1] != k:
    raise TypeError(f"rhs: got shape {_shape(rhs)}, expected [g, {k}, n] (k from lhs)")
  if not hasattr(group_sizes, "dtype") or not jnp.issubdtype(jnp.result_type(group_sizes), jnp.integer):
    got = getattr(group_sizes, "dtype", type(group_sizes).__name__)
    raise TypeError(f"group_sizes: expected an integer array [g], got {got}")
  if _shape(group_sizes) != _shape(rhs)[:1]:
    raise TypeError(f"group_sizes: got shape {_shape(group_sizes)}, expected [{_shape(rhs)[0]}] (g from rhs)")
  dtype = jnp.promote_types(jnp.result_type(lhs), jnp.result_type(rhs))
  return dtype, jnp.dtype(preferred_element_type or dtype)


def ragged_dot_unservable(lhs, rhs, dtype, out_dtype) -> str | None:
  """Why jaxmlp's grouped GEMM does not serve a checked ragged_dot (jax.lax.ragged_dot does it then), or
  None: it takes float32, bfloat16 and float16, at least one group and fewer than 2^30, and rows and
  columns it can index with int32."""
  if dtype not in FLOAT_DTYPES or out_dtype not in FLOAT_DTYPES:
    return f"{dtype} operands with a {out_dtype} result"
  (m, k), (g, _, n) = _shape(lhs), _shape(rhs)
  if g == 0 or (is_static(g) and g >= GROUPS_LIMIT):
    return f"{g} groups"
  if any(is_static(size) and size >= INDEX_LIMIT for size in (m, k, n)):
    return f"extents (m, k, n) = {(m, k, n)} past int32"
  return None
