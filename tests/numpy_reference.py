"""Float64 NumPy reference for the grouped MLP and grouped GEMMs, with hand-written derivatives.

Independent of jaxmlp's code: it shares only the documented semantics (layout, group_sizes policy,
activation formulas), so a mistake in the package and in this file would have to agree to go unnoticed.
"""
import math

import numpy as np

GATED = {"swiglu", "geglu", "reglu", "clamped_swiglu"}


def clamp_sizes(sizes, m):
  """Negative sizes count as 0; the running total is capped at m. Returns row offsets [E + 1]."""
  offsets = [0]
  for s in np.asarray(sizes, dtype=np.int64):
    offsets.append(min(offsets[-1] + max(int(s), 0), m))
  return offsets


def _sigmoid(x):
  return np.exp(-np.logaddexp(0, -x))  # 1 / (1 + exp(-x)) without overflow


def _gelu(x):
  # 0.5 x (1 + tanh(u)) = x sigmoid(2u): 1 + tanh(u) cancels in the negative tail even in float64.
  c = math.sqrt(2 / math.pi)
  s = _sigmoid(2 * c * (x + 0.044715 * x**3))
  return x * s, s + 2 * x * s * (1 - s) * c * (1 + 3 * 0.044715 * x * x)


def _silu(x):
  s = _sigmoid(x)
  return x * s, s * (1 + x * (1 - s))


def _relu(x):
  return np.maximum(x, 0), (x > 0).astype(x.dtype)


def activation(name, h, alpha=1.702, limit=7.0):
  """Returns (value [M, f], d value / d h [M, F1] as (dgate, dup) or (dx, None))."""
  if name in GATED:
    f = h.shape[1] // 2
    gate, up = h[:, :f], h[:, f:]
    if name == "clamped_swiglu":
      gate_free = ~(gate > limit)  # NaN passes through, as in the formula min(gate, limit)
      up_free = ~((up < -limit) | (up > limit))
      g = np.where(gate_free, gate, limit)
      u = np.clip(up, -limit, limit) + 1
      s = _sigmoid(alpha * g)
      glu, dglu = g * s, s + g * alpha * s * (1 - s)
      return glu * u, (np.where(gate_free, dglu * u, 0), np.where(up_free, glu, 0))
    val, grad = {"swiglu": _silu, "geglu": _gelu, "reglu": _relu}[name](gate)
    return val * up, (grad * up, val)
  if name == "squared_relu":
    return np.maximum(h, 0) ** 2, (2 * np.maximum(h, 0), None)
  val, grad = {"gelu": _gelu, "relu": _relu, "silu": _silu}[name](h)
  return val, (grad, None)


def grouped_mlp(x, w1, w2, sizes, act, b1=None, b2=None, scales=None, dy=None, alpha=1.702, limit=7.0):
  """Forward y, and with dy the gradients {x, w1, w2, b1, b2, scales}, all float64."""
  x, w1, w2 = (np.asarray(a, np.float64) for a in (x, w1, w2))
  M, E = x.shape[0], w1.shape[0]
  off = clamp_sizes(sizes, M)
  y = np.zeros((M, w2.shape[2]))
  grads = {k: np.zeros_like(v) for k, v in (("x", x), ("w1", w1), ("w2", w2))}
  if b1 is not None: grads["b1"] = np.zeros(np.shape(b1))
  if b2 is not None: grads["b2"] = np.zeros(np.shape(b2))
  if scales is not None: grads["scales"] = np.zeros(M)
  for g in range(E):
    r = slice(off[g], off[g + 1])
    h = x[r] @ w1[g] + (np.asarray(b1, np.float64)[g] if b1 is not None else 0)
    val, (dgate, dup) = activation(act, h, alpha, limit)
    # The scale weighs the whole expert output, b2 included: y = s * (act(h) @ w2 + b2).
    s = np.asarray(scales, np.float64)[r, None] if scales is not None else 1.0
    bias2 = np.asarray(b2, np.float64)[g] if b2 is not None else np.zeros(w2.shape[2])
    unscaled = val @ w2[g] + bias2
    y[r] = s * unscaled
    if dy is None:
      continue
    d = np.asarray(dy, np.float64)[r]
    da = (s * d) @ w2[g].T  # gradient of act(h)
    grads["w2"][g] = val.T @ (s * d)
    dh = np.concatenate([da * dgate, da * dup], 1) if dup is not None else da * dgate
    grads["x"][r] = dh @ w1[g].T
    grads["w1"][g] = x[r].T @ dh
    if b1 is not None: grads["b1"][g] = dh.sum(0)
    if b2 is not None: grads["b2"][g] = (s * d).sum(0)
    if scales is not None: grads["scales"][r] = (d * unscaled).sum(1)
  return (y, grads) if dy is not None else y


def ragged_dot(lhs, rhs, sizes):
  lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
  off = clamp_sizes(sizes, lhs.shape[0])
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  for g in range(rhs.shape[0]):
    out[off[g]:off[g + 1]] = lhs[off[g]:off[g + 1]] @ rhs[g]
  return out


def ragged_dot_rhs_grad(lhs, dout, sizes):
  """The gradient of ragged_dot w.r.t. rhs: per group, lhs[rows of g]^T @ dout[rows of g] (zeros for a group
  without rows)."""
  lhs, dout = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
  off = clamp_sizes(sizes, lhs.shape[0])
  return np.stack([lhs[off[g]:off[g + 1]].T @ dout[off[g]:off[g + 1]] for g in range(len(sizes))])
