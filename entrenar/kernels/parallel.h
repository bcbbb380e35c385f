// ParallelFor: run body(0), ..., body(chunks - 1) on XLA's intra-op thread pool.
//
// The calling thread takes chunks too, and waits only for chunks that a running thread
// has claimed. It never waits for a task still queued: two kernels that run at the
// same time on the pool's threads (XLA runs independent thunks concurrently) would
// otherwise each wait for a task queued behind the other, and deadlock. A helper that
// starts after every chunk is claimed finds nothing to do; the state it reads is
// shared-owned, so it outlives the caller.
//
// A caller that passes `multiply_adds` (its work in all) below kMinParallelWork runs
// every chunk on its own thread: waking a pool thread (a futex, tens of microseconds on
// a VM) costs more than such work (one decoding step's attention at batch 1 is three
// tasks of a few microseconds per layer). Each chunk computes the same either way.
#ifndef ENTRENAR_KERNELS_PARALLEL_H_
#define ENTRENAR_KERNELS_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace entrenar {

constexpr int64_t kMinParallelWork = int64_t{1} << 18;

inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t chunks,
                        std::function<void(int64_t)> body,
                        int64_t multiply_adds = kMinParallelWork) {
  if (chunks <= 1 || multiply_adds < kMinParallelWork) {
    for (int64_t i = 0; i < chunks; ++i) body(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t total = 0;
    std::function<void(int64_t)> body;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  state->total = chunks;
  state->body = std::move(body);
  auto work = [state] {
    for (int64_t i = state->next.fetch_add(1); i < state->total;
         i = state->next.fetch_add(1)) {
      state->body(i);
      if (state->done.fetch_add(1) + 1 == state->total) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));  // a copy
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == state->total; });
}

}  // namespace entrenar

#endif  // ENTRENAR_KERNELS_PARALLEL_H_
