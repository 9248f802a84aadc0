// Row-band parallelism on XLA:CPU's own intra-op thread pool.
//
// The calling thread takes work too, and waits only for the items to be done, not for the
// scheduled tasks to exit: a task that starts after all work is claimed touches nothing but
// the shared counter block. So the handler never deadlocks on a busy pool.
//
// A call asks the pool for one helper per thread that no other call of these kernels is using:
// one device's large segment gets every core while the other devices idle, and eight simulated
// devices whose kernels run at once each stay on their own thread rather than queueing helpers
// on a pool already kept busy by the others.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace mxfp8::cpu {

// Calls of parallel_for running now, in this process.
inline std::atomic<int64_t>& calls_in_flight() {
  static std::atomic<int64_t> n{0};
  return n;
}

template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n_items, int64_t min_items_per_task,
                  const Fn& fn) {
  if (n_items <= 0) return;
  struct InFlight {
    int64_t others = calls_in_flight().fetch_add(1);
    ~InFlight() { calls_in_flight().fetch_sub(1); }
  } in_flight;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads() - in_flight.others);
  const int64_t tasks = std::min<int64_t>(
      threads, std::max<int64_t>(1, n_items / std::max<int64_t>(1, min_items_per_task)));
  if (tasks <= 1) {
    for (int64_t i = 0; i < n_items; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  // fn is only called for claimed items, and the caller waits until every item is done, so fn
  // (a reference into the caller's frame) outlives every call to it.
  auto work = [state, n_items, &fn] {
    int64_t finished = 0;
    for (int64_t i; (i = state->next.fetch_add(1)) < n_items;) {
      fn(i);
      ++finished;
    }
    if (finished && state->done.fetch_add(finished) + finished == n_items) {
      std::lock_guard<std::mutex> lock(state->mu);
      state->cv.notify_all();
    }
  };
  for (int64_t t = 1; t < tasks; ++t) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n_items; });
}

}  // namespace mxfp8::cpu
