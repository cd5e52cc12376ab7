"""The FP8 recipes (the docstrings of jaxmlp/fp8/tensorwise.py and jaxmlp/fp8/blockwise.py) in float64 NumPy,
independent of jaxmlp's code.

Quantization to e4m3 through ml_dtypes; products in float64; rounding to the 16-bit dtype where the
recipe rounds (the FC1 output h, the FC2 input gradient da, every result).

An implementation computes h, a, da and dh in float32: an element within float32's error of a rounding
boundary (h's and da's 16-bit ones, a's and dh's e4m3 ones and their 16-bit ones for 16-bit weight gradients)
rounds to either neighbour. `nudge` scales such elements by 1 + nudge before the rounding: the model at
+-nudge rounds them away from or toward zero. Values that are float32 numbers take no nudge (the
implementation computes them exactly: relu's a, the blockwise products' sums of e4m3 pairs), nor do the inputs
(the 16-bit dtype, quantized alike by both). a and dh are rounded to float32 before their e4m3 and 16-bit
roundings, as the implementation holds them: an element within half a float32 ulp of a tie lands on it and
rounds to even, which no single nudge of the whole tensor reproduces while another element needs the other.
"""
import ml_dtypes
import numpy as np

import numpy_reference as ref

E4M3_MAX = 448.0


def _nudged(v, nudge, unscaled=None):
  """v * (1 + nudge) where `unscaled` (v before a scale; by default v) is not a float32 number, v elsewhere."""
  v = np.asarray(v, np.float64)
  unscaled = v if unscaled is None else np.asarray(unscaled, np.float64)
  return np.where(unscaled == unscaled.astype(np.float32), v, v * (1 + nudge))


def _nudged_f32(v, nudge):
  """v rounded to float32 (the implementation's a and dh are float32 before their 16-bit rounding, so an
  element that float32 puts on a 16-bit tie rounds to even there), then nudged where v is not a float32
  number."""
  return _nudged(np.asarray(v, np.float32), nudge, v)


# The recipe scales in float32: 16-bit data puts many v * 448 / amax exactly on an e4m3 rounding tie, which
# the float32 rounding of the inverse scale then decides (float64 arithmetic would decide them otherwise).
# Where 448 / amax overflows float32 (amax < 448 / FLOAT32_MAX), the inverse is clamped to the float32
# maximum (as TransformerEngine does) and the scale is its float32 reciprocal, 2^-128.
def _inverse(amax):
  with np.errstate(over="ignore"):
    inverse = np.float32(E4M3_MAX) / np.float32(amax)
  return np.float32(np.finfo(np.float32).max) if np.isinf(inverse) else inverse


def _quantize(v, amax, nudge=0.0):
  amax = np.float32(amax)
  inverse = _inverse(amax) if amax > 0 else np.float32(1.0)
  q = np.clip(_nudged(np.asarray(v, np.float32) * inverse, nudge, v), -E4M3_MAX, E4M3_MAX)
  return q.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _scale(amax):
  if not amax > 0:
    return 1.0
  if _inverse(amax) == np.finfo(np.float32).max:
    return 2.0**-128
  return float(np.float32(amax) / np.float32(E4M3_MAX))


def _bias_grads(grads, off, s, dh, dy, value, da, valid, b1, b2, rnd, nudge):
  """The 16-bit path's bias gradients (sums of unquantized dh, rounded, and of s * dy) and the scales' (with
  b2's term), into grads: the same in both recipes."""
  E = len(off) - 1
  if b1 is not None:
    grads["b1"] = np.stack([rnd(rnd(_nudged_f32(dh[off[g]:off[g + 1]], nudge)).sum(axis=0)) for g in range(E)])
  if b2 is not None:
    grads["b2"] = np.stack([rnd((s * dy)[off[g]:off[g + 1]].sum(axis=0)) for g in range(E)])
  ds = (da * value).sum(axis=1)
  if b2 is not None:
    ds = ds + (dy * _rows_of(b2, off, len(valid))).sum(axis=1)
  return rnd(np.where(valid, ds, 0))


def _rows_of(b, off, M):
  """b [E, n] per row of its group: [M, n], 0 past the groups."""
  out = np.zeros((M, b.shape[1]))
  for g in range(len(off) - 1):
    out[off[g]:off[g + 1]] = b[g]
  return out


