"""Probe (not a benchmark): what gathering x's rows in FC1's loads costs and saves at the Qwen3 layer's
shape (T 8192 tokens, top-8 of 128 experts, d 2048, f 768, bf16), timed in turn in one process: the MLP's
forward and its fwd+bwd over rows made beforehand ("given"), over rows copied from the tokens by XLA's gather
("copied", what the layer pays with dispatch's copy) and over rows read from the tokens in FC1's loads
(grouped_mlp(x, ..., gather=plan) traced with JAXMLP_GEMM_PATH=cutlass: "gathered"; "gathered in order" with
an identity plan over the given rows), for balanced and skewed routing. GPU only; `auto` picks the GEMM path
of the others, as the layer would (the engine at this shape). --fp8: the same with the tensorwise recipe,
whose forward reads the rows from the tokens in its quantization passes on any GEMM path ("gathered").

  python benchmarks/probes/gather_fc1.py [--rounds 5] [--fp8]
  ncu --clock-control none --kernel-name-base demangled --kernel-name regex:device_kernel -c 4 \
      python benchmarks/probes/gather_fc1.py --once   # FC1 and FC2 given, then gathered: the engine's kernels
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxmlp  # noqa: E402
from jaxmlp import dispatch  # noqa: E402
from kernel_share import traced_on  # noqa: E402
from timing import measure_alternating  # noqa: E402

T, d, E, k, f = 8192, 2048, 128, 8, 768


def routed(skew: float):
  """Top-k experts of random logits, the experts' logits shifted by skew * N(0, 1) (0: balanced)."""
  key = jax.random.split(jax.random.key(1), 2)
  logits = jax.random.normal(key[0], (T, E)) + skew * jax.random.normal(key[1], (E,))
  return jax.lax.top_k(logits, k)[1].astype(jnp.int32)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--once", action="store_true",
                 help="run the balanced forwards given and gathered once each, untimed (for a profiler)")
  p.add_argument("--fp8", action="store_true", help="the tensorwise FP8 recipe (when='always')")
  a = p.parse_args()
  fp8 = jaxmlp.Fp8Recipe("tensorwise", when="always") if a.fp8 else None
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (T, d), jnp.bfloat16)
  w1 = (jax.random.normal(keys[1], (E, d, 2 * f)) * d ** -0.5).astype(jnp.bfloat16)
  w2 = (jax.random.normal(keys[2], (E, f, d)) * f ** -0.5).astype(jnp.bfloat16)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; T {T}, k {k}, E {E}, d {d}, f {f}, fp8 {a.fp8}; "
        f"mlp_forward_path {jaxmlp.backend_info().get('cuda', {}).get('mlp_forward_path')}")
  for routing, skew in (("balanced", 0.0), ("skewed", 1.0)):
    rows, gs, plan = dispatch.dispatch(x, routed(skew), E)
    s = jnp.ones((rows.shape[0],), jnp.bfloat16)
    dy = jax.random.normal(keys[3], rows.shape, jnp.bfloat16)

    def given(rows, w1, w2):  # the MLP alone, over rows made beforehand
      return jaxmlp.grouped_mlp(rows, w1, w2, gs, scales=s, fp8=fp8)

    def copied(x, w1, w2):  # the rows copied from the tokens (XLA's gather; its gradient a combine)
      return jaxmlp.grouped_mlp(dispatch.gather(x, plan), w1, w2, gs, scales=s, fp8=fp8)

    def gathered(x, w1, w2):  # the rows read from the tokens in FC1's loads
      return jaxmlp.grouped_mlp(x, w1, w2, gs, scales=s, fp8=fp8, gather=plan)

    M = rows.shape[0]
    in_order = dispatch.Plan(jnp.arange(M, dtype=jnp.int32)[:, None], jnp.arange(M, dtype=jnp.int32), plan.counts)

    def gathered_in_order(rows, w1, w2):  # the rows themselves, read by the gathered loads (the identity plan)
      return jaxmlp.grouped_mlp(rows, w1, w2, gs, scales=s, fp8=fp8, gather=in_order)

    def step(fn):
      return jax.jit(lambda a, w1, w2: jax.vjp(fn, a, w1, w2)[1](dy))

    if a.once:  # traced_on runs each once
      traced_on("auto", lambda: (jax.jit(given), (rows, w1, w2)))
      traced_on("cutlass", lambda: (jax.jit(gathered), (x, w1, w2)))
      return

    calls = {}
    for name, fn, a0 in (("given", given, rows), ("copied", copied, x), ("gathered", gathered, x),
                         ("gathered in order", gathered_in_order, rows)):
      # Only a forced engine path reads the rows in FC1's loads (`_gemm_path.gathers_in_fc1`); FP8's quantizer
      # reads them on any.
      path = "cutlass" if name.startswith("gathered") and fp8 is None else "auto"
      for part, jitted in (("fwd", jax.jit(fn)), ("step", step(fn))):
        calls[f"{part} {name}"] = (traced_on(path, lambda jitted=jitted, a0=a0: (jitted, (a0, w1, w2)))[0], a0)
    timed = measure_alternating({n: (lambda i, fn=fn, a0=a0: fn(a0, w1, w2)) for n, (fn, a0) in calls.items()},
                                jax.block_until_ready, rounds=a.rounds)
    us = {n: 1e6 * t["s"] for n, t in timed.items()}
    print(f"{routing}: " + ", ".join(f"{n} {v:.1f} us" for n, v in us.items()))
    for part in ("fwd", "step"):
      print(f"  {part}: gathered / given {us[part + ' gathered'] / us[part + ' given']:.3f}x, "
            f"gathered / copied {us[part + ' gathered'] / us[part + ' copied']:.3f}x, "
            f"gathered in order / given {us[part + ' gathered in order'] / us[part + ' given']:.3f}x")


if __name__ == "__main__":
  main()
