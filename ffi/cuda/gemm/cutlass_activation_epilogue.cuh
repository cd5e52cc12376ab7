// The epilogues of the MLP's activation on the engine, for two of its products:
//   FC1 (kNN, kGrad false): from one output tile of x @ w1 it stores the tile's h (rounded to the output
//     type, as the unfused product stores it; with b1, h + b1[g] rounded again, as the unfused pass adds it
//     to the stored product) and the activation output a = act(h) * scales[row] of h as stored, which the
//     unfused path computes in a separate pass over h (ActivationForward). Gated (kGated): the main loop
//     (VarlenMainloop with kSplitB) loads B so that accumulator columns j and j + 64 of a 128-column tile
//     are gate column 64 n + j and up column f + 64 n + j, and a = act(gate, up). Ungated: the tile is h's
//     columns 128 n + j, and a's.
//   FC2's data gradient (kNT, kGrad true): the tile is da = dy @ w2^T, columns 128 n + j of f. With h's
//     columns of the same rows and columns (gated: its gate and up columns), read here, it stores what
//     ActivationBackward computes from da: dh = da * s * act'(h) (gated: (d act / d gate, d act / d up))
//     over h's columns (dh may be h: each element is read before the warp that read it writes it, and no
//     other tile touches it), a_s = act(h) * s in da's place (the FC2 weight gradient's input), and per row
//     and tile the partial sum of da * act (the gradient of the row's scale), which ActivationBackward adds
//     up in tile order (the same bits on every run). da is rounded to the output type first, as the unfused
//     product stores it, so dh and a_s are the unfused path's bits.
//
// Stores and loads: each warp stages its 32 rows of a 64-column piece in shared memory and moves them in
// 16-byte row segments (loads by cp.async), only the rows inside the group (a group's last tile reaches into
// the next group's rows, which another tile reads and writes). No TMA stores: a TMA box is bounded by the
// tensor, not the group. Row offsets come from the setup kernel's offsets, the tile's group from the
// scheduler, so nothing here depends on the per-group output pointers. The staging buffer is Base's shared
// memory for C and D, which nothing else uses here, so the main loop keeps the stages it has with Base's
// epilogue; a gated kGrad adds a second one, which fits in what those stages leave (Grouped's static_assert).
//
// The ping-pong kernel runs the two consumer warpgroups' epilogues one after the other (its order barrier),
// so they share the staging buffer; in GatherSplitN (kTwoStagings) both run at once, each with its own.
#pragma once

#include <cstdint>
#include <type_traits>

#include "activations.h"
#include "cuda/gemm/cutlass_grouped.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_conversion.h"

namespace jaxmlp::cutlass_detail {

// Base: the ptr-array TMA epilogue that CUTLASS's builder makes for the kernel (its pipelines and shared
// storage types are kept, so the kernel drives this as it would drive Base; its stores are replaced).
template <class Base, bool kGated, bool kGrad, bool kTwoStagings = false>
struct ActivationEpilogue : Base {
  static_assert(kGated || !kTwoStagings, "ungated: the ping-pong kernel only");
  using T = typename Base::ElementD;
  using typename Base::LoadPipeline;
  using typename Base::LoadPipelineState;
  using typename Base::StorePipeline;
  using typename Base::StorePipelineState;
  using typename Base::TensorMapStorage;

  // A warp's rows of one 64-column piece, in rows of 8 chunks of 16 bytes, chunk c of row r stored at
  // c ^ (r % 8): conflict-free for the 4-byte accesses (8 rows, 4 columns each) and the 16-byte ones (one
  // row a quarter warp). The first staging buffer is Base's shared memory for C and D; a gated kGrad adds a
  // second (the gate and the up piece side by side), which the 6 main-loop stages leave room for (Grouped
  // checks).
  // kTwoStagings: the second consumer warpgroup's is the second half of Base's shared memory.
  static constexpr int kWarps = 4, kRows = 32, kCols = 64, kChunk = 8;
  using Staging = T[kWarps][kRows][kCols];
  static_assert(sizeof(Staging) <= sizeof(Base::TensorStorage::collective),
                "Base's shared memory holds no staging");
  static_assert(!kTwoStagings || (!kGrad && 2 * sizeof(Staging) <= sizeof(Base::TensorStorage::collective)),
                "Base's shared memory holds no second staging");
  struct GradStorage : Base::TensorStorage {
    alignas(128) Staging second;
  };
  using TensorStorage = cute::conditional_t<kGrad && kGated, GradStorage, typename Base::TensorStorage>;

