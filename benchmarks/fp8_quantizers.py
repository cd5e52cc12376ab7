"""Times the blockwise FP8 recipe's quantizers alone at one MLP shape: its JAX code (what XLA makes of
jaxmlp/fp8_blockwise.py) and, on a GPU, jaxmlp's CUDA kernels (ffi/cuda/fp8_block_quantize.cu), with the
bandwidth each reaches (bytes read and written over the time); the CUDA results are checked bit for bit
against the JAX ones first.

  python benchmarks/fp8_quantizers.py                 # dsv3 (E=32, d=7168, f=2048, M=32768), balanced
  python benchmarks/fp8_quantizers.py --shape 8x512x256x2048
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import cases
from jaxmlp import fp8_blockwise, fp8_mlp


def median_ms(fn, *args, repeats: int = 7) -> float:
  fn = jax.jit(fn)
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * sorted(times)[repeats // 2]


def bits(a) -> np.ndarray:
  return np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1 else np.asarray(a)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", default="dsv3", help="a benchmark shape name or ExdxfxM")
  args = parser.parse_args()
  shape = cases.shape_named(args.shape)
  E, d, f, M = shape.E, shape.d, shape.f, shape.M
  key = jax.random.key(0)
  x = jax.random.normal(key, (M, d), jnp.bfloat16)  # x and dy: bfloat16
  dh = jax.random.normal(key, (M, 2 * f), jnp.float32)  # a and dh: float32, as XLA makes them
  w1 = jax.random.normal(key, (E, d, 2 * f), jnp.bfloat16)
  sizes = jnp.asarray(cases.group_sizes("balanced", E, M), jnp.int32)
  L = fp8_blockwise.padded_length(M, E)
  gpu = jax.default_backend() == "gpu"
  cuda = fp8_mlp._CUDA_BLOCKWISE
  # (name, JAX quantizer, CUDA quantizer, operand, bytes written per element of the operand)
  both = (lambda v: fp8_blockwise.quantize_rows_and_columns(v, sizes),
          lambda v: cuda.quantize_rows_and_columns(v, sizes), 1 + L / M)
  runs = [("rows + columns of x", *both[:2], x, both[2]), ("rows + columns of dh", *both[:2], dh, both[2]),
          ("weights w1 (bf16)", fp8_blockwise.quantize_weights, cuda.quantize_weights, w1, 2)]
  print(f"{args.shape} (E={E}, d={d}, f={f}, M={M}) on {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print(f"{'quantizer':<22}{'JAX ms':>9}{'GB/s':>8}" + (f"{'CUDA ms':>10}{'GB/s':>8}  bit-exact" if gpu else ""))
  for name, jax_fn, cuda_fn, v, written in runs:
    gigabytes = v.size * (v.dtype.itemsize + written) / 1e9
    line = f"{name:<22}{(t := median_ms(jax_fn, v)):>9.3f}{gigabytes / t * 1e3:>8.0f}"
    if gpu:
      same = all(np.array_equal(bits(g), bits(w)) for g, w in zip(jax.tree.leaves(jax.jit(cuda_fn)(v)),
                                                                   jax.tree.leaves(jax.jit(jax_fn)(v))))
      line += f"{(t := median_ms(cuda_fn, v)):>10.3f}{gigabytes / t * 1e3:>8.0f}  {same}"
    print(line, flush=True)


if __name__ == "__main__":
  main()
