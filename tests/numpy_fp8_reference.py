"""The FP8 tensorwise recipe (jaxmlp/fp8.py's docstring) in float64 NumPy, independent of jaxmlp's code.

Quantization to e4m3 through ml_dtypes; products in float64; rounding to the 16-bit dtype where the
recipe rounds (the FC1 output h, the FC2 input gradient da, every result).
"""
import ml_dtypes
import numpy as np

import numpy_reference as ref

E4M3_MAX = 448.0


# The recipe scales in float32: 16-bit data puts many v * 448 / amax exactly on an e4m3 rounding tie, which
# the float32 rounding of the inverse scale then decides (float64 arithmetic would decide them otherwise).
def _quantize(v, amax):
  amax = np.float32(amax)
  inverse = np.float32(E4M3_MAX) / amax if amax > 0 else np.float32(1.0)
  q = np.clip(np.asarray(v, np.float32) * inverse, -E4M3_MAX, E4M3_MAX)
  return q.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _scale(amax):
  return float(np.float32(amax) / np.float32(E4M3_MAX)) if amax > 0 else 1.0


def grouped_mlp(x, w1, w2, sizes, act, scales, dy, dtype):
  """(y, {x, w1, w2, scales} gradients) of the FP8 recipe, as float64 arrays; dtype: the 16-bit ml_dtype."""
  rnd = lambda v: np.asarray(v, np.float64).astype(dtype).astype(np.float64)
  x, w1, w2, dy = (np.asarray(a, np.float64) for a in (x, w1, w2, dy))
  M, E, d = x.shape[0], w1.shape[0], x.shape[1]
  off = ref.clamp_sizes(sizes, M)
  valid = np.arange(M) < off[-1]
  s = np.asarray(scales, np.float64)[:, None] if scales is not None else np.ones((M, 1))
  ax, aw1, aw2 = np.abs(x[valid]).max(initial=0), np.abs(w1).max(), np.abs(w2).max()
  qx, qw1, qw2 = _quantize(x, ax), _quantize(w1, aw1), _quantize(w2, aw2)
  h = np.zeros((M, w1.shape[2]))
  for g in range(E):
    r = slice(off[g], off[g + 1])
    h[r] = rnd(qx[r] @ qw1[g] * (_scale(ax) * _scale(aw1)))
  value, (dgate, dup) = ref.activation(act, h)
  a = np.where(valid[:, None], value * s, 0)
  aa = np.abs(a).max(initial=0)
  qa = _quantize(a, aa)
  dyv = np.where(valid[:, None], dy, 0)
  ady = np.abs(dyv).max(initial=0)
  qdy = _quantize(dyv, ady)
  y, da = np.zeros((M, d)), np.zeros_like(a)
  for g in range(E):
    r = slice(off[g], off[g + 1])
    y[r] = rnd(qa[r] @ qw2[g] * (_scale(aa) * _scale(aw2)))
    da[r] = rnd(qdy[r] @ qw2[g].T * (_scale(ady) * _scale(aw2)))
  dh = da * s * dgate if dup is None else np.concatenate([da * s * dgate, da * s * dup], axis=1)
  dh = np.where(valid[:, None], dh, 0)
  adh = np.abs(dh).max(initial=0)
  qdh = _quantize(dh, adh)
  grads = {"x": np.zeros_like(x), "w1": np.zeros_like(w1), "w2": np.zeros_like(w2)}
  for g in range(E):
    r = slice(off[g], off[g + 1])
    grads["w2"][g] = rnd(qa[r].T @ qdy[r] * (_scale(aa) * _scale(ady)))
    grads["x"][r] = rnd(qdh[r] @ qw1[g].T * (_scale(adh) * _scale(aw1)))
    grads["w1"][g] = rnd(qx[r].T @ qdh[r] * (_scale(ax) * _scale(adh)))
  if scales is not None:
    grads["scales"] = rnd(np.where(valid, (da * value).sum(axis=1), 0))
  return y, grads
