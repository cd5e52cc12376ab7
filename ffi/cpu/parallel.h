// The CPU handlers' parallelism: their work split into blocks of rows or columns, run on XLA's intra-op
// thread pool (ffi::ThreadPool), the one XLA's own CPU kernels use. OpenBLAS itself runs single-threaded
// (jaxmlp/_ffi.py): its own pool would spin between calls and take the cores XLA's threads need.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxmlp {

// Runs fn(i) for every i in [0, n): on the calling thread and on up to num_threads - 1 tasks scheduled on
// `pool`, each taking the next index until none is left. The caller waits only for indices that some thread
// has already taken, never for a task to start: a task that starts late (its pool thread busy elsewhere, or
// the pool running tasks inline) finds no index left and returns without touching fn, so this cannot
// deadlock on a busy pool and a late task never sees the caller's stack.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const Fn& fn) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    int64_t n = 0;
    std::function<void(int64_t)> fn;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  state->n = n;
  state->fn = [&fn](int64_t i) { fn(i); };
  auto work = [](State& s) {
    for (int64_t i; (i = s.next.fetch_add(1)) < s.n;) {
      s.fn(i);
      if (s.done.fetch_add(1) + 1 == s.n) {
        std::lock_guard<std::mutex> lock(s.mu);
        s.cv.notify_all();
      }
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([state, work] { work(*state); });
  work(*state);
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

// A block of rows [r0, r1) of group g.
struct RowBlock {
  int64_t g, r0, r1;
};

// Each group's rows (off[g] to off[g + 1]) in blocks, none crossing a group: one block per group on one
// thread, and with more threads blocks of about total / (2 * threads) rows (at least kMinRows, for sgemm's
// efficiency), so that a skewed routing's large groups are shared between threads too.
inline std::vector<RowBlock> RowBlocks(const std::vector<int64_t>& off, int64_t threads) {
  constexpr int64_t kMinRows = 32;
  const int64_t total = off.back();
  const int64_t rows = threads > 1 ? std::max(kMinRows, (total + 2 * threads - 1) / (2 * threads)) : total;
  std::vector<RowBlock> blocks;
  for (size_t g = 0; g + 1 < off.size(); ++g)
    for (int64_t r = off[g]; r < off[g + 1]; r += rows)
      blocks.push_back({int64_t(g), r, std::min(r + rows, off[g + 1])});
  return blocks;
}

// The number of column blocks (each at least 16 columns wide) to split a weight gradient [K, n] of a group
// with c rows into: enough that its work is shared like RowBlocks shares the rows.
inline int64_t ColumnSplits(int64_t c, int64_t total, int64_t n, int64_t threads) {
  if (threads <= 1 || c == 0) return 1;
  const int64_t parts = (c * 2 * threads + total - 1) / total;
  return std::clamp<int64_t>(parts, 1, std::max<int64_t>(1, n / 16));
}

// Columns [c0, c1) of block i of `parts` over n columns, rounded to multiples of 16 (sgemm's panel width).
inline void ColumnRange(int64_t i, int64_t parts, int64_t n, int64_t* c0, int64_t* c1) {
  auto edge = [&](int64_t k) { return k == parts ? n : std::min(n, (n * k / parts + 8) / 16 * 16); };
  *c0 = edge(i);
  *c1 = edge(i + 1);
}

}  // namespace jaxmlp
