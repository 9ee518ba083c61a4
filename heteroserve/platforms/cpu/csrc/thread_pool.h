// The kernels' own threads: parallel_for runs on a pool of this library's, not on OpenMP's team.
//
// OpenMP's wait policy is whatever the environment says: with OMP_WAIT_POLICY=PASSIVE every parallel region
// wakes sleeping threads through the kernel (batch-1 decode at half speed), with the default policy its threads
// spin for a long while after each region, and two processes on the same cores then wait on each other's
// spinning threads (many times slower each: bench/results/HISTORY.md). The pool decides for itself: a worker
// spins for a short budget after a job (the next kernel of a step starts within microseconds), then sleeps on a
// futex until the next one.
// Work is claimed chunk by chunk from a shared counter, so a worker that is asleep or descheduled never holds
// the caller up: the caller runs the chunks nobody has taken, and yields its core while it waits for a chunk
// another thread has started.
#pragma once

#include <cstdint>
#include <utility>

namespace heteroserve {

// A callable's address and a trampoline that calls it on [begin, end): the pool stores no std::function.
struct ChunkFunction {
  void (*call)(const void* callable, int64_t begin, int64_t end);
  const void* callable;
};

// Runs f(b, e) over disjoint ranges covering [begin, end), each at least `grain` long (except a short tail),
// on the pool's threads and the caller's. Ranges are independent: which thread runs one never changes a result.
// Called from inside a chunk (or while another thread has the pool), it runs f(begin, end) on the caller alone.
void parallel_run(int64_t begin, int64_t end, int64_t grain, ChunkFunction f);

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  parallel_run(begin, end, grain,
               ChunkFunction{[](const void* callable, int64_t b, int64_t e) { (*static_cast<const F*>(callable))(b, e); },
                             &f});
}

// Threads in the pool, the caller's included.
int64_t num_threads();

}  // namespace heteroserve
