// CUDA handler of one block-scaled FP8 grouped product, the blockwise recipe's GEMM (jaxmlp/fp8/blockwise.py
// quantizes in XLA and calls this for each of its six products): e4m3 operands with float32 power-of-two
// block scales, on the cuBLASLt grouped GEMM (Fp8Scaling::kBlocks in grouped_gemm.h), out in bf16 or f16.
//   op kNT (forward, data gradients): out [M, K] = lhs [M, N] @ rhs[g] [K, N]^T per group of rows;
//     lhs_scales [M, ceil(N / 128)] (1x128 blocks, row-major as XLA computes them: a kernel here lays them
//     out per group as cuBLASLt reads them); rhs_scales [E, ceil(K / 128), round_up(ceil(N / 128), 4)].
//   op kTNPadded (weight gradients): out [E, K, N], out[g] = lhsT [K, L] @ rhsT [N, L]^T over group g's
//     columns, which start at multiples of 128 (L = PaddedRows(rows, E, 128), zeros between groups);
//     lhs_scales [L / 128, K], rhs_scales [L / 128, N] (128x1 blocks of the tokens).
// kNT's rows past the groups are zeros with zero_padding, else left unwritten (the recipe's own h and da,
// which no kernel reads there, and y and dx for a caller that does not read them).
// Group sizes stay on the device: no host sync, command-buffer compatible.
#include <cuda_runtime.h>

#include "checks.h"
#include "codes.h"
#include "cuda/fp8/fp8_block_gemm_kernels.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/handler.h"
#include "xla/ffi/api/ffi.h"

