#!/usr/bin/env bash
# One GPU lease in one call: build, tests, memcheck, benchmark; a short summary last.
#   bash benchmarks/gpu_session.sh test [TESTS]  build + the tests (default: all, the README's command) +
#                                               compute-sanitizer memcheck (MEMCHECK="fp8 dispatch": only those, MEMCHECK= none;
#                                               fp8_cutlass: the FP8 recipes with JAXMLP_GEMM_PATH=cutlass)
#   bash benchmarks/gpu_session.sh bench ARGS    build + benchmarks/bench.py ARGS
# A staged cuBLAS (../shared/device/stage_cublas.py) whose parts were copied to /tmp/jaxmlp-cublas is
# unpacked first, and wheels carried in .whl installed (`pip download --python-version 3.12 ... -d .whl
# scipy-openblas32`).
#   bash benchmarks/gpu_session.sh moe_layer ARGS  build + benchmarks/moe_layer.py ARGS (the MoE layer's parts)
#   bash benchmarks/gpu_session.sh expert_parallel ARGS  build + the GPUs' links, benchmarks/moe_expert_parallel.py
#                                               ARGS and jaxmlp-train-moe --expert-parallel over all GPUs
#   bash benchmarks/gpu_session.sh quantizers ARGS build + benchmarks/fp8_quantizers.py ARGS (blockwise quantizers)
#   bash benchmarks/gpu_session.sh kernels ARGS    build + Nsight Compute times of each kernel of a step
#                                               (benchmarks/kernel_share.py ARGS, e.g. `dsv3 balanced fp8`)
#   bash benchmarks/gpu_session.sh probe SCRIPT ARGS  build + python3 SCRIPT ARGS (benchmarks/probes/)
# SKIP_BUILD=1: use the jaxmlp this machine already has (an earlier call's build). JAXMLP_CUDA=pip: build with
# the CUDA compiler wheels installed in this Python (the README's GPU install) instead of the system toolkit.
# Logs go to $OUT (the device tool brings that folder back) or /tmp/jaxmlp-session.
set -uo pipefail
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16
OUT=${OUT:-/tmp/jaxmlp-session}; mkdir -p "$OUT"
what=${1:-test}; shift || true

# Wheels the GPU image lacks (it has no package registry), carried in .whl: scipy-openblas32, which the
# CPU handlers build against.
ls .whl/*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
for tool in .device/*/tool/unpack_cublas.py; do
  [ -e "$tool" ] && ls /tmp/jaxmlp-cublas/part* > /dev/null 2>&1 && python3 "$tool" | tail -2
done
# Hopper only on the GPU machine (90a: the tiled kernel's wgmma): a quarter of the build time.
[ -n "${SKIP_BUILD:-}" ] || CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90a-real -DJAXMLP_CUDA=${JAXMLP_CUDA:-ON}" \
  python3 -m pip install --no-build-isolation --no-deps -q . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
python3 -P - <<'PY' | tee "$OUT/backend_info.json"
import json, jaxmlp
print(json.dumps(jaxmlp.backend_info(), indent=1, default=str))
PY

