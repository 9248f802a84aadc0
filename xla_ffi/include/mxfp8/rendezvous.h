// In-process rendezvous for the devices of one group: standard C++ only, no XLA types, so the
// CPU handler (which exchanges buffer pointers and completes FFI promises) and GPU handlers
// (which exchange device pointers and events) share it.
//
// Protocol. Every device of a group calls Join(key, rank, group_size, signature, arrival) once
// per execution of the op and never blocks:
//   - kWaiting: the arrival is stored; the rank returns at once (an asynchronous handler hands
//     back a pending future).
//   - kLast: this call completed the group; the entry is unlinked NOW (at the last arrival, not
//     the last departure: in a loop a released rank may already join the next iteration under
//     the same key) and every rank's arrival is returned, indexed by rank. The caller does the
//     work and then completes everyone.
//   - kFailed: the arrival contradicts the entry (group size or signature differ) or the rank
//     is out of range. Every rank already waiting in the entry is failed too, through fail().
// A watchdog thread fails the arrivals of entries that outlive their deadline, naming the ranks
// that never came, so a peer that cannot arrive (another process, a program that diverged)
// gives an error after a bounded wait instead of a hang. The table stays usable afterwards.
// An entry joined with kNoDeadline waits for its peers as long as it takes.
//
// Keys: (run id, op id, group id). A run id identifies one execution of a program, the op id one
// call site in it, the group id the devices that gather together. If the same key is joined
// twice by one rank before the group completes (the same call site reached twice in one run, or
// a second instance of it), the second arrival goes to the next entry of that key, in order.
//
// fail() and the caller's completion code run outside the table's lock, so they may re-enter
// Join (completing a promise can run the rest of a device's program inline).
//
// Exchange (below) is the blocking form for handlers that may wait on their own thread (GPU
// handlers, which XLA runs on one host thread per device): every rank blocks until the group is
// complete and gets every rank's value, or the same error as the others. It is a Table of
// waiters, so keys, ordering, mismatch checks and the watchdog are the same.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace mxfp8::rendezvous {

using Clock = std::chrono::steady_clock;

// No deadline: an entry waits until its group is complete (Clock::duration::max()).
inline constexpr Clock::duration kNoDeadline = Clock::duration::max();

// The wait bound of an op's ``timeout_ms`` attribute: ``timeout_ms <= 0`` means no deadline
// (the Python wrapper sends 0 for ``p2p_timeout_s=None`` or ``inf``), and so does any bound past
// what the clock's nanosecond count can hold (about 292 years), which would otherwise overflow
// into a deadline in the past.
inline Clock::duration timeout_from_ms(int64_t timeout_ms) {
  using std::chrono::milliseconds;
  constexpr int64_t kMaxMs = std::chrono::duration_cast<milliseconds>(kNoDeadline).count();
  if (timeout_ms <= 0 || timeout_ms >= kMaxMs) return kNoDeadline;
  return milliseconds(timeout_ms);
}

// now + timeout, saturating at Clock::time_point::max() (never reached: no deadline).
inline Clock::time_point deadline_after(Clock::time_point now, Clock::duration timeout) {
  if (timeout == kNoDeadline || timeout >= Clock::time_point::max() - now) {
    return Clock::time_point::max();
  }
  return now + timeout;
}

struct Key {
  int64_t run_id = 0;
  int64_t op_id = 0;
  int64_t group = 0;

  bool operator<(const Key& o) const {
    return std::tie(run_id, op_id, group) < std::tie(o.run_id, o.op_id, o.group);
  }
  std::string str() const {
    std::ostringstream s;
    s << "op " << op_id << ", group " << group << ", run " << run_id;
    return s.str();
  }
};

enum class Failure { kMismatch, kTimeout };

enum class Status { kWaiting, kLast, kFailed };

template <typename Arrival>
struct Joined {
  Status status = Status::kWaiting;
  std::vector<Arrival> arrivals;  // kLast: every rank's arrival, index = rank
  std::string error;              // kFailed: why
};

