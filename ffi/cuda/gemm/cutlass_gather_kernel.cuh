// The engine's kernel for a product whose A rows are gathered by cp.async (VarlenMainloop's kGatherA: FC1 of
// the MoE layer, its rows tokens of x chosen by the dispatch plan).
//
// CUTLASS 4.2's ptr-array kernels fix the roles of their producer warpgroup's four warps (main-loop loads,
// auxiliary loads, epilogue loads, the tile schedule), so one warp loads A, and one warp's cp.async copies
// cannot keep pace with the wgmma main loop where four can (docs/engine-performance.md, "Rows gathered in FC1's
// loads"). Even four do not in the GEMM with 128x128 tiles, so GatherSplitN also halves A's bytes a FLOP:
// a 128x256 tile whose two consumer warpgroups split N, each a 128x128 product over the same A stage (the
// main loop's TiledMma lays its warpgroups along N; B's stage holds 64-column gate and up pieces in turn,
// so each warpgroup's 128 columns are gate and up columns for the gated epilogue). It is CUTLASS's
// ptr-array cooperative kernel's types, parameters and host side (it derives from it) with a device body of
// its own:
//   - the producer warpgroup: all 128 threads call the main loop's load for every tile (A's share of each
//     thread, B by thread 0's TMA); warp 3 also publishes the tile schedule (CUTLASS's group scheduler, whose
//     work-tile pipeline every other warp consumes), the next tile's before it loads the current one, so no
//     warp waits on its loads for the schedule;
//   - the two consumer warpgroups: both consume every stage, then each stores its 128 columns through its
//     own staging buffer (ActivationEpilogue's kTwoStagings), as the 128x128 tile 2 n + warpgroup.
// The epilogue must load no source and write through no descriptors (ActivationEpilogue: kNoDescriptors): there is
// no epilogue load warp here, and no descriptor is updated between groups.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/pipeline/pipeline.hpp"

namespace jaxmlp::cutlass_detail {

// Base: cutlass::gemm::kernel::GemmUniversal of a ptr-array cooperative schedule, its main loop a
// VarlenMainloop with kGatherA whose TiledMma lays two warpgroups along N.
template <class Base>
struct GatherSplitN : Base {
  using typename Base::ClusterShape;
  using typename Base::CollectiveEpilogue;
  using typename Base::CollectiveMainloop;
  using typename Base::Params;
  using typename Base::SharedStorage;
  using typename Base::TileScheduler;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  static_assert(Base::NumMmaWarpGroups == 2 && cute::size(TiledMma{}) == 2 * cutlass::NumThreadsPerWarpGroup,
                "two consumer warpgroups of 128 threads, one producer warpgroup");
  static constexpr int kBlkM = cute::size<0>(TileShape{}), kBlkN = cute::size<1>(TileShape{});
  static_assert(kBlkM == 128 && kBlkN == 256, "each consumer warpgroup's epilogue takes a 128x128 tile");
  // The tile each consumer warpgroup's epilogue sees: its 128 columns.
  using ConsumerTile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  static_assert(CollectiveMainloop::NumProducerThreadEvents == 1 + cutlass::NumThreadsPerWarpGroup,
                "the main loop's stages count the producer warpgroup's cp.async arrivals");
  static_assert(CollectiveEpilogue::kNoDescriptors, "the epilogue loads no source and updates no descriptor");

