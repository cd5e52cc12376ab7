// The epilogue of a gated FC1 on the engine: from one output tile of x @ w1 it stores the tile's h (the gate
// and up columns, rounded to the output type, as the unfused product stores them) and the activation output
// a = act(gate, up) * scales[row], which the unfused path computes in a separate pass over h
// (ActivationForward). The main loop (VarlenMainloop with kSplitB) loads B so that accumulator columns j and
// j + 64 of a 128-column tile are gate column 64 n + j and up column f + 64 n + j.
//
// Stores: each warp stages its 32 rows of a 64-column piece (gate, up, then a) in shared memory and writes
// them out in 16-byte row segments, only the rows inside the group (a group's last tile reaches into the
// next group's rows, which another tile writes). No TMA store: a TMA box is bounded by the tensor, not the
// group. Row offsets come from the setup kernel's offsets, the tile's group from the scheduler, so nothing
// here depends on the per-group output pointers. The staging buffer is Base's shared memory for C and D,
// which nothing else uses here, so the main loop keeps the stages it has with Base's epilogue.
//
// The ping-pong kernel runs the two consumer warpgroups' epilogues one after the other (its order barrier),
// so they share the staging buffer.
#pragma once

#include <cstdint>
#include <type_traits>

#include "activations.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_conversion.h"

namespace jaxmlp::cutlass_detail {

// Base: the ptr-array TMA epilogue that CUTLASS's builder makes for the kernel (its pipelines and shared
// storage types are kept, so the kernel drives this as it would drive Base; its stores are replaced).
template <class Base>
struct GatedEpilogue : Base {
  using T = typename Base::ElementD;
  using typename Base::LoadPipeline;
  using typename Base::LoadPipelineState;
  using typename Base::StorePipeline;
  using typename Base::StorePipelineState;
  using typename Base::TensorMapStorage;
  using typename Base::TensorStorage;

  // A warp's rows of one 64-column piece, in rows of 8 chunks of 16 bytes, chunk c of row r stored at
  // c ^ (r % 8): conflict-free for the 4-byte writes (8 rows, 4 columns each) and the 16-byte reads (one
  // row a quarter warp).
  static constexpr int kWarps = 4, kRows = 32, kCols = 64, kChunk = 8;
  using Staging = T[kWarps][kRows][kCols];
  static_assert(sizeof(Staging) <= sizeof(TensorStorage::collective), "Base's shared memory holds no staging");

  struct Arguments : Base::Arguments {
    T* h = nullptr;               // [rows, 2 f] the gate columns, then the up columns
    T* a = nullptr;               // [rows, f]
    T const* scales = nullptr;    // [rows] or null (1)
    int64_t const* offsets = nullptr;  // [groups] each group's first row
    int64_t f = 0;
    ActParams act{};
  };

  struct Params : Base::Params {
    T* h;
    T* a;
    T const* scales;
    int64_t const* offsets;
    int64_t f;
    ActParams act;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void* workspace) {
    Params p{};
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(shape, args, workspace);
    p.h = args.h, p.a = args.a, p.scales = args.scales, p.offsets = args.offsets, p.f = args.f, p.act = args.act;
    return p;
  }

  // 16-byte rows and segments: h, a and f (and so 2 f) multiples of 8 elements; whole half tiles.
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    return Base::can_implement(shape, args) && IsGated(args.act.act) && args.h && args.a && args.offsets &&
           args.f > 0 && args.f % kCols == 0 &&
           reinterpret_cast<uintptr_t>(args.h) % 16 == 0 && reinterpret_cast<uintptr_t>(args.a) % 16 == 0;
  }

  CUTLASS_HOST_DEVICE GatedEpilogue(Params const& params, TensorStorage& storage)
      : Base(params, storage), p_(params), staging_(reinterpret_cast<Staging*>(&storage.collective)[0]) {}

  // Nothing to load (no C): the kernel's epilogue load warp never calls load.
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  template <class... Unused>
  CUTLASS_DEVICE LoadPipelineState load(LoadPipeline, LoadPipelineState state, Unused&&...) {
    return state;
  }