// Arrival: what one rank brings (pointers, sizes, a completion handle); copyable or movable.
// fail(arrival, kind, message) completes a waiting rank with an error.
template <typename Arrival>
class Table {
 public:
  using FailFn = std::function<void(Arrival&, Failure, const std::string&)>;

  explicit Table(std::string name, FailFn fail) : name_(std::move(name)), fail_(std::move(fail)) {}
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  Joined<Arrival> Join(const Key& key, int rank, int group_size, const std::string& signature,
                       Arrival arrival, Clock::duration timeout) {
    Joined<Arrival> out;
    if (group_size < 1 || rank < 0 || rank >= group_size) {
      out.status = Status::kFailed;
      out.error = name_ + " (" + key.str() + "): rank " + std::to_string(rank) +
                  " is outside a group of " + std::to_string(group_size);
      return out;
    }
    std::vector<Arrival> to_fail;
    std::string why;
    {
      std::unique_lock<std::mutex> lock(mu_);
      StartWatchdogLocked();
      auto& queue = entries_[key];
      auto it = std::find_if(queue.begin(), queue.end(), [rank](const std::shared_ptr<Entry>& e) {
        return static_cast<size_t>(rank) >= e->slots.size() || !e->slots[rank];
      });
      std::shared_ptr<Entry> e;
      if (it == queue.end()) {
        e = std::make_shared<Entry>();
        e->group_size = group_size;
        e->signature = signature;
        e->first_rank = rank;
        e->deadline = deadline_after(Clock::now(), timeout);
        e->timeout = timeout;
        e->slots.resize(static_cast<size_t>(group_size));
        queue.push_back(e);
        it = std::prev(queue.end());
        cv_.notify_all();  // the watchdog may need an earlier wake-up
      } else {
        e = *it;
      }
      if (e->group_size != group_size || e->signature != signature) {
        std::ostringstream s;
        s << name_ << " (" << key.str() << "): rank " << rank << " arrived with group size "
          << group_size << " and [" << signature << "], but rank " << e->first_rank
          << " arrived with group size " << e->group_size << " and [" << e->signature
          << "]; every device of a group must run the same op with the same shapes";
        why = s.str();
        for (auto& slot : e->slots)
          if (slot) to_fail.push_back(std::move(*slot));
        queue.erase(it);
        if (queue.empty()) entries_.erase(key);
      } else {
        e->slots[rank] = std::move(arrival);
        if (++e->count < group_size) return out;  // kWaiting
        out.status = Status::kLast;
        for (auto& slot : e->slots) out.arrivals.push_back(std::move(*slot));
        queue.erase(it);
        if (queue.empty()) entries_.erase(key);
        return out;
      }
    }
    for (auto& a : to_fail) fail_(a, Failure::kMismatch, why);
    out.status = Status::kFailed;
    out.error = why;
    return out;
  }

  // Number of entries still waiting (for tests and diagnostics).
  size_t pending() const {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (const auto& kv : entries_) n += kv.second.size();
    return n;
  }

 private:
  struct Entry {
    int group_size = 0;
    int count = 0;
    int first_rank = 0;
    std::string signature;
    Clock::time_point deadline;
    Clock::duration timeout{};
    std::vector<std::optional<Arrival>> slots;
  };

  void StartWatchdogLocked() {
    if (watchdog_started_) return;
    watchdog_started_ = true;
    // The table lives for the whole process (handlers keep it in a leaked static), so the
    // detached thread never outlives it.
    std::thread([this] { Watch(); }).detach();
  }