def grouped_mlp(x, w1, w2, sizes, act, scales, dy, dtype, b1=None, b2=None, fp8_weight_gradients=True, nudge=0.0,
                delayed=None):
  """(y, {x, w1, w2, scales, b1, b2} gradients) of the FP8 recipe, as float64 arrays; dtype: the 16-bit
  ml_dtype; without fp8_weight_gradients the weight gradients are products of x, a and dh rounded to dtype,
  and dy. delayed: the amaxes [4] x, a, dy and dh are quantized by (delayed scaling: saturating where a value
  is past its amax; their own where it is 0: an empty history), instead of their own; the gradients then hold
  "seen", their own amaxes [4]."""
  by = (lambda i, own: own) if delayed is None else (lambda i, own: float(np.float32(delayed[i])) or own)
  rnd = lambda v: np.asarray(v, np.float64).astype(dtype).astype(np.float64)
  x, w1, w2, dy = (np.asarray(a, np.float64) for a in (x, w1, w2, dy))
  M, E, d = x.shape[0], w1.shape[0], x.shape[1]
  off = ref.clamp_sizes(sizes, M)
  valid = np.arange(M) < off[-1]
  s = np.asarray(scales, np.float64)[:, None] if scales is not None else np.ones((M, 1))
  seen_x, aw1, aw2 = np.abs(x[valid]).max(initial=0), np.abs(w1).max(), np.abs(w2).max()
  ax = by(0, seen_x)
  qx, qw1, qw2 = _quantize(x, ax), _quantize(w1, aw1), _quantize(w2, aw2)
  h = np.zeros((M, w1.shape[2]))
  for g in range(E):
    r = slice(off[g], off[g + 1])
    h[r] = rnd(_nudged(qx[r] @ qw1[g] * (_scale(ax) * _scale(aw1)), nudge))
    if b1 is not None:
      h[r] = rnd(h[r] + b1[g])
  value, (dgate, dup) = ref.activation(act, h)
  a = np.where(valid[:, None], value * s, 0)
  seen_a = np.abs(a).max(initial=0)
  aa = by(1, seen_a)
  qa = _quantize(a, aa, nudge)
  dyv = np.where(valid[:, None], dy, 0)
  seen_dy = np.abs(dyv).max(initial=0)
  ady = by(2, seen_dy)
  qdy = _quantize(dyv, ady)
  y, da = np.zeros((M, d)), np.zeros_like(a)
  for g in range(E):
    r = slice(off[g], off[g + 1])
    y[r] = qa[r] @ qw2[g] * (_scale(aa) * _scale(aw2))
    y[r] = rnd(y[r] + (rnd(s[r] * b2[g]) if b2 is not None else 0))  # one rounding of the product and bias
    da[r] = rnd(_nudged(qdy[r] @ qw2[g].T * (_scale(ady) * _scale(aw2)), nudge))
  dh = da * s * dgate if dup is None else np.concatenate([da * s * dgate, da * s * dup], axis=1)
  dh = np.where(valid[:, None], dh, 0)
  seen_dh = np.abs(dh).max(initial=0)
  adh = by(3, seen_dh)
  qdh = _quantize(dh, adh, nudge)
  grads = {"x": np.zeros_like(x), "w1": np.zeros_like(w1), "w2": np.zeros_like(w2)}
  for g in range(E):
    r = slice(off[g], off[g + 1])
    grads["x"][r] = rnd(qdh[r] @ qw1[g].T * (_scale(adh) * _scale(aw1)))
    if fp8_weight_gradients:
      grads["w2"][g] = rnd(qa[r].T @ qdy[r] * (_scale(aa) * _scale(ady)))
      grads["w1"][g] = rnd(qx[r].T @ qdh[r] * (_scale(ax) * _scale(adh)))
    else:
      grads["w2"][g] = rnd(rnd(_nudged_f32(a[r], nudge)).T @ dyv[r])
      grads["w1"][g] = rnd(x[r].T @ rnd(_nudged_f32(dh[r], nudge)))
  dscales = _bias_grads(grads, off, s, dh, dyv, value, da, valid, b1, b2, rnd, nudge)
  if scales is not None:
    grads["scales"] = dscales
  if delayed is not None:
    grads["seen"] = np.array([seen_x, seen_a, seen_dy, seen_dh])
  return y, grads


# ---- the blockwise recipe (jaxmlp/fp8/blockwise.py) ----------------------------------------------
BLOCK = 128


def _block_scale(amax):
  """The least power of two >= amax / 448 (amax / 448 in float32), 1 where amax is 0 or amax / 448 rounds to 0
  (frexp of 0 gives the exponent 0 in the JAX code and the CUDA kernels)."""
  ratio = float(np.float32(amax) / np.float32(E4M3_MAX))
  return 2.0 ** int(np.ceil(np.log2(ratio))) if ratio > 0 else 1.0


