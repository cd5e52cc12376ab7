// The engine's kernel for a product whose A rows are gathered by cp.async (VarlenMainloop's kGatherA: FC1 of
// the MoE layer, its rows tokens of x chosen by the dispatch plan).
//
// CUTLASS 4.2's ptr-array ping-pong kernel fixes the roles of its producer warpgroup's four warps (main-loop
// loads, auxiliary loads, epilogue loads, the tile schedule), so one warp loads A, and one warp's cp.async
// copies cannot keep pace with the wgmma main loop where four can (docs/performance.md, "Rows gathered in
// FC1's loads"). GatherPingpong is that kernel's types, parameters and host side (it derives from it) with a
// device body of its own:
//   - the producer warpgroup: all 128 threads call the main loop's load for every tile (A's share of each
//     thread, B by thread 0's TMA); warp 3 also publishes the tile schedule (CUTLASS's group scheduler, whose
//     work-tile pipeline every other warp consumes), the next tile's before it loads the current one, so no
//     warp waits on its loads for the schedule;
//   - the two consumer warpgroups as in the ping-pong kernel: they take tiles in turn, one's epilogue under
//     the other's main loop (the math order barrier).
// The epilogue must load no source and write through no descriptors (GatedEpilogue: kNoDescriptors): there is
// no epilogue load warp here, and no descriptor is updated between groups.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/pipeline/pipeline.hpp"

namespace jaxmlp::cutlass_detail {

// Base: cutlass::gemm::kernel::GemmUniversal of a ptr-array ping-pong schedule, its main loop a VarlenMainloop
// with kGatherA.
template <class Base>
struct GatherPingpong : Base {
  using typename Base::ClusterShape;
  using typename Base::CollectiveEpilogue;
  using typename Base::CollectiveMainloop;
  using typename Base::Params;
  using typename Base::SharedStorage;
  using typename Base::TileScheduler;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  static_assert(Base::NumMmaWarpGroups == 2 && cute::size(TiledMma{}) == cutlass::NumThreadsPerWarpGroup,
                "two consumer warpgroups of 128 threads, one producer warpgroup");
  static_assert(CollectiveMainloop::NumProducerThreadEvents == 1 + cutlass::NumThreadsPerWarpGroup,
                "the main loop's stages count the producer warpgroup's cp.async arrivals");
  static_assert(CollectiveEpilogue::kNoDescriptors, "the epilogue loads no source and updates no descriptor");

  // The producer warps hold their rows' tokens beside the copies' addresses: at CUTLASS's 40 registers they
  // spill, at 56 not; the consumers get 224 of CUTLASS's 232 (the register file holds 128 x 56 + 256 x 224;
  // bfloat16's consumers spill nothing there, float16's epilogue a little more than at 232).
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
    enum class Role { kProducer = 0, kConsumer0 = 1, kConsumer1 = 2 };

    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem_buf);
    const int thread = int(threadIdx.x), group_thread = thread % cutlass::NumThreadsPerWarpGroup;
    const int warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
    const Role role = Role(cutlass::canonical_warp_group_idx());
    const bool producer = role == Role::kProducer, schedules = producer && warp_in_group == kScheduleWarp;

    TileScheduler scheduler{params.scheduler, shared.scheduler_response};
    CollectiveMainloop mainloop;
    CollectiveEpilogue epilogue(params.epilogue, shared.tensors.epilogue);

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
    mainloop_params.num_consumers = cutlass::NumThreadsPerWarpGroup;
    mainloop_params.num_producers = CollectiveMainloop::NumProducerThreadEvents;
    mainloop_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline mainloop_pipeline(shared.pipelines.mainloop, mainloop_params, ClusterShape{});

    // The epilogue's pipelines, which its store takes (no loads: nothing produces into the load pipeline).
    typename EpiLoadPipeline::Params epi_load_params;
    epi_load_params.role = producer ? EpiLoadPipeline::ThreadCategory::NonParticipant
                                    : EpiLoadPipeline::ThreadCategory::Consumer;
    epi_load_params.dst_blockid = block_rank_in_cluster();
    epi_load_params.producer_arv_count = cutlass::NumThreadsPerWarp;
    epi_load_params.consumer_arv_count = cutlass::NumThreadsPerWarpGroup;
    EpiLoadPipeline epi_load_pipeline(shared.pipelines.epi_load, epi_load_params);
    typename EpiStorePipeline::Params epi_store_params;
    epi_store_params.always_wait = true;
    EpiStorePipeline epi_store_pipeline(epi_store_params);

    typename Base::MathWarpGroupOrderBarrier::Params order_params;
    order_params.group_id = int(role) - int(Role::kConsumer0);
    order_params.group_size = cutlass::NumThreadsPerWarpGroup;
    typename Base::MathWarpGroupOrderBarrier math_order(shared.pipelines.math_wg_order, order_params);

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
    TiledMma tiled_mma;
    const int mma_thread = thread % size(TiledMma{});
    const auto c_tiles = CollectiveEpilogue::get_load_pipe_increment(tile);
    const auto d_tiles = CollectiveEpilogue::get_store_pipe_increment(tile);
    typename CollectiveMainloop::PipelineState stage;
    typename CollectiveEpilogue::LoadPipelineState epi_load_state;
    auto epi_store_state = cutlass::make_producer_start_state<EpiStorePipeline>();
    const auto descriptors = get<0>(epilogue.store_init(params.epilogue, shared.tensormaps.epilogue, 0, 0, 0));
    // The consumers take the schedule's tiles in turn: consumer 1 starts at its second.
    if (role == Role::kConsumer1) {
      stage.advance(TileScheduler::get_work_k_tile_count(work, problem, tile));
      epi_load_state.advance(c_tiles);
      epi_store_state.advance(d_tiles);
      work = fetch(work);
      if (!work.is_valid()) return;
    }
    do {
      problem = problem_of(work.L_idx);
      const int k_count = TileScheduler::get_work_k_tile_count(work, problem, tile);
      auto accumulators = partition_fragment_C(tiled_mma, take<0, 2>(tile));  // (MMA, MMA_M, MMA_N)
      math_order.wait();
      mainloop.mma(mainloop_pipeline, stage, accumulators, k_count, mma_thread, shared.tensors.mainloop,
                   params.mainloop);
      math_order.arrive();
      mainloop.mma_tail(mainloop_pipeline, stage, k_count);
      math_order.wait();
      stage.advance(k_count);
      auto [epi_load_next, epi_store_next] = epilogue.store(
          epi_load_pipeline, epi_load_state, epi_store_pipeline, epi_store_state, problem, tile,
          make_coord(work.M_idx, work.N_idx, _, work.L_idx), accumulators, tiled_mma, mma_thread,
          shared.tensors.epilogue, descriptors);
      // The other consumer's tile: skipped here, its k-tiles in the main loop's stages.
      work = fetch(work);
      if (work.is_valid()) {
        stage.advance(TileScheduler::get_work_k_tile_count(work, problem_of(work.L_idx), tile));
        work = fetch(work);
      }
      auto [epi_load_tail, epi_store_tail] =
          epilogue.store_tail(epi_load_pipeline, epi_load_next, epi_store_pipeline, epi_store_next);
      epi_load_state = epi_load_tail;
      epi_store_state = epi_store_tail;
      epi_load_state.advance(c_tiles);
      epi_store_state.advance(d_tiles);
      math_order.arrive();  // the other consumer's epilogue may start
    } while (work.is_valid());
#endif
  }
};

}  // namespace jaxmlp::cutlass_detail