if [ "$what" = test ]; then
  # Tests start JAX in subprocesses too: leave them GPU memory. (Not for the benchmark, where
  # jax.lax.ragged_dot's autotuning then runs out of memory.)
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  # Every test, not only the GPU ones: the CPU tests meet a GPU's defaults here (XLA's TF32 products).
  python3 -P -m pytest -q -p no:cacheprovider -rs "${@:-tests}" 2>&1 | tee "$OUT/pytest.log" | tail -25
  # memcheck: every path, adversarial and skewed group sizes, forward and backward.
  memcheck=" ${MEMCHECK-fallback grouped cutlass fused tiled fp8 fp8_cutlass dispatch} "
  for path in $(echo $memcheck | tr ' ' '\n' | grep -v dispatch); do
    case $path in fp8) available=fp8_available ;; fused) available=cutlass_available ;;
      fp8_cutlass) available="fp8_available cutlass_available" ;; *) available=${path}_available ;; esac
    missing=$(for a in $available; do grep -q "\"$a\": true" "$OUT/backend_info.json" || echo $a; done)
    if [ $path != fallback ] && [ -n "$missing" ]; then
      echo "memcheck $path: skipped, unavailable here (backend_info)" | tee -a "$OUT/summary.txt"; continue
    fi
    # JAXMLP_FP8_WHEN=always: these small shapes would otherwise run the FP8 recipes in bf16 (Fp8Recipe.when).
    gemm_path=${path#fp8_}; [ $path = fp8 ] && gemm_path=grouped
    JAXMLP_GEMM_PATH=$gemm_path JAXMLP_FP8=$([ ${path%_cutlass} = fp8 ] && echo 1) \
      JAXMLP_FP8_WHEN=always XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 300 \
      compute-sanitizer --tool memcheck --error-exitcode 9 python3 -P - > "$OUT/memcheck-$path.log" 2>&1 <<'PY'
import os, jax, jax.numpy as jnp, numpy as np, jaxmlp
rng = np.random.default_rng(1)
if os.environ.get("JAXMLP_FP8"):  # FP8: adversarial and skewed sizes, forward and backward, with scales and biases
  for d, f, sizes in ((64, 96, [100, -7, 2**31 - 1, 0]), (64, 96, [0, 0, 0, 0]), (32, 48, [50, 0, 20, 1]),
                      (64, 96, [*rng.integers(-5, 3, 300), 2**31 - 1, 7])):
    M, E = 256, len(sizes)
    x = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((E, d, 2 * f)), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((E, f, d)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    b1, b2 = jnp.ones((E, 2 * f), jnp.bfloat16), jnp.ones((E, d), jnp.bfloat16)
    for recipe in ("tensorwise", "blockwise", *(jaxmlp.Fp8Recipe(name, fp8_weight_gradients=False)
                                                for name in ("tensorwise", "blockwise"))):
      g = jax.grad(lambda x, w1, w2, s: jaxmlp.grouped_mlp(x, w1, w2, gs, scales=s, fp8=recipe)
                   .astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))(x, w1, w2, x[:, 0])
      biased = jax.grad(lambda x, w1, w2, s, b1, b2: jaxmlp.grouped_mlp(x, w1, w2, gs, scales=s, b1=b1, b2=b2, fp8=recipe)
                        .astype(jnp.float32).sum(), argnums=(0, 1, 2, 3, 4, 5))(x, w1, w2, x[:, 0], b1, b2)
      jax.block_until_ready((g, biased))
    # Delayed scaling: the passes that quantize by the history's amaxes and observe their own (x and a), and
    # those for an empty history (dy and dh: their own amaxes first).
    for wgrad in (True, False):
      late = jaxmlp.Fp8Recipe("tensorwise", scaling="delayed", fp8_weight_gradients=wgrad)
      jax.block_until_ready(jax.grad(
          lambda x, w1, w2, s, h: jaxmlp.grouped_mlp(x, w1, w2, gs, scales=s, b1=b1, b2=b2, fp8=late, fp8_history=h)
          .astype(jnp.float32).sum(), argnums=(0, 1, 2, 3, 4))(x, w1, w2, x[:, 0],
                                                                jnp.asarray([[1, 1], [1, 1], [0, 0], [0, 0]], jnp.float32)))
    # Rows read from 100 tokens by a plan whose slot_of_row holds anything (the tensorwise forward's passes).
    slots = jnp.asarray(np.r_[rng.integers(-3, 230, M - 3), 2**31 - 1, -2**31, 199], jnp.int32)
    plan = jaxmlp.dispatch.Plan(jnp.zeros((100, 2), jnp.int32), slots, jnp.zeros(E, jnp.int32))
    jax.block_until_ready(jax.grad(lambda t, w1: jaxmlp.grouped_mlp(t, w1, w2, gs, gather=plan, fp8="tensorwise")
                                   .astype(jnp.float32).sum(), argnums=(0, 1))(x[:100], w1))
    late = jaxmlp.Fp8Recipe("tensorwise", scaling="delayed")  # FP8 weight gradients: the tokens read in place
    jax.block_until_ready(jax.grad(lambda t, w1, h: jaxmlp.grouped_mlp(t, w1, w2, gs, gather=plan, fp8=late,
                                                                       fp8_history=h).astype(jnp.float32).sum(),
                                   argnums=(0, 1, 2))(x[:100], w1, jnp.zeros((4, 3), jnp.float32)))
  # The optimizer steps that write the FP8 weights (fp8_adam_step, both recipes), tiles cut short by K and N.
  from typing import NamedTuple
  class State(NamedTuple):
    count: jax.Array
    mu: jax.Array
    nu: jax.Array
  w = jnp.asarray(rng.standard_normal((3, 144, 272)), jnp.float32)
  state = State(jnp.int32(0), jnp.zeros_like(w), jnp.zeros_like(w))
  for fp8 in ("blockwise", jaxmlp.fp8_weights(w, "tensorwise", jnp.bfloat16)):
    jax.block_until_ready(jaxmlp.fp8_adam_step(w, w.astype(jnp.bfloat16), state, learning_rate=1e-3, fp8=fp8))
  print("memcheck run done")
  raise SystemExit
# The fourth case spans two passes of the block scans (256 groups each); the fifth and sixth take the CUTLASS
# engine's activation epilogues (f a multiple of 64: FC1's, b1 added in `g` and `ungated`; the sixth FC2's
# data gradient's too, gated and ungated, d = 7168, its last tile half full); the last is the host-overhead
# layer, which takes the tiled path by itself.
for d, f, sizes in ((64, 96, [100, -7, 2**31 - 1, 0]), (64, 96, [0, 0, 0, 0]), (64, 96, [50, 0, 20, 1]),
                    (64, 96, [*rng.integers(-5, 3, 300), 2**31 - 1, 7]), (64, 128, [100, -7, 2**31 - 1, 0]),
                    (7168, 192, [3, 130, 0, 2**31 - 1]), (256, 512, [200, 0, 56, 0, 0, 0, 0, 0])):
  M, E = 256, len(sizes)
  x = jnp.asarray(rng.standard_normal((M, d)), jnp.bfloat16)
  w1 = jnp.asarray(rng.standard_normal((E, d, 2 * f)), jnp.bfloat16)
  w2 = jnp.asarray(rng.standard_normal((E, f, d)), jnp.bfloat16)
  b1, b2 = jnp.ones((E, 2 * f), jnp.bfloat16), jnp.ones((E, d), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  g = jax.grad(lambda x, w1, w2, b1, b2: jaxmlp.grouped_mlp(x, w1, w2, gs, b1=b1, b2=b2, scales=x[:, 0])
               .astype(jnp.float32).sum(), argnums=(0, 1, 2, 3, 4))(x, w1, w2, b1, b2)
  plain = jax.grad(lambda x, w1: jaxmlp.grouped_mlp(x, w1, w2, gs).astype(jnp.float32).sum(), argnums=(0, 1))(x, w1)
  ungated = jax.grad(lambda x, w1: jaxmlp.grouped_mlp(x, w1, w2, gs, activation="gelu", b1=b1[:, :f], scales=x[:, 0])
                     .astype(jnp.float32).sum(), argnums=(0, 1))(x, w1[:, :, :f])
  r = jax.grad(lambda a, b: jaxmlp.ragged_dot(a, b, gs).astype(jnp.float32).sum(), argnums=(0, 1))(x, w1)
  # Rows gathered from 100 tokens by a plan whose slot_of_row holds anything (FC1's loads on the engine).
  slots = jnp.asarray(np.r_[rng.integers(-3, 230, M - 3), 2**31 - 1, -2**31, 199], jnp.int32)
  plan = jaxmlp.dispatch.Plan(jnp.asarray(rng.integers(-1, M, (100, 2)), jnp.int32), slots, jnp.zeros(E, jnp.int32))
  gathered = jax.grad(lambda t, w1: jaxmlp.grouped_mlp(t, w1, w2, gs, b1=b1, gather=plan).astype(jnp.float32).sum(),
                      argnums=(0, 1))(x[:100], w1)
  jax.block_until_ready((g, plain, ungated, r, gathered))
print("memcheck run done")
PY
    echo "memcheck $path: exit $? ($(grep -c 'Invalid\|ERROR SUMMARY: [1-9]' "$OUT/memcheck-$path.log") error lines)" | tee -a "$OUT/summary.txt"
    grep "ERROR SUMMARY" "$OUT/memcheck-$path.log"
  done
  # memcheck of the router's top-k, the dispatch and the combine: expert ids out of range, drops, padding,
  # a plan made by hand.
  [[ "$memcheck" == *" dispatch "* ]] && XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 300 \
    compute-sanitizer --tool memcheck --error-exitcode 9 python3 -P - > "$OUT/memcheck-dispatch.log" 2>&1 <<'PY'
import jax, jax.numpy as jnp, numpy as np
from jaxmlp import dispatch as D
rng = np.random.default_rng(1)
for T, k, E, d, capacity, pad_to in ((3000, 4, 16, 256, 500, 128), (5, 2, 3, 21, None, 1), (700, 8, 1536, 64, 2, 16)):
  x = jnp.asarray(rng.standard_normal((T, d)), jnp.bfloat16)
  experts = jnp.asarray(rng.integers(-2**31, 2**31 - 1, (T, k)) % (E + 9) - 4, jnp.int32)  # some out of range
  w = jnp.asarray(rng.random((T, k)), jnp.float32)
  def loss(x, w):
    rows, _, plan = D.dispatch(x, experts, E, capacity=capacity, pad_to=pad_to)
    return (D.combine(rows, plan, w).astype(jnp.float32).sum() + D.combine(rows, plan).astype(jnp.float32).sum()
            + D.row_weights(w, plan).sum())
  jax.block_until_ready(jax.grad(loss, argnums=(0, 1))(x, w))
bad = D.Plan(jnp.asarray([[0, 2**30], [-7, 3]], jnp.int32), jnp.asarray([0, 99, -5, 3], jnp.int32), jnp.zeros(2, jnp.int32))
rows = jnp.ones((4, 8), jnp.bfloat16)
jax.block_until_ready(jax.grad(lambda r, w: D.combine(r, bad, w).astype(jnp.float32).sum(), argnums=(0, 1))(
    rows, jnp.ones((2, 2), jnp.float32)))
for T, E, k in ((8192, 128, 8), (3, 1, 1), (5, 1000, 1000), (77, 33, 32)):
  jax.block_until_ready(D.top_k(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), k))
print("memcheck run done")
PY
  [[ "$memcheck" == *" dispatch "* ]] && echo "memcheck dispatch: exit $? ($(grep -c 'Invalid\|ERROR SUMMARY: [1-9]' "$OUT/memcheck-dispatch.log") error lines)" | tee -a "$OUT/summary.txt"
  grep -s "ERROR SUMMARY" "$OUT/memcheck-dispatch.log"
  grep -E "passed|failed" "$OUT/pytest.log" | tail -1 | tee -a "$OUT/summary.txt"
elif [ "$what" = kernels ]; then
  # (A script's own folder leads sys.path, not the current one: the installed jaxmlp is imported.)
  csv="$OUT/ncu-$(echo "$@" | tr ' ' '-').csv"
  # No preallocation: under ncu, XLA's 75% of the GPU's memory failed to allocate now and then and the
  # process died (segmentation fault) before the first step.
  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \
    python3 benchmarks/kernel_share.py "$@" > "$csv" 2> "$OUT/ncu.log" \
    && { echo "kernels of a step: $*"; python3 benchmarks/kernel_share.py --summarize "$csv"; } | tee -a "$OUT/summary.txt"
elif [ "$what" = moe_layer ]; then
  python3 benchmarks/moe_layer.py --out "$OUT" "$@" 2>&1 | tee "$OUT/moe_layer.log" | tail -40
elif [ "$what" = expert_parallel ]; then
  nvidia-smi topo -m | tee "$OUT/topology.txt"
  python3 benchmarks/moe_expert_parallel.py --out "$OUT" "$@" 2>&1 | tee "$OUT/moe_expert_parallel.log" | tail -14
  jaxmlp-train-moe --expert-parallel --impl jaxmlp 2>&1 | tee "$OUT/train_moe_ep.log" | tail -8
elif [ "$what" = probe ]; then
  python3 "$@" 2>&1 | tee "$OUT/probe.log" | tail -30
elif [ "$what" = quantizers ]; then
  python3 benchmarks/fp8_quantizers.py "$@" 2>&1 | tee "$OUT/fp8_quantizers.log" | tail -20
else
  python3 benchmarks/bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