def _quantize_block(v, nudge=0.0):
  """A block v quantized and dequantized with its own power-of-two scale, in float64. As in _quantize, v is
  rounded to float32 before its e4m3 rounding: an element whose float32 value lies on an e4m3 tie (gelu(5.75)
  is 5.75 in float32, 368 = 5.75 / 2^-6 a tie between 352 and 384) rounds to even there, as the
  implementation's does, not by its float64 value's side of the tie."""
  scale = _block_scale(np.abs(v).max(initial=0))
  scaled = np.asarray(v, np.float32).astype(np.float64) / scale
  q = np.clip(_nudged(scaled, nudge, v), -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  return q * scale


def _rows_1x128(v, nudge=0.0):
  out = np.zeros_like(v)
  for r in range(v.shape[0]):
    for c in range(0, v.shape[1], BLOCK):
      out[r, c:c + BLOCK] = _quantize_block(v[r, c:c + BLOCK], nudge)
  return out


def _weights_128x128(w):
  out = np.zeros_like(w)
  for g in range(w.shape[0]):
    for i in range(0, w.shape[1], BLOCK):
      for j in range(0, w.shape[2], BLOCK):
        out[g, i:i + BLOCK, j:j + BLOCK] = _quantize_block(w[g, i:i + BLOCK, j:j + BLOCK])
  return out


def _group_columns_128x1(v, start, end, nudge=0.0):
  """v's rows start..end quantized in 128 x 1 blocks counted from the group's first row."""
  out = np.zeros((end - start, v.shape[1]))
  for r in range(start, end, BLOCK):
    stop = min(r + BLOCK, end)
    for c in range(v.shape[1]):
      out[r - start:stop - start, c] = _quantize_block(v[r:stop, c], nudge)
  return out


def blockwise_grouped_mlp(x, w1, w2, sizes, act, scales, dy, dtype, b1=None, b2=None, fp8_weight_gradients=True,
                          nudge=0.0):
  """(y, {x, w1, w2, scales, b1, b2} gradients) of the blockwise FP8 recipe, as float64 arrays; without
  fp8_weight_gradients the weight gradients are products of x, a and dh rounded to dtype, and dy."""
  rnd = lambda v: np.asarray(v, np.float64).astype(dtype).astype(np.float64)
  x, w1, w2, dy = (np.asarray(a, np.float64) for a in (x, w1, w2, dy))
  M, E, d = x.shape[0], w1.shape[0], x.shape[1]
  off = ref.clamp_sizes(sizes, M)
  valid = (np.arange(M) < off[-1])[:, None]
  s = np.asarray(scales, np.float64)[:, None] if scales is not None else np.ones((M, 1))
  x, dy = np.where(valid, x, 0), np.where(valid, dy, 0)
  qw1, qw2 = _weights_128x128(w1), _weights_128x128(w2)
  qx = _rows_1x128(x)
  h = np.zeros((M, w1.shape[2]))
  for g in range(E):
    r = slice(off[g], off[g + 1])
    h[r] = rnd(_nudged(qx[r] @ qw1[g], nudge))
    if b1 is not None:
      h[r] = rnd(h[r] + b1[g])
  value, (dgate, dup) = ref.activation(act, h)
  a = np.where(valid, value * s, 0)
  qa, qdy = _rows_1x128(a, nudge), _rows_1x128(dy)
  y, da = np.zeros((M, d)), np.zeros_like(a)
  for g in range(E):
    r = slice(off[g], off[g + 1])
    y[r] = rnd(qa[r] @ qw2[g])
    if b2 is not None:  # the product rounded first, then with the bias
      y[r] = rnd(y[r] + rnd(s[r] * b2[g]))
    da[r] = rnd(_nudged(qdy[r] @ qw2[g].T, nudge))
  dh = da * s * dgate if dup is None else np.concatenate([da * s * dgate, da * s * dup], axis=1)
  dh = np.where(valid, dh, 0)
  qdh = _rows_1x128(dh, nudge)
  grads = {"x": np.zeros_like(x), "w1": np.zeros_like(w1), "w2": np.zeros_like(w2)}
  for g in range(E):
    r = slice(off[g], off[g + 1])
    column = lambda v, nudge=0.0: _group_columns_128x1(v, off[g], off[g + 1], nudge)
    grads["x"][r] = rnd(qdh[r] @ qw1[g].T)
    if fp8_weight_gradients:
      grads["w2"][g] = rnd(column(a, nudge).T @ column(dy))
      grads["w1"][g] = rnd(column(x).T @ column(dh, nudge))
    else:
      grads["w2"][g] = rnd(rnd(_nudged_f32(a[r], nudge)).T @ dy[r])
      grads["w1"][g] = rnd(x[r].T @ rnd(_nudged_f32(dh[r], nudge)))
  dscales = _bias_grads(grads, off, s, dh, dy, value, da, valid[:, 0], b1, b2, rnd, nudge)
  if scales is not None:
    grads["scales"] = dscales
  return y, grads