  // No descriptors: the kernel's tensormap hooks do nothing.
  CUTLASS_DEVICE auto store_init(typename Base::Params const&, TensorMapStorage&, int32_t, int32_t, int32_t) {
    return cute::make_tuple(static_cast<cute::TmaDescriptor*>(nullptr));
  }
  template <bool kIsLoad, class ProblemShapeMNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage&, typename Base::Params const&,
                                                cute::TmaDescriptor const*, ProblemShapeMNKL, int32_t, int32_t) {}
  template <bool kIsLoad>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage&, cute::TmaDescriptor const*, int32_t = 0) {}
  template <bool kIsLoad>
  CUTLASS_DEVICE void tensormaps_fence_acquire(cute::TmaDescriptor const*) {}

  // The tile (m, n) of group l: problem M is the group's rows, N = 2 f.
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma, class TensorMapD>
  CUTLASS_DEVICE auto store(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                            StorePipelineState store_state, ProblemShapeMNKL problem, TileShapeMNK,
                            TileCoordMNKL tile, cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma,
                            int thread_idx, TensorStorage&, TensorMapD const&, int = -1) {
    using namespace cute;
    // The accumulators of one warpgroup's 128 x 128 tile: wgmma's 64 x 128 layout, twice along M. Thread t of
    // value (v0, v1, v2) at MMA_M index mm holds row 64 mm + 16 (t / 32) + 8 v1 + (t % 32) / 4 and column
    // 8 v2 + 2 (t % 4) + v0 (cute's CLayout_64xN): columns j and j + 64 are values v2 and v2 + 8.
    static_assert(is_same_v<decltype(shape(AccLayout{})), Shape<Shape<_2, _2, _16>, _2, _1>>,
                  "the gated epilogue is written for 128 x 128 tiles of one warpgroup");
    static_assert(size<0>(TileShapeMNK{}) == 128 && size<1>(TileShapeMNK{}) == 128);
    const int lane = thread_idx % 32, warp = thread_idx / 32;
    const int64_t rows = get<0>(problem), m0 = int64_t(get<0>(tile)) * 128, n = get<1>(tile);
    const int64_t first = p_.offsets[get<3>(tile)] + m0;  // the tile's first row in h and a
    // Rows of this thread: (mm, v1) -> row 64 mm + 16 warp + 8 v1 + lane / 4.
    float scale[2][2];
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < 2; ++mm)
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int r = 64 * mm + 16 * warp + 8 * v1 + lane / 4;
        scale[mm][v1] = p_.scales && m0 + r < rows ? float(p_.scales[first + r]) : 1.0f;
      }
    const int64_t f = p_.f, ldh = 2 * f;
    // Each piece: its 64 columns of this thread's values in registers -> staging -> 16-byte row segments.
    auto piece = [&](auto value, T* out, int64_t ld) {
      T(*stage)[kCols] = staging_[warp];
      CUTLASS_PRAGMA_UNROLL
      for (int mm = 0; mm < 2; ++mm)
        CUTLASS_PRAGMA_UNROLL
        for (int v1 = 0; v1 < 2; ++v1)
          CUTLASS_PRAGMA_UNROLL
          for (int v2 = 0; v2 < 8; ++v2) {
            const int r = 16 * mm + 8 * v1 + lane / 4, c = kChunk * (v2 ^ (r % 8)) + 2 * (lane % 4);
            cutlass::Array<T, 2> pair;
            pair[0] = value(mm, v1, v2, 0), pair[1] = value(mm, v1, v2, 1);
            *reinterpret_cast<cutlass::Array<T, 2>*>(&stage[r][c]) = pair;
          }
      __syncwarp();
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows * kCols / 8 / 32; ++i) {
        const int q = lane + 32 * i, r = q / 8, c = kChunk * (q % 8);
        const int row = 64 * (r / 16) + 16 * warp + r % 16;  // the staging row's row in the tile
        if (m0 + row < rows)
          *reinterpret_cast<uint4*>(out + (first + row) * ld + c) =
              *reinterpret_cast<uint4 const*>(&stage[r][kChunk * ((q % 8) ^ (r % 8))]);
      }
      __syncwarp();
    };
    auto acc = [&](int mm, int v1, int v2, int v0) { return accumulators(make_coord(v0, v1, v2), mm, 0); };
    piece([&](int mm, int v1, int v2, int v0) { return T(acc(mm, v1, v2, v0)); }, p_.h + 64 * n, ldh);
    piece([&](int mm, int v1, int v2, int v0) { return T(acc(mm, v1, v2 + 8, v0)); }, p_.h + f + 64 * n, ldh);
    // From h as stored (rounded), as ActivationForward computes it.
    auto activation = [&](auto kind) {
      piece([&](int mm, int v1, int v2, int v0) {
        const float gate = float(T(acc(mm, v1, v2, v0))), up = float(T(acc(mm, v1, v2 + 8, v0)));
        return T(ActivationGradOf<decltype(kind)::value>(p_.act, gate, up).val * scale[mm][v1]);
      }, p_.a + 64 * n, f);
    };
    switch (p_.act.act) {  // the gated activations (CutlassFusesActivation)
      case Act::kSwiglu: activation(std::integral_constant<Act, Act::kSwiglu>{}); break;
      case Act::kGeglu: activation(std::integral_constant<Act, Act::kGeglu>{}); break;
      case Act::kReglu: activation(std::integral_constant<Act, Act::kReglu>{}); break;
      case Act::kClampedSwiglu: activation(std::integral_constant<Act, Act::kClampedSwiglu>{}); break;
      default: break;  // ungated: refused by can_implement
    }
    return make_tuple(load_state, store_state);
  }

  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                                 StorePipelineState store_state) {
    return cute::make_tuple(load_state, store_state);
  }

 private:
  Params const& p_;
  T (*staging_)[kRows][kCols];
};

}  // namespace jaxmlp::cutlass_detail
