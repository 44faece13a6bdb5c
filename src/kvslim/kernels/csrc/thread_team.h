// A native call that runs many kernels (a decoder layer, a decode step) holds torch's OpenMP
// threads for its whole length instead of opening a parallel region per kernel. Each region
// costs a wake-up of threads that libgomp put to sleep after GOMP_SPINCOUNT spins (the CLI's
// short spin keeps an idle engine from stealing other processes' cores), and a SmolLM2 decode
// step opened ~150 of them: batch-1 decode ran 100 tok/s against 135 with libgomp's long spin.
// Inside `with_team`, thread 0 runs the call's code and the others wait, spinning, for its
// kernels' work: one wake-up a call. Once the call returns the threads go back to libgomp,
// which lets them sleep as before. A second pool of our own threads was tried first: its
// spinners and OpenMP's threads, running torch's own ops, took each other's cores.
//
// `parallel_for` splits [begin, end) as at::parallel_for does (one contiguous chunk a thread,
// at most ceil(n / threads) long); every kernel here computes an output element the same way
// whichever chunk it falls in, so the split never changes a bit. Outside `with_team` (or with
// KVSLIM_THREAD_TEAM=0, the probe's baseline: benchmarks/shared_cores.py) it is at::parallel_for.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvslim_team {

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

inline bool team_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("KVSLIM_THREAD_TEAM");
    return !(env && std::string(env) == "0");
  }();
  return enabled;
}

// Fork-join over threads that are already running: run() publishes a task by bumping the
// generation, the waiting threads (serve) take their share, run() spins until all are back.
class Team {
 public:
  explicit Team(int threads) : threads_(threads) {}
  int size() const { return threads_; }
  void resize(int threads) { threads_ = threads; }   // before the first run()

  // fn(t) for t in [0, size()): t = 0 on the caller.
  template <class F>
  void run(const F& fn) {
    task_ = [](const void* f, int t) { (*static_cast<const F*>(f))(t); };
    arg_ = &fn;
    pending_.store(threads_ - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    std::exception_ptr own;
    try {
      fn(0);
    } catch (...) {
      own = std::current_exception();
    }
    while (pending_.load(std::memory_order_acquire) > 0) relax();   // they still read fn
    if (own) std::rethrow_exception(own);
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

  // Thread t's loop until finish().
  void serve(int t) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g;
      while ((g = generation_.load(std::memory_order_acquire)) == seen) relax();
      seen = g;
      if (done_.load(std::memory_order_acquire)) return;
      try {
        task_(arg_, t);
      } catch (...) {                  // a TORCH_CHECK in a worker: thrown again by run()
        std::lock_guard<std::mutex> hold(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  void finish() {
    done_.store(true, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_release);
  }

 private:
  int threads_;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int> pending_{0};
  std::atomic<bool> done_{false};
  void (*task_)(const void*, int) = nullptr;
  const void* arg_ = nullptr;
  std::exception_ptr error_;
  std::mutex error_mutex_;
};

inline thread_local Team* current = nullptr;   // set on thread 0 inside with_team
inline thread_local bool in_task = false;

// body() on this thread with torch's other threads waiting for its kernels' work.
template <class Body>
void with_team(const Body& body) {
  const int threads = at::get_num_threads();
  if (threads <= 1 || !team_enabled() || current != nullptr || in_task ||
      at::in_parallel_region()) {
    body();
    return;
  }
  Team team(threads);
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      team.resize(omp_get_num_threads());      // libgomp may give fewer than asked
      current = &team;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      current = nullptr;
      team.finish();
    } else {
      team.serve(omp_get_thread_num());
    }
  }
  if (error) std::rethrow_exception(error);
}

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  Team* team = current;
  if (team == nullptr || in_task) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t n = end - begin;
  const int64_t tasks = std::min<int64_t>(team->size(), (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (tasks <= 1) {
    f(begin, end);
    return;
  }
  const int64_t chunk = (n + tasks - 1) / tasks;
  team->run([&](int t) {
    const int64_t b = begin + t * chunk;
    if (t >= tasks || b >= end) return;
    struct Mark {
      Mark() { in_task = true; }
      ~Mark() { in_task = false; }
    } mark;
    f(b, std::min(end, b + chunk));
  });
}

}  // namespace kvslim_team