  // The producer warps hold their rows' source addresses a tile: at CUTLASS's 40 registers the 128x128
  // ping-pong version, which this replaced, spilled; at 56 none. The consumers get 224 of CUTLASS's 232 (the
  // register file holds 128 x 56 + 256 x 224). ptxas reports 44-60 bytes of spills for bfloat16's kernels
  // here, more for float16's; what they cost is not measured apart.
  static constexpr uint32_t kLoadRegisters = 56;
  static constexpr uint32_t kMmaRegisters = 224;
  static constexpr int kScheduleWarp = 3;

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace cute;
    using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
    using SchedulePipeline = typename TileScheduler::Pipeline;
    using EpiLoadPipeline = typename CollectiveEpilogue::LoadPipeline;
    using EpiStorePipeline = typename CollectiveEpilogue::StorePipeline;

    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem_buf);
    const int thread = int(threadIdx.x), group_thread = thread % cutlass::NumThreadsPerWarpGroup;
    const int warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
    const bool producer = cutlass::canonical_warp_group_idx() == 0;
    const bool schedules = producer && warp_in_group == kScheduleWarp;

    TileScheduler scheduler{params.scheduler, shared.scheduler_response};
    CollectiveMainloop mainloop;

    // The schedule: produced by warp 3, consumed by the other three producer warps and both consumers.
    typename SchedulePipeline::Params schedule_params;
    schedule_params.role = schedules ? SchedulePipeline::ThreadCategory::Producer
                                     : SchedulePipeline::ThreadCategory::Consumer;
    schedule_params.producer_arv_count = 1;
    schedule_params.consumer_arv_count = cutlass::NumThreadsPerWarpGroup * Base::NumMmaWarpGroups +
                                         cutlass::NumThreadsPerWarp * (cutlass::NumWarpsPerWarpGroup - 1);
    SchedulePipeline schedule_pipeline(shared.pipelines.scheduler, schedule_params);

    typename MainloopPipeline::Params mainloop_params;
    mainloop_params.role = producer ? MainloopPipeline::ThreadCategory::Producer
                                    : MainloopPipeline::ThreadCategory::Consumer;
    mainloop_params.is_leader = producer && group_thread == 0;
    mainloop_params.num_consumers = cute::size(TiledMma{});
    mainloop_params.num_producers = CollectiveMainloop::NumProducerThreadEvents;
    mainloop_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline mainloop_pipeline(shared.pipelines.mainloop, mainloop_params, ClusterShape{});

    // The epilogue's pipelines, which its store takes (no loads: nothing produces into the load pipeline).
    typename EpiLoadPipeline::Params epi_load_params;
    epi_load_params.role = producer ? EpiLoadPipeline::ThreadCategory::NonParticipant
                                    : EpiLoadPipeline::ThreadCategory::Consumer;
    epi_load_params.dst_blockid = block_rank_in_cluster();
    epi_load_params.producer_arv_count = cutlass::NumThreadsPerWarp;
    epi_load_params.consumer_arv_count = cute::size(TiledMma{});
    EpiLoadPipeline epi_load_pipeline(shared.pipelines.epi_load, epi_load_params);
    typename EpiStorePipeline::Params epi_store_params;
    epi_store_params.always_wait = true;
    EpiStorePipeline epi_store_pipeline(epi_store_params);

    // Every pipeline's barriers initialized before any thread of the cluster uses them.
    if constexpr (size(ClusterShape{}) > 1) {
      cute::cluster_arrive_relaxed();
      cute::cluster_wait();
    } else {
      __syncthreads();
    }

    const auto tile = TileShape{};
    auto work = scheduler.initial_work_tile_info(ClusterShape{});
    if (!work.is_valid()) return;  // the grid may exceed the tiles (problem shapes on the device only)
    const auto problem_of = [&](int32_t group) { return append<4>(params.problem_shape.get_problem_shape(group), 1); };
    auto problem = problem_of(work.L_idx);
    auto inputs = mainloop.load_init(problem, params.mainloop);
    const auto k_tiles = shape<3>(get<0>(inputs));
    auto schedule_consumer = typename SchedulePipeline::PipelineState{};
    // The next tile of the schedule (the schedule warp publishes it), for every warp but the schedule's.
    const auto fetch = [&](auto const& current) {
      auto next = get<0>(scheduler.fetch_next_work(current, schedule_pipeline, schedule_consumer));
      ++schedule_consumer;
      return next;
    };

