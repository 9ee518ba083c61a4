// The pool behind parallel_for (thread_pool.h): why it exists and how it waits is written there.
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

// Chunks per thread: a few, so that the chunks of a thread that is descheduled (another process on the core)
// are taken by the others; each chunk is still long enough that claiming it costs nothing beside its work.
constexpr int64_t kChunksPerThread = 2;
constexpr int64_t kMaxChunks = 0xffff;  // a chunk index fits the claim word's 16 bits
// How long the caller spins on a chunk another thread is running before it yields its core instead.
constexpr auto kCallerSpin = std::chrono::microseconds(20);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
#else
  if (word.load() == expected) std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
}

void futex_wake_all(std::atomic<uint32_t>& word) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

// Set while a thread runs a chunk: a parallel_for inside one runs on that thread alone.
thread_local bool in_chunk = false;

class ThreadPool {
 public:
  ThreadPool(int64_t threads, int64_t spin_us) : threads_(std::max<int64_t>(1, threads)), spin_us_(spin_us) {
    for (int64_t i = 1; i < threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  ~ThreadPool() {
    stopping_.store(true);
    generation_.fetch_add(1);
    futex_wake_all(generation_);
    for (auto& worker : workers_) worker.join();
  }

  int64_t threads() const { return threads_; }
  int64_t spin_us() const { return spin_us_; }

  void run(int64_t begin, int64_t end, int64_t grain, heteroserve::ChunkFunction f) {
    const int64_t n = end - begin;
    const int64_t chunks = std::min({(n + grain - 1) / grain, threads_ * kChunksPerThread, kMaxChunks});
    std::unique_lock<std::mutex> caller(caller_, std::try_to_lock);
    if (chunks <= 1 || threads_ == 1 || in_chunk || !caller.owns_lock()) {
      run_chunk(f, begin, end);
      return;
    }
    job_ = f;
    begin_ = begin;
    length_ = n;
    chunks_ = chunks;
    finished_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    ++job_id_;
    claim_.store(job_id_ << 32 | static_cast<uint64_t>(chunks), std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(generation_);
    run_claimed_chunks();
    wait_until_finished(chunks);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // The claim word: the job's id (upper 32 bits), the next chunk (16 bits) and the job's chunk count (16 bits).
  // A thread runs a chunk only after its compare-and-swap moved this job's next chunk forward, so a thread that
  // read an old job's word can never run a chunk of the next one.
  void run_claimed_chunks() {
    uint64_t word = claim_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = word >> 16 & 0xffff, total = word & 0xffff;
      if (next >= total) return;
      if (!claim_.compare_exchange_weak(word, word + (1 << 16), std::memory_order_acq_rel,
                                        std::memory_order_acquire)) {
        continue;
      }
      const int64_t chunk = static_cast<int64_t>(next);
      const int64_t start = begin_ + length_ * chunk / chunks_, stop = begin_ + length_ * (chunk + 1) / chunks_;
      try {
        run_chunk(job_, start, stop);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      finished_.fetch_add(1, std::memory_order_release);
      word = claim_.load(std::memory_order_acquire);
    }
  }

  static void run_chunk(heteroserve::ChunkFunction f, int64_t begin, int64_t end) {
    const bool outer = in_chunk;
    in_chunk = true;
    try {
      f.call(f.callable, begin, end);
    } catch (...) {
      in_chunk = outer;
      throw;
    }
    in_chunk = outer;
  }

  void wait_until_finished(int64_t chunks) {
    const auto spin_until = std::chrono::steady_clock::now() + kCallerSpin;
    for (int i = 0; finished_.load(std::memory_order_acquire) < chunks; ++i) {
      if (i < 64 || std::chrono::steady_clock::now() < spin_until) {
        cpu_relax();
      } else {
        sched_yield();  // the thread we wait for may be waiting for this core
      }
    }
  }

  void worker_loop() {
    uint32_t seen = 0;  // the generation the pool was built with: a job or stop published before this thread
    for (;;) {          // started is still seen as new
      seen = wait_for_job(seen);
      if (stopping_.load()) return;
      run_claimed_chunks();
    }
  }

  // Spins for spin_us after the last job, then sleeps until the caller bumps the generation.
  uint32_t wait_for_job(uint32_t seen) {
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
    for (int i = 1;; ++i) {
      const uint32_t now = generation_.load(std::memory_order_acquire);
      if (now != seen) return now;
      cpu_relax();
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= spin_until) break;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    uint32_t now;
    while ((now = generation_.load(std::memory_order_seq_cst)) == seen) futex_wait(generation_, seen);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    return now;
  }

  const int64_t threads_;
  const int64_t spin_us_;
  std::vector<std::thread> workers_;
  std::mutex caller_;  // one job at a time; a second caller runs its loop alone
  // The current job, written by the caller before it publishes the claim word.
  heteroserve::ChunkFunction job_{};
  int64_t begin_ = 0, length_ = 0, chunks_ = 0;
  uint64_t job_id_ = 0;
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> finished_{0};
  std::exception_ptr error_;
  std::mutex error_mutex_;
  std::atomic<uint32_t> generation_{0};  // the futex word sleeping workers wait on
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stopping_{false};
};

constexpr int64_t kDefaultSpinMicroseconds = 200;

std::mutex pool_mutex;
ThreadPool* pool = nullptr;  // replaced by set_kernel_threads; abandoned (not joined) in a forked child
int64_t requested_threads = 0;  // 0: torch's intra-op thread count when the pool is first used
int64_t requested_spin_us = kDefaultSpinMicroseconds;

ThreadPool& current_pool() {
  std::lock_guard<std::mutex> lock(pool_mutex);
  if (pool == nullptr) {
    pool = new ThreadPool(requested_threads > 0 ? requested_threads : at::get_num_threads(), requested_spin_us);
  }
  return *pool;
}

void set_kernel_threads(int64_t threads, int64_t spin_us) {
  TORCH_CHECK(threads >= 0 && spin_us >= 0, "set_kernel_threads: threads and spin_us must be >= 0");
  std::lock_guard<std::mutex> lock(pool_mutex);
  delete pool;
  pool = nullptr;
  requested_threads = threads;
  requested_spin_us = spin_us;
}

std::vector<int64_t> kernel_thread_settings() {
  ThreadPool& p = current_pool();
  return {p.threads(), p.spin_us()};
}

// A forked child has the parent's memory but none of its threads: it starts a pool of its own when it needs one.
const int registered_fork_handler = pthread_atfork(nullptr, nullptr, [] { pool = nullptr; });

}  // namespace

namespace heteroserve {

void parallel_run(int64_t begin, int64_t end, int64_t grain, ChunkFunction f) {
  if (end <= begin) return;
  current_pool().run(begin, end, std::max<int64_t>(1, grain), f);
}

int64_t num_threads() { return current_pool().threads(); }

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("set_kernel_threads(int threads, int spin_us) -> ()");
  m.impl("set_kernel_threads", &set_kernel_threads);
  m.def("kernel_thread_settings() -> int[]");
  m.impl("kernel_thread_settings", &kernel_thread_settings);
}
