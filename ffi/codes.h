// The integer codes that cross the Python-C++ boundary: the activation (the "activation" attribute), the
// grouped product (the "op" attribute) and the dtype of the workspace-size queries. jaxmlp._cpu exports
// them as Python enums (codes_binding.h), which the Python side reads instead of keeping its own tables.
#pragma once

#include <cstdint>

namespace jaxmlp {

// The activation, in the order of jaxmlp/activations.py NAMES: the values are the Python contract and
// must not change (append a new one before kCount).
enum class Act : int32_t {
  kSwiglu = 0,
  kGeglu,
  kReglu,
  kGelu,
  kRelu,
  kSilu,
  kSquaredRelu,
  kClampedSwiglu,
  kCount
};

constexpr bool IsGated(Act a) {
  return a == Act::kSwiglu || a == Act::kGeglu || a == Act::kReglu || a == Act::kClampedSwiglu;
}

struct ActParams {
  Act act;
  float alpha;  // clamped_swiglu only
  float limit;  // clamped_swiglu only
};

// The three grouped products. Row-major, for group g owning rows [o_g, o_g + c_g) of the ragged operand:
//   kNN: out[o_g + i, :] = lhs[o_g + i, :] @ rhs[g]           lhs [M, K], rhs [E, K, N], out [M, N]
//   kNT: out[o_g + i, :] = lhs[o_g + i, :] @ rhs[g]^T         lhs [M, N], rhs [E, K, N], out [M, K]
//   kTN: out[g]          = lhs[o_g : o_g+c_g]^T @ rhs[o_g : ] lhs [M, K], rhs [M, N],    out [E, K, N]
// The CUDA FP8 path's weight gradients (cuBLAS takes FP8 only with both operands contiguous along the
// reduction) read transposed copies instead, each group's rows a 16-aligned column segment:
//   kTNPadded: out[g] = lhsT[:, p_g : p_g+c_g] @ rhsT[:, p_g : p_g+c_g]^T   lhsT [K, ld], rhsT [N, ld]
// where p_g is the running sum of the group sizes each rounded up to 16 (zeros in between).
enum class GemmOp : int32_t { kNN = 0, kNT = 1, kTN = 2, kTNPadded = 3 };

// The float dtypes of the workspace-size queries of jaxmlp._cuda (mlp_workspace_bytes,
// mlp_fp8_workspace_bytes), and the bytes of one element of each.
enum class DType : int32_t { kFloat32 = 0, kBfloat16 = 1, kFloat16 = 2 };

constexpr int ElementBytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

}  // namespace jaxmlp