  struct Arguments : Base::Arguments {
    T* h = nullptr;                    // [rows, 2 f] gate columns, then up columns (kGrad: read); ungated [rows, f]
    T* a = nullptr;                    // [rows, f] a (FC1), a_s over da (kGrad)
    T* dh = nullptr;                   // kGrad: [rows, 2 f] (ungated: f), may be h
    T const* scales = nullptr;         // [rows] or null (1)
    T const* b1 = nullptr;             // FC1: [groups, 2 f] (ungated: f) or null
    float* ds = nullptr;               // kGrad with scales: [rows, ceil(f / 128)] the row sums' tile parts
    int64_t const* offsets = nullptr;  // [groups] each group's first row
    int64_t f = 0;
    ActParams act{};
  };

  struct Params : Base::Params {
    T* h;
    T* a;
    T* dh;
    T const* scales;
    T const* b1;
    float* ds;
    int64_t const* offsets;
    int64_t f;
    ActParams act;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void* workspace) {
    Params p{};
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(shape, args, workspace);
    p.h = args.h, p.a = args.a, p.dh = args.dh, p.scales = args.scales, p.b1 = args.b1, p.ds = args.ds;
    p.offsets = args.offsets;
    p.f = args.f, p.act = args.act;
    return p;
  }

  // 16-byte rows and segments: h, a, dh and f (and so 2 f) multiples of 8 elements; whole 64-column pieces
  // (gated FC1: a tile's two halves; kGrad and ungated FC1: the last tile may hold one).
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    const auto aligned = [](void const* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
    return Base::can_implement(shape, args) && IsGated(args.act.act) == kGated && args.h && args.a && args.offsets &&
           args.f > 0 && args.f % kCols == 0 && aligned(args.h) && aligned(args.a) &&
           (!kGrad || (args.dh && aligned(args.dh)));
  }

  // consumer: the consumer warpgroup (kTwoStagings: the second stages its tiles in the second buffer).
  CUTLASS_HOST_DEVICE ActivationEpilogue(Params const& params, TensorStorage& storage, int consumer = 0)
      : Base(params, storage), p_(params), staging_(StagingOf(storage, consumer)) {
    if constexpr (kGrad && kGated) second_ = &storage.second;
  }

  // Nothing to load through the epilogue's pipeline (no C): the kernel's epilogue load warp never calls load.
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  template <class... Unused>
  CUTLASS_DEVICE LoadPipelineState load(LoadPipeline, LoadPipelineState state, Unused&&...) {
    return state;
  }

  // No descriptors: the kernel's tensormap hooks do nothing (and GatherSplitN, which calls none, may run it).
  static constexpr bool kNoDescriptors = true;
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