namespace jaxmlp {

namespace {

using ffi::AnyBuffer;
using ffi::DataType;
using ffi::Error;
using ffi::Result;

Error CheckFloat32(const char* name, const AnyBuffer& b, std::initializer_list<int64_t> want) {
  return CheckShapeAndType(name, b, want, DataType::F32, "dtype float32");
}

// The product's shapes, checked: M rows in groups, E groups, out [.., K] or [E, K, N].
struct BlockGemmDims {
  int64_t M, E, K, N, L;
};

Error CheckOperands(GemmOp op, int64_t rows, const AnyBuffer& lhs, const AnyBuffer& lhs_scales, const AnyBuffer& rhs,
                    const AnyBuffer& rhs_scales, const AnyBuffer& group_sizes, const AnyBuffer& out,
                    BlockGemmDims* d) {
  if (lhs.element_type() != kFp8 || rhs.element_type() != kFp8)
    return Error::InvalidArgument("jaxmlp: the block-scaled FP8 product takes float8_e4m3fn lhs and rhs");
  if (out.element_type() != DataType::BF16 && out.element_type() != DataType::F16)
    return Error::InvalidArgument("jaxmlp: the block-scaled FP8 product writes bfloat16 or float16");
  if (group_sizes.dimensions().size() != 1 || group_sizes.element_type() != DataType::S32)
    return Error::InvalidArgument("jaxmlp: group_sizes must be a 1-D int32 array");
  if (lhs.dimensions().size() != 2) return CheckShape("lhs", lhs, {-1, -1});
  d->M = rows, d->E = group_sizes.dimensions()[0];
  if (op == GemmOp::kNT) {
    d->N = lhs.dimensions()[1], d->L = 0;
    if (rhs.dimensions().size() != 3) return CheckShape("rhs", rhs, {d->E, -1, d->N});
    d->K = rhs.dimensions()[1];
    JAXMLP_RETURN_IF_ERROR(CheckShape("lhs", lhs, {rows, d->N}));
    JAXMLP_RETURN_IF_ERROR(CheckShape("rhs", rhs, {d->E, d->K, d->N}));
    JAXMLP_RETURN_IF_ERROR(CheckFloat32("lhs_scales", lhs_scales, {rows, ScaleBlocks(d->N)}));
    JAXMLP_RETURN_IF_ERROR(
        CheckFloat32("rhs_scales", rhs_scales, {d->E, ScaleBlocks(d->K), (ScaleBlocks(d->N) + 3) / 4 * 4}));
    JAXMLP_RETURN_IF_ERROR(CheckShape("out", out, {rows, d->K}));
  } else if (op == GemmOp::kTNPadded) {
    d->K = lhs.dimensions()[0], d->L = PaddedRows(rows, d->E, kScaleBlock);
    if (rhs.dimensions().size() != 2) return CheckShape("rhs", rhs, {-1, d->L});
    d->N = rhs.dimensions()[0];
    JAXMLP_RETURN_IF_ERROR(CheckShape("lhs", lhs, {d->K, d->L}));
    JAXMLP_RETURN_IF_ERROR(CheckShape("rhs", rhs, {d->N, d->L}));
    JAXMLP_RETURN_IF_ERROR(CheckFloat32("lhs_scales", lhs_scales, {d->L / kScaleBlock, d->K}));
    JAXMLP_RETURN_IF_ERROR(CheckFloat32("rhs_scales", rhs_scales, {d->L / kScaleBlock, d->N}));
    JAXMLP_RETURN_IF_ERROR(CheckShape("out", out, {d->E, d->K, d->N}));
  } else {
    return Error::InvalidArgument("jaxmlp: the block-scaled FP8 product is op nt (1) or tn over padded columns (3)");
  }
  JAXMLP_RETURN_IF_ERROR(CheckExtents({d->M, d->K, d->N, d->E}));
  if (d->K % 16 || d->N % 16)
    return Error::InvalidArgument("jaxmlp: the block-scaled FP8 product needs K and N multiples of 16");
  if (d->L > INT32_MAX) return Error::InvalidArgument("jaxmlp: M + 127 E must be below 2^31");
  return Error::Success();
}

// Workspace: the group arrays and cuBLAS's, then kNT's lhs scales laid out per group.
float* CarveScales(Carver& c, GemmOp op, int64_t M, int64_t E, int64_t N) {
  return op == GemmOp::kNT ? c.Take<float>(ScaleBlocks(N) * (M + 3 * E + 3)) : nullptr;
}

Error GemmFp8Blocks(cudaStream_t stream, int32_t device, AnyBuffer lhs, AnyBuffer lhs_scales, AnyBuffer rhs,
                    AnyBuffer rhs_scales, AnyBuffer group_sizes, int32_t op_code, int64_t rows,
                    int32_t zero_padding, Result<AnyBuffer> out, Result<AnyBuffer> workspace) {
  ++handler_host_calls;
  const GemmOp op = static_cast<GemmOp>(op_code);
  BlockGemmDims m;
  JAXMLP_RETURN_IF_ERROR(CheckOperands(op, rows, lhs, lhs_scales, rhs, rhs_scales, group_sizes, *out, &m));
  Carver ws(workspace->untyped_data());
  GroupedGemms gemms(GemmPath::kGrouped, stream, device, static_cast<const int32_t*>(group_sizes.untyped_data()), m.E,
                     m.M, /*split_k=*/false, ws);
  float* vec128 = CarveScales(ws, op, m.M, m.E, m.N);
  JAXMLP_RETURN_IF_ERROR(CheckWorkspace(ws, *workspace));
  JAXMLP_RETURN_IF_ERROR(Poison(stream, {&*out, &*workspace}));
  GemmSpec s{op, int32_t(m.K), int32_t(m.N), lhs.untyped_data(), rhs.untyped_data(), out->untyped_data(),
             kFp8, out->element_type(), 0.0f};
  s.lhs_scale = op == GemmOp::kNT ? vec128 : static_cast<const float*>(lhs_scales.untyped_data());
  s.rhs_scale = static_cast<const float*>(rhs_scales.untyped_data());
  s.scaling = Fp8Scaling::kBlocks;
  JAXMLP_RETURN_IF_ERROR(gemms.Prepare({s}));
  if (op == GemmOp::kNT) {
    JAXMLP_RETURN_IF_ERROR(LayOutVec128Scales(stream, static_cast<const float*>(lhs_scales.untyped_data()),
                                              gemms.offsets(), m.E, m.M, ScaleBlocks(m.N), vec128));
    JAXMLP_RETURN_IF_ERROR(gemms.Run(0));
    return zero_padding ? gemms.ZeroPaddingRows(0) : Error::Success();
  }
  JAXMLP_RETURN_IF_ERROR(gemms.Run(0));
  return gemms.ZeroEmptyGroups({0});
}

}  // namespace

size_t GemmFp8BlocksWorkspaceBytes(int32_t op_code, int64_t M, int64_t E, int64_t N) {
  Carver c(nullptr);
  GroupedGemms counted(GemmPath::kGrouped, nullptr, 0, nullptr, E, M, /*split_k=*/false, c);
  CarveScales(c, static_cast<GemmOp>(op_code), M, E, N);
  return c.used();
}

}  // namespace jaxmlp

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmFp8Blocks, jaxmlp::GemmFp8Blocks,
                              jaxmlp::BindStreamAndDevice()
                                  .Arg<xla::ffi::AnyBuffer>()   // lhs
                                  .Arg<xla::ffi::AnyBuffer>()   // lhs_scales
                                  .Arg<xla::ffi::AnyBuffer>()   // rhs
                                  .Arg<xla::ffi::AnyBuffer>()   // rhs_scales
                                  .Arg<xla::ffi::AnyBuffer>()   // group_sizes
                                  .Attr<int32_t>("op")
                                  .Attr<int64_t>("rows")
                                  .Attr<int32_t>("zero_padding")
                                  .Ret<xla::ffi::AnyBuffer>()   // out
                                  .Ret<xla::ffi::AnyBuffer>(),  // workspace
                              jaxmlp::kGraphSafe);
