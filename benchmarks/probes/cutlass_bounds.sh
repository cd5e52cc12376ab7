#!/bin/bash
# Builds and runs cutlass_bounds.cu (see its header) at the benchmark shapes: one object per op, side by side.
# CUTLASS=<cutlass_library/source> overrides the headers' location (default: the installed nvidia-cutlass).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT_DIR:-/tmp/cutlass_bounds}
mkdir -p "$out"
cutlass=${CUTLASS:-$(python3 -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))')}
flags=(-O3 -DNDEBUG -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I"$cutlass/include" -I"$cutlass/tools/util/include")
pids=()
for op in 0 1 2; do nvcc "${flags[@]}" -DOP=$op -c "$here/cutlass_bounds.cu" -o "$out/op$op.o" & pids+=($!); done
nvcc "${flags[@]}" -DOP=-1 -c "$here/cutlass_bounds.cu" -o "$out/main.o"
for pid in "${pids[@]}"; do wait "$pid"; done
nvcc -gencode=arch=compute_90a,code=sm_90a "$out"/op{0,1,2}.o "$out/main.o" ${CUBLAS_LIB:+-L"$CUBLAS_LIB"} -lcublas -o "$out/cutlass_bounds"
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
# The shapes of benchmarks/cases.py (E, rows a group, d, f; SwiGLU's FC1 is 2f wide), qwen3 also at 512 rows.
for shape in "128 256 2048 768" "128 512 2048 768" "32 1024 7168 2048" "32 512 2880 2880" "8 2048 4096 14336"; do
  "$out/cutlass_bounds" $shape
done
