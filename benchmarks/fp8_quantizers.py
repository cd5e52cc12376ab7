"""Times the blockwise FP8 recipe's quantizers, and the tensorwise recipe's weight quantizer, alone at one MLP
shape: their JAX code (what XLA makes of jaxmlp/fp8/blockwise.py and jaxmlp/fp8/tensorwise.py) and, on a GPU,
jaxmlp's CUDA kernels (jaxmlp/fp8/cuda.py's custom calls), with the
bandwidth each reaches (bytes read and written over the time); the CUDA results are checked bit for bit
against the JAX ones first (the activations' up to act's last bit, adam's up to XLA's fused multiply-adds:
the share of equal bits). Also adam's step of the master weights with their quantization (fp8_adam_step,
both recipes), and XLA's adam alone.

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
import jaxmlp
from jaxmlp._groups import Groups
from jaxmlp.fp8 import adam as fp8_adam, blockwise, cuda as fp8_cuda, tensorwise
from jaxmlp.fp8.quantize import rounded_first


def median_ms(fn, *args, repeats: int = 7) -> float:
  fn = jax.jit(fn)
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * sorted(times)[repeats // 2]


def donated_ms(fn, *args, repeats: int = 7) -> float:
  """median_ms of an adam step fn(w, g, mu, nu, scalars, ...) -> (w, mu, nu, ...) that donates w, mu and nu
  and runs on the last call's (in place, as a training loop's update)."""
  fn = jax.jit(fn, donate_argnums=(0, 2, 3))
  w, g, mu, nu, *rest = args
  state = tuple(jnp.copy(v) for v in (w, mu, nu))
  times = []
  for _ in range(repeats + 1):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(state[0], g, state[1], state[2], *rest))
    times.append(time.perf_counter() - start)
    state = out[:3]
  return 1e3 * sorted(times[1:])[repeats // 2]


def to_bf16(quantize_weights):
  """A weight quantizer (w, dtype) (Implementation.quantize_weights) of w rounded to bfloat16."""
  return lambda w: quantize_weights(w, jnp.bfloat16)


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
  w1_master = jax.random.normal(key, (E, d, 2 * f), jnp.float32)  # an optimizer's float32 weights
  w1 = w1_master.astype(jnp.bfloat16)
  sizes = jnp.asarray(cases.group_sizes("balanced", E, M), jnp.int32)
  gpu = jax.default_backend() == "gpu"
  cuda = fp8_cuda.BLOCKWISE_PRIMITIVES
  h = jax.random.normal(key, (M, 2 * f), jnp.bfloat16)  # FC1's output and da: bfloat16, as cuBLAS writes them
  da = jax.random.normal(key, (M, f), jnp.bfloat16)
  groups, swiglu = Groups.of(sizes, M), jaxmlp.Activation("swiglu")
  # (name, JAX quantizer, CUDA quantizer, operands, GB read and written). The activations' JAX form is the
  # XLA fusion that computes them in float32 and the quantizer of that; the CUDA form computes them inside
  # the quantizer.
  both = (lambda v: blockwise.quantize_rows_and_columns(v, groups),
          lambda v: cuda.quantize_rows_and_columns(v, groups))
  act = (lambda h: blockwise.activation_rows_and_columns(h, None, groups, swiglu),
         lambda h: cuda.activation_rows_and_columns(h, None, groups, swiglu))
  act_grad = (lambda h, da: blockwise.activation_grad_rows_and_columns(h, da, None, groups, swiglu),
              lambda h, da: cuda.activation_grad_rows_and_columns(h, da, None, groups, swiglu))
  spans = int(jnp.sum(blockwise.padded_sizes(groups)))  # the columns written: the groups', each to 128
  quantized = lambda v: v.size + v.shape[1] * spans  # bytes of e4m3 rows and columns
  runs = [("rows + columns of x", *both, (x,), x.nbytes + quantized(x)),
          ("rows + columns of dh", *both, (dh,), dh.nbytes + quantized(dh)),
          ("a = swiglu(h)", *act, (h,), h.nbytes + quantized(da)),
          ("dh of swiglu(h), da", *act_grad, (h, da), h.nbytes + da.nbytes + quantized(h)),
          ("weights w1 (bf16)", blockwise.quantize_weights, to_bf16(fp8_cuda.block_weights), (w1,),
           w1.nbytes + 2 * w1.size),
          # float32 master weights rounded to bfloat16: by XLA, then the quantizer (JAX), or in the kernel
          ("weights w1 (f32)", to_bf16(rounded_first(blockwise.quantize_weights)), to_bf16(fp8_cuda.block_weights),
           (w1_master,), w1_master.nbytes + 2 * w1.size),
          # one scale for the tensor: a pass for its amax, then one for both e4m3 layouts
          ("tensorwise w1 (bf16)", tensorwise.quantize_weights, to_bf16(fp8_cuda.tensor_weights), (w1,),
           2 * w1.nbytes + 2 * w1.size)]
  # adam's step of the float32 master weights, then their quantization: optax's operations (fp8_adam_step's
  # CPU code: XLA's fused update, then the quantizer), or the one CUDA kernel. Read w, the bfloat16 gradient
  # g, mu, nu, write w, mu, nu and both e4m3 layouts.
  adam_args = (w1_master, w1 * 1e-3, w1_master * 1e-2, jnp.abs(w1_master) * 1e-4,
               jnp.array([-1e-4, 0.1, 1e-3], jnp.float32))
  hyper = fp8_adam.Hyperparameters(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.0)
  adam = (lambda *a: fp8_adam._block_step(*a, hyper=hyper, dtype=jnp.bfloat16),
          lambda *a: fp8_cuda.block_adam(*a, hyper=hyper, dtype=jnp.bfloat16))
  runs.append(("adam + weights w1", *adam, adam_args, 28 * w1.size))
  # The same, tensorwise: quantized by a given (the last weights') maximum, the new maximum reduced on the way.
  tensor_adam = (lambda *a: fp8_adam._tensor_step(*a, hyper=hyper, dtype=jnp.bfloat16),
                 lambda *a: fp8_cuda.tensor_adam(*a, hyper=hyper, dtype=jnp.bfloat16))
  runs.append(("adam + tensorwise w1", *tensor_adam, adam_args + (jnp.max(jnp.abs(w1)).astype(jnp.float32),),
               28 * w1.size))
  # adam's pass alone (its quantization's outputs unused: XLA drops it), what any optimizer step pays: the
  # kernel's time over this one is what its quantization costs. JAX only.
  adam_alone = lambda *a: adam[0](*a)[:3]
  runs.append(("adam alone (XLA)", adam_alone, None, adam_args, 26 * w1.size))
  print(f"{args.shape} (E={E}, d={d}, f={f}, M={M}) on {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print(f"{'quantizer':<22}{'JAX ms':>9}{'GB/s':>8}" + (f"{'CUDA ms':>10}{'GB/s':>8}  same bits" if gpu else ""))
  for name, jax_fn, cuda_fn, operands, nbytes in runs:
    timed = donated_ms if jax_fn in (adam[0], tensor_adam[0], adam_alone) else median_ms
    line = f"{name:<22}{(t := timed(jax_fn, *operands)):>9.3f}{nbytes / t / 1e6:>8.0f}"
    if gpu and cuda_fn is not None:
      # Of the rows-and-columns quantizers, what the products read (the kernels leave the rest unwritten).
      read = (lambda out: blockwise.read_by_products(out, groups)) if len(operands[0].shape) == 2 else (lambda out: out)
      pairs = list(zip(jax.tree.leaves(read(jax.jit(cuda_fn)(*operands))),
                       jax.tree.leaves(read(jax.jit(jax_fn)(*operands)))))
      same = sum(np.sum(bits(g) == bits(w)) for g, w in pairs) / sum(g.size for g, _ in pairs)
      line += f"{(t := timed(cuda_fn, *operands)):>10.3f}{nbytes / t / 1e6:>8.0f}  {same:.4%}"
    print(line, flush=True)


if __name__ == "__main__":
  main()
