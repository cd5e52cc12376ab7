"""e4m3 or e5m2 for the gradients of the tensorwise recipe: the backward's error with each format.

One expert's SwiGLU MLP in float64 (the format's effect does not depend on the grouping): the forward
quantizes x, w1, a, w2 to e4m3 with one current scale per tensor, as jaxmlp's tensorwise recipe does; the
backward quantizes dy and dh to FORMAT with their own current scales. Reported: ||g - g_exact|| / ||g_exact||
for dx, dw1, dw2 against the same backward without any quantization, for normal output gradients and for
heavy-tailed ones (Student's t, 2 degrees of freedom: a few elements far above the rest, where e5m2's
range could matter), medians over seeds.

  python benchmarks/probes/fp8_gradient_format.py
"""
import ml_dtypes
import numpy as np

FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def quantize(v, fmt):
  dtype, top = FORMATS[fmt]
  scale = top / np.max(np.abs(v))
  return np.clip(v * scale, -top, top).astype(dtype).astype(np.float64) / scale


def swiglu_and_grads(h, f):
  g, u = h[:, :f], h[:, f:]
  sig = 1 / (1 + np.exp(-g))
  silu = g * sig
  return silu * u, u * (sig + g * sig * (1 - sig)), silu  # a, d a / d gate, d a / d up


def backward(x, w1, w2, dy, f, forward_fp8, grad_fmt):
  """(dx, dw1, dw2), the forward's operands in e4m3 or not, the gradients in grad_fmt or not (None)."""
  q = lambda v, fmt: quantize(v, fmt) if fmt else v
  fwd = "e4m3" if forward_fp8 else None
  xq, w1q, w2q = q(x, fwd), q(w1, fwd), q(w2, fwd)
  h = xq @ w1q
  a, dgate, dup = swiglu_and_grads(h, f)
  aq = q(a, fwd)
  dyq = q(dy, grad_fmt)
  da = dyq @ w2q.T
  dhq = q(np.concatenate([da * dgate, da * dup], axis=1), grad_fmt)
  return dhq @ w1q.T, xq.T @ dhq, aq.T @ dyq


def main(M=2048, d=512, f=256, seeds=5):
  rel = lambda got, want: np.linalg.norm(got - want) / np.linalg.norm(want)
  print(f"M={M}, d={d}, f={f}, SwiGLU, forward in e4m3; relative error of each gradient against no quantization "
        f"at all, median of {seeds} seeds\n")
  print(f"| output gradient | gradients in | dx | dw1 | dw2 |\n|---|---|---|---|---|")
  for kind in ("normal", "student-t (2)"):
    errors = {fmt: [] for fmt in (*FORMATS, None)}
    for seed in range(seeds):
      rng = np.random.default_rng(seed)
      x = rng.standard_normal((M, d))
      w1 = rng.standard_normal((d, 2 * f)) / np.sqrt(d)
      w2 = rng.standard_normal((f, d)) / np.sqrt(f)
      dy = rng.standard_normal((M, d)) if kind == "normal" else rng.standard_t(2, (M, d))
      exact = backward(x, w1, w2, dy, f, False, None)
      for fmt in errors:
        errors[fmt].append([rel(g, e) for g, e in zip(backward(x, w1, w2, dy, f, True, fmt), exact)])
    for fmt, e in errors.items():
      med = np.median(np.asarray(e), axis=0)
      print(f"| {kind} | {fmt or 'float64 (forward alone)'} | " + " | ".join(f"{v:.4f}" for v in med) + " |")


if __name__ == "__main__":
  main()