  // The tile (m, n) of group l: problem M is the group's rows.
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
                  "the activation epilogue is written for 128 x 128 tiles of one warpgroup");
    static_assert(size<0>(TileShapeMNK{}) == 128 && size<1>(TileShapeMNK{}) == 128);
    const int lane = thread_idx % 32, warp = thread_idx / 32;
    const int64_t m0 = int64_t(get<0>(tile)) * 128;
    Rows rows{get<0>(problem) - m0, p_.offsets[get<3>(tile)] + m0, lane, warp};
    float scale[2][2];
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < 2; ++mm)
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int r = rows.Of(mm, v1);
        scale[mm][v1] = p_.scales && rows.Valid(r) ? float(p_.scales[rows.first + r]) : 1.0f;
      }
    auto acc = [&](int mm, int v1, int v2, int v0) -> float { return accumulators(make_coord(v0, v1, v2), mm, 0); };
    auto by_act = [&](auto body) {  // the activations of this epilogue's kind, as constants (can_implement
                                    // refuses the others)
      ByAct(p_.act.act, [&](auto kind) {
        if constexpr (IsGated(decltype(kind)::value) == kGated) body(kind);
      });
    };
    // With b1 the accumulators of a 64-column piece (values v2 + 8 piece) become h's values before their last
    // rounding: the product rounded, plus b1's element (PlusBias), so that T(acc) below is h as the unfused
    // pass stores it. `pairs`: b1 at this thread's first column of the piece, 2 (lane % 4); each pair is read
    // once for the thread's four rows (read where h's values are formed, each was read eight times:
    // docs/engine-performance.md).
    auto add_b1 = [&](T const* pairs, int piece) {
      CUTLASS_PRAGMA_UNROLL
      for (int v2 = 0; v2 < 8; ++v2) {
        const cutlass::Array<T, 2> pair = *reinterpret_cast<cutlass::Array<T, 2> const*>(pairs + 8 * v2);
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < 2; ++mm)
          CUTLASS_PRAGMA_UNROLL
          for (int v1 = 0; v1 < 2; ++v1)
            CUTLASS_PRAGMA_UNROLL
            for (int v0 = 0; v0 < 2; ++v0) {
              float& value = accumulators(make_coord(v0, v1, v2 + 8 * piece), mm, 0);
              value = float(T(value)) + float(pair[v0]);
            }
      }
    };
    const int64_t f = p_.f, ldh = kGated ? 2 * f : f, n = get<1>(tile);
    if constexpr (!kGrad && kGated) {
      if (64 * n >= f) return make_tuple(load_state, store_state);  // GatherSplitN: a last tile's second half
      if (p_.b1) {
        T const* b1 = p_.b1 + get<3>(tile) * ldh + 64 * n + 2 * (lane % 4);
        add_b1(b1, 0);      // gate
        add_b1(b1 + f, 1);  // up
      }
      Store(rows, [&](int mm, int v1, int v2, int v0) { return T(acc(mm, v1, v2, v0)); }, p_.h + 64 * n, ldh);
      Store(rows, [&](int mm, int v1, int v2, int v0) { return T(acc(mm, v1, v2 + 8, v0)); }, p_.h + f + 64 * n, ldh);
      // From h as stored, as ActivationForward computes it.
      by_act([&](auto kind) {
        Store(rows, [&](int mm, int v1, int v2, int v0) {
          const float gate = float(T(acc(mm, v1, v2, v0))), up = float(T(acc(mm, v1, v2 + 8, v0)));
          return T(ActivationGradOf<decltype(kind)::value>(p_.act, gate, up).val * scale[mm][v1]);
        }, p_.a + 64 * n, f);
      });
    } else if constexpr (!kGrad) {
      // Ungated: the tile's two pieces are h's and a's columns 128 n and 128 n + 64 (the second past f where
      // f % 128 is 64).
      CUTLASS_PRAGMA_UNROLL
      for (int piece = 0; piece < 2; ++piece) {
        const int64_t col = 128 * n + 64 * piece;
        if (col >= f) continue;
        if (p_.b1) add_b1(p_.b1 + get<3>(tile) * f + col + 2 * (lane % 4), piece);
        Store(rows, [&](int mm, int v1, int v2, int v0) { return T(acc(mm, v1, v2 + 8 * piece, v0)); }, p_.h + col, f);
        by_act([&](auto kind) {  // from h as stored
          Store(rows, [&](int mm, int v1, int v2, int v0) {
            const float h = float(T(acc(mm, v1, v2 + 8 * piece, v0)));
            return T(ActivationGradOf<decltype(kind)::value>(p_.act, h, 0.0f).val * scale[mm][v1]);
          }, p_.a + col, f);
        });
      }
    } else {
      by_act([&](auto kind) {
        float ds[2][2] = {};
        CUTLASS_PRAGMA_UNROLL
        for (int half = 0; half < 2; ++half) {
          const int64_t col = 128 * n + 64 * half;
          if (col >= f) continue;  // f is a multiple of 64: the last tile may hold one half
          // h's piece (gated: the gate and up pieces side by side); each thread replaces its pairs by their
          // gradients and keeps a_s in its accumulators.
          Fetch(rows, staging_, p_.h + col, ldh);
          if constexpr (kGated) Fetch(rows, *second_, p_.h + f + col, ldh);
          FetchWait();
          ForEachPair(rows, staging_, [&](int mm, int v1, int v2, cutlass::Array<T, 2>& gate) {
            cutlass::Array<T, 2>* up = nullptr;
            if constexpr (kGated) up = &Pair(rows, *second_, mm, v1, v2);
            CUTLASS_PRAGMA_UNROLL
            for (int v0 = 0; v0 < 2; ++v0) {
              const float da = float(T(acc(mm, v1, v2 + 8 * half, v0))), s = scale[mm][v1];
              const ActGrad r = ActivationGradOf<decltype(kind)::value>(p_.act, float(gate[v0]),
                                                                         kGated ? float((*up)[v0]) : 0.0f);
              ds[mm][v1] += da * r.val;
              gate[v0] = T(da * s * r.dgate);
              if constexpr (kGated) (*up)[v0] = T(da * s * r.dup);
              accumulators(make_coord(v0, v1, v2 + 8 * half), mm, 0) = r.val * s;
            }
          });
          StoreStaged(rows, staging_, p_.dh + col, ldh);
          if constexpr (kGated) StoreStaged(rows, *second_, p_.dh + f + col, ldh);
          Store(rows, [&](int mm, int v1, int v2, int v0) { return T(acc(mm, v1, v2 + 8 * half, v0)); },
                p_.a + col, f);
        }
        if (!p_.ds) return;
        // A row's sum over the tile: its 4 threads' (lanes 4 i .. 4 i + 3) sums, added in a fixed order.
        const int64_t parts = ScaleGradientParts(f);
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < 2; ++mm)
          CUTLASS_PRAGMA_UNROLL
          for (int v1 = 0; v1 < 2; ++v1) {
            float sum = ds[mm][v1];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int r = rows.Of(mm, v1);
            if (lane % 4 == 0 && rows.Valid(r)) p_.ds[(rows.first + r) * parts + n] = sum;
          }
      });
    }
    return make_tuple(load_state, store_state);
  }

  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                                 StorePipelineState store_state) {
    return cute::make_tuple(load_state, store_state);
  }

 private:
  // The tile's rows as one warp sees them: the first at row `first` of the tensors, `count` the group's
  // rows from there on (tile rows at or past it belong to the next group or to no group).
  struct Rows {
    int64_t count, first;
    int lane, warp;
    // The tile row of this thread's values (mm, v1), and of the staging buffer's row r.
    CUTLASS_DEVICE int Of(int mm, int v1) const { return 64 * mm + 16 * warp + 8 * v1 + lane / 4; }
    CUTLASS_DEVICE int OfStaged(int r) const { return 64 * (r / 16) + 16 * warp + r % 16; }
    CUTLASS_DEVICE bool Valid(int row) const { return row < count; }
  };

  // This thread's pair of columns 8 v2 + 2 (lane % 4) + {0, 1} of its rows (mm, v1) in a staging buffer.
  CUTLASS_DEVICE static cutlass::Array<T, 2>& Pair(Rows const& rows, Staging& staging, int mm, int v1, int v2) {
    const int r = 16 * mm + 8 * v1 + rows.lane / 4, c = kChunk * (v2 ^ (r % 8)) + 2 * (rows.lane % 4);
    return *reinterpret_cast<cutlass::Array<T, 2>*>(&staging[rows.warp][r][c]);
  }

  // f(mm, v1, v2, pair) for each of this thread's pairs in a staging buffer.
  template <class F>
  CUTLASS_DEVICE static void ForEachPair(Rows const& rows, Staging& staging, F&& f) {
    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < 2; ++mm)
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1)
        CUTLASS_PRAGMA_UNROLL
        for (int v2 = 0; v2 < 8; ++v2) f(mm, v1, v2, Pair(rows, staging, mm, v1, v2));
    __syncwarp();
  }

  // 64 columns of the warp's rows in the group, at `global` (leading dimension ld), to or from a staging
  // buffer: StoreStaged stores; Fetch issues asynchronous copies (cp.async: no registers held, so several
  // pieces are in flight at once), which FetchWait waits for.
  template <class F>
  CUTLASS_DEVICE static void ForEachSegment(Rows const& rows, Staging& staging, T const* global, int64_t ld, F&& f) {
    T(*stage)[kCols] = staging[rows.warp];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows * kCols / 8 / 32; ++i) {
      const int q = rows.lane + 32 * i, r = q / 8, row = rows.OfStaged(r);
      if (rows.Valid(row))
        f(const_cast<T*>(global) + (rows.first + row) * ld + kChunk * (q % 8), &stage[r][kChunk * ((q % 8) ^ (r % 8))]);
    }
  }
  CUTLASS_DEVICE static void StoreStaged(Rows const& rows, Staging& staging, T* global, int64_t ld) {
    ForEachSegment(rows, staging, global, ld, [](T* g, T* sh) {
      *reinterpret_cast<uint4*>(g) = *reinterpret_cast<uint4 const*>(sh);
    });
    __syncwarp();
  }
  CUTLASS_DEVICE static void Fetch(Rows const& rows, Staging& staging, T const* global, int64_t ld) {
    ForEachSegment(rows, staging, global, ld, [](T* g, T* sh) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(cute::cast_smem_ptr_to_uint(sh)), "l"(g));
    });
  }
  CUTLASS_DEVICE static void FetchWait() {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncwarp();
  }

  // value(mm, v1, v2, v0) for this thread's values of a 64-column piece -> staging -> `out`.
  template <class Value>
  CUTLASS_DEVICE void Store(Rows const& rows, Value&& value, T* out, int64_t ld) {
    ForEachPair(rows, staging_, [&](int mm, int v1, int v2, cutlass::Array<T, 2>& pair) {
      pair[0] = value(mm, v1, v2, 0), pair[1] = value(mm, v1, v2, 1);
    });
    StoreStaged(rows, staging_, out, ld);
  }

  Params const& p_;
  CUTLASS_HOST_DEVICE static Staging& StagingOf(TensorStorage& storage, int consumer) {
    return reinterpret_cast<Staging*>(&storage.collective)[kTwoStagings ? consumer : 0];
  }

  Staging& staging_;
  Staging* second_ = nullptr;  // a gated kGrad's
};

}  // namespace jaxmlp::cutlass_detail