  void Watch() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      const auto now = Clock::now();
      auto next = Clock::time_point::max();
      struct Expired {
        Key key;
        std::shared_ptr<Entry> entry;
      };
      std::vector<Expired> expired;
      for (auto kv = entries_.begin(); kv != entries_.end();) {
        auto& queue = kv->second;
        for (auto it = queue.begin(); it != queue.end();) {
          if ((*it)->deadline <= now) {
            expired.push_back({kv->first, *it});
            it = queue.erase(it);
          } else {
            next = std::min(next, (*it)->deadline);
            ++it;
          }
        }
        kv = queue.empty() ? entries_.erase(kv) : std::next(kv);
      }
      if (!expired.empty()) {
        lock.unlock();
        for (auto& x : expired) FailExpired(x.key, *x.entry);
        lock.lock();
        continue;
      }
      if (next == Clock::time_point::max()) cv_.wait(lock);
      else cv_.wait_until(lock, next);
    }
  }

  void FailExpired(const Key& key, Entry& e) {
    std::ostringstream missing, present;
    int n_missing = 0, n_present = 0;
    for (int r = 0; r < e.group_size; ++r) {
      const bool here = e.slots[r].has_value();
      int& n = here ? n_present : n_missing;
      (here ? present : missing) << (n++ ? ", " : "") << r;
    }
    const double secs = std::chrono::duration<double>(e.timeout).count();
    std::ostringstream s;
    s << name_ << " (" << key.str() << "): ranks [" << missing.str() << "] of a group of "
      << e.group_size << " did not arrive within " << secs << " s (ranks [" << present.str()
      << "] waited). Peers can only meet when every device of the group runs this op in this "
      << "process";
    const std::string why = s.str();
    for (auto& slot : e.slots)
      if (slot) fail_(*slot, Failure::kTimeout, why);
  }

  const std::string name_;
  const FailFn fail_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool watchdog_started_ = false;
  std::map<Key, std::deque<std::shared_ptr<Entry>>> entries_;
};

// A blocking meeting of the ranks of a group: Meet() returns once every rank of the group has
// met under the same key (with every rank's value, index = rank), or fails: DEADLINE after the
// timeout when ranks are missing (naming them), a mismatch when group sizes or signatures
// differ. Values are copied to every rank, so they should be small (pointers, handles).
template <typename Value>
class Exchange {
 public:
  struct Result {
    bool ok = false;
    Failure failure = Failure::kMismatch;  // when !ok
    std::string error;                     // when !ok
    std::vector<Value> values;             // when ok: every rank's value, index = rank
  };

  explicit Exchange(std::string name)
      : table_(std::move(name), [](Waiter& w, Failure f, const std::string& why) {
          Result r;
          r.failure = f;
          r.error = why;
          w.slot->Publish(std::move(r));
        }) {}

  Result Meet(const Key& key, int rank, int group_size, const std::string& signature, Value value,
              Clock::duration timeout) {
    auto slot = std::make_shared<Slot>();
    auto joined =
        table_.Join(key, rank, group_size, signature, Waiter{std::move(value), slot}, timeout);
    switch (joined.status) {
      case Status::kFailed: {
        Result r;
        r.error = std::move(joined.error);
        return r;
      }
      case Status::kLast: {
        Result r;
        r.ok = true;
        for (auto& w : joined.arrivals) r.values.push_back(std::move(w.value));
        for (int k = 0; k < group_size; ++k)
          if (k != rank) joined.arrivals[k].slot->Publish(r);
        return r;
      }
      case Status::kWaiting: break;
    }
    // The last rank to arrive or the watchdog (past the deadline) always publishes a result.
    return slot->Wait();
  }

  size_t pending() const { return table_.pending(); }

 private:
  struct Slot {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<Result> result;

    void Publish(Result r) {
      {
        std::lock_guard<std::mutex> lock(mu);
        result = std::move(r);
      }
      cv.notify_all();
    }
    Result Wait() {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [this] { return result.has_value(); });
      return std::move(*result);
    }
  };
  struct Waiter {
    Value value;
    std::shared_ptr<Slot> slot;
  };

  Table<Waiter> table_;
};

}  // namespace mxfp8::rendezvous