    if (producer) {
      cutlass::arch::warpgroup_reg_dealloc<kLoadRegisters>();
      // Two copies of the loop, so that the three warps that only load keep none of the scheduler's state.
      const auto produce = [&](auto publishes) {
        auto stage = cutlass::make_producer_start_state<MainloopPipeline>();
        auto schedule_producer = cutlass::make_producer_start_state<SchedulePipeline>();
        int32_t group = -1;
        do {
          decltype(work) next;
          if constexpr (decltype(publishes)::value) {
            next = get<0>(scheduler.advance_to_next_work(schedule_pipeline, schedule_producer));
            ++schedule_producer;
          }
          if (work.L_idx != group) {
            group = work.L_idx;
            problem = problem_of(group);
            inputs = mainloop.tensors_perform_update(inputs, params.mainloop, problem, group);
          }
          const int k_count = TileScheduler::get_work_k_tile_count(work, problem, tile);
          auto k_iter = make_coord_iterator(idx2crd(TileScheduler::get_work_k_tile_start(work), k_tiles), k_tiles);
          mainloop.load(params.mainloop, mainloop_pipeline, stage, inputs, make_tuple(),
                        make_coord(work.M_idx, work.N_idx, _, 0), k_iter, k_count, group_thread,
                        block_rank_in_cluster(), shared.tensors.mainloop);
          stage.advance(k_count);
          if constexpr (!decltype(publishes)::value) next = fetch(work);
          work = next;
        } while (work.is_valid());
        if constexpr (decltype(publishes)::value) schedule_pipeline.producer_tail(schedule_producer);
        mainloop.load_tail(mainloop_pipeline, stage);
      };
      if (schedules) produce(cute::true_type{});
      else produce(cute::false_type{});
      return;
    }

    cutlass::arch::warpgroup_reg_alloc<kMmaRegisters>();
    // The TiledMma's warpgroup of this thread (thread % 256, as CUTLASS's kernels number the consumers'
    // threads: warpgroup 1 of the block is the TiledMma's second), whose 128 columns it holds.
    const int mma_thread = thread % size(TiledMma{}), consumer = mma_thread / cutlass::NumThreadsPerWarpGroup;
    CollectiveEpilogue epilogue(params.epilogue, shared.tensors.epilogue, consumer);
    TiledMma tiled_mma;
    typename CollectiveMainloop::PipelineState stage;
    typename CollectiveEpilogue::LoadPipelineState epi_load_state;
    auto epi_store_state = cutlass::make_producer_start_state<EpiStorePipeline>();
    const auto descriptors = get<0>(epilogue.store_init(params.epilogue, shared.tensormaps.epilogue, 0, 0, 0));
    do {
      problem = problem_of(work.L_idx);
      const int k_count = TileScheduler::get_work_k_tile_count(work, problem, tile);
      // This warpgroup's 128 x 128 accumulators (the TiledMma's warpgroups lie along N).
      auto accumulators = partition_fragment_C(tiled_mma, take<0, 2>(tile));
      mainloop.mma(mainloop_pipeline, stage, accumulators, k_count, mma_thread, shared.tensors.mainloop,
                   params.mainloop);
      mainloop.mma_tail(mainloop_pipeline, stage, k_count);
      stage.advance(k_count);
      auto [epi_load_next, epi_store_next] = epilogue.store(
          epi_load_pipeline, epi_load_state, epi_store_pipeline, epi_store_state, problem, ConsumerTile{},
          make_coord(work.M_idx, 2 * work.N_idx + consumer, _, work.L_idx), accumulators, tiled_mma,
          group_thread, shared.tensors.epilogue, descriptors);
      epi_load_state = epi_load_next;
      epi_store_state = epi_store_next;
      work = fetch(work);
    } while (work.is_valid());
#endif
  }
};

}  // namespace jaxmlp::cutlass_detail
