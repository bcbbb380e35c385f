// RowPool: body(0), ..., body(chunks - 1) over up to `threads` threads, for products
// that take ~10-100 µs (a decoding step's matrix-vector products: ~210 a token).
//
// XLA's intra-op pool (parallel.h's ParallelFor) wakes a sleeping thread for every
// task: a futex wake-up and, in a virtual machine, an interrupt to the other core,
// tens of µs each, the time of the product itself (measured: a 135M model decoded
// slower on two cores than on one). Here the helper threads are the pool's own and,
// after a task, spin for kSpinNs waiting for the next one (yielding the core every
// few µs to any thread waiting for it), so during decoding a task reaches them in
// about a µs; past that they sleep on a condition variable.
//
// The calling thread claims chunks too and waits only for chunks another thread has
// claimed, never for a helper to wake up: a helper still asleep costs nothing but its
// share of the work. A job is one atomic 64-bit ticket, generation (32 bits), chunk
// count (16) and next chunk (16): a helper claims chunk i of generation g by a
// compare-and-swap of (g, n, i) to (g, n, i + 1), so a helper that read an old job's
// fields cannot claim a chunk of a newer one. One job at a time: a caller that finds the pool busy (XLA runs
// independent products concurrently) runs its chunks alone, and so does a process
// forked from one that had started helpers (they do not exist in the child).
//
// What a chunk computes must not depend on which thread runs it or on how the rows
// were split (every output row computed the same way): results are then bit-identical
// whatever the number of threads.
#ifndef ENTRENAR_KERNELS_ROW_POOL_H_
#define ENTRENAR_KERNELS_ROW_POOL_H_

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace entrenar {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class RowPool {
 public:
  // How long an idle helper spins before it sleeps.
  static constexpr int64_t kSpinNs = 2'000'000;
  // Chunks a job may have (16 bits of the ticket); more run on the caller alone.
  static constexpr int64_t kMaxChunks = 0xffff;

  // The process's pool (helpers started on first use, never stopped).
  static RowPool& Shared() {
    static RowPool* pool = [] {
      auto* p = new RowPool();  // never deleted: detached helpers may still spin
      pthread_atfork(nullptr, nullptr, [] { Forked().store(true); });
      return p;
    }();
    return *pool;
  }

  // body(i) for i < chunks over up to `threads` threads, the caller included; returns
  // when every chunk has run.
  template <typename Body>
  void Run(int threads, int64_t chunks, const Body& body) {
    if (threads <= 1 || chunks <= 1 || chunks > kMaxChunks ||
        Forked().load(std::memory_order_relaxed) || !busy_.try_lock()) {
      for (int64_t i = 0; i < chunks; ++i) body(i);
      return;
    }
    std::lock_guard<std::mutex> hold(busy_, std::adopt_lock);
    Grow(threads - 1);
    const Thunk thunk = [](const void* b, int64_t i) {
      (*static_cast<const Body*>(b))(i);
    };
    body_.store(&body, std::memory_order_relaxed);
    thunk_.store(thunk, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ((ticket_.load(std::memory_order_relaxed) >> 32) + 1) & 0xffffffffu;
    // publishes the fields
    ticket_.store(gen << 32 | static_cast<uint64_t>(chunks) << 16, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    int64_t mine = 0;
    for (int64_t i; (i = Claim(gen)) >= 0; ++mine) body(i);
    // Chunks claimed by helpers: wait for them (each is a few µs of work).
    while (done_.load(std::memory_order_acquire) + mine < chunks) CpuRelax();
  }

 private:
  using Thunk = void (*)(const void*, int64_t);

  static std::atomic<bool>& Forked() {
    static std::atomic<bool> forked{false};
    return forked;
  }

  // The next chunk of generation `gen`, or -1 when all are claimed or the job is
  // another generation's.
  int64_t Claim(uint64_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while ((t >> 32) == gen && (t & 0xffff) < ((t >> 16) & 0xffff)) {
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
        return static_cast<int64_t>(t & 0xffff);
      }
    }
    return -1;
  }

  void Grow(int helpers) {
    while (static_cast<int>(helpers_.size()) < helpers) {
      helpers_.emplace_back([this] { Helper(); });
      helpers_.back().detach();
    }
  }

  void Helper() {
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "entrenar-rows");  // ps, perf, the tests
#endif
    uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      // Wait for a new generation: spin, then sleep.
      const auto start = std::chrono::steady_clock::now();
      uint64_t gen;
      for (int spins = 0;; ++spins) {
        gen = ticket_.load(std::memory_order_acquire) >> 32;
        if (gen != seen) break;
        CpuRelax();
        // Every ~10 µs of spinning, let a thread that waits for this core run
        // (XLA's own pool threads: the helper must not keep them off a CPU).
        if ((spins & 255) == 255) std::this_thread::yield();
        if ((spins & 1023) == 1023 &&
            std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(kSpinNs)) {
          std::unique_lock<std::mutex> lock(mu_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          cv_.wait(lock, [&] {
            return (ticket_.load(std::memory_order_seq_cst) >> 32) != seen;
          });
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
          gen = ticket_.load(std::memory_order_acquire) >> 32;
          break;
        }
      }
      seen = gen;
      // The fields are read before each claim; a claim of (gen, i) succeeds only
      // while generation `gen` is published, so they were gen's.
      for (;;) {
        const void* body = body_.load(std::memory_order_relaxed);
        const Thunk thunk = thunk_.load(std::memory_order_relaxed);
        const int64_t i = Claim(gen);
        if (i < 0) break;
        thunk(body, i);
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  std::mutex busy_;  // held by the caller of the job in flight
  std::atomic<uint64_t> ticket_{0};
  std::atomic<const void*> body_{nullptr};
  std::atomic<Thunk> thunk_{nullptr};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> helpers_;  // touched only under busy_
};

}  // namespace entrenar

#endif  // ENTRENAR_KERNELS_ROW_POOL_H_
