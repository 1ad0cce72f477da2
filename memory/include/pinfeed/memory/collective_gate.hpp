#pragma once
// CollectiveGate: keeps pinning and unpinning out of the way of device
// collectives.
//
// Note [Registration outside collectives]: cudaHostRegister and
// cudaHostUnregister are driver calls on every context of the process, and a
// driver call that waits for a device while an NCCL collective there waits
// for a peer is the deadlock pattern XLA and PyTorch met with cudaMalloc and
// cudaFree. So the pool moves a slab between pinned and pageable memory
// (registers or unregisters it) only when no collective of the process is in
// flight, and no collective starts while it does:
//
//   communicator:  auto t = gate.enter();   // waits while a registration runs
//                  enqueue the collective; record `done` after it
//                  t.track(done);           // in flight until done is ready
//   pool:          gate.exclusive(fn)       // waits until nothing is in
//                                           // flight, blocks enter(), runs fn
//
// exclusive() never blocks a collective that is already in flight, so one
// GPU's collective waiting for another GPU's (which would have to enter
// first) cannot deadlock against it. It waits at most `patience` for the
// collectives to drain; a process whose collectives never pause gets its
// registration anyway, logged, and then new collectives are not held back
// (holding them while one is in flight is the deadlock above).
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "pinfeed/memory/fence.hpp"

namespace pinfeed::memory {

class CollectiveGate {
 public:
  /// The process's gate: every pool and every device communicator of the
  /// process share it.
  static CollectiveGate& process();

  CollectiveGate() = default;
  CollectiveGate(const CollectiveGate&) = delete;
  CollectiveGate& operator=(const CollectiveGate&) = delete;

  /// A collective being enqueued: counted as in flight from enter() on;
  /// track() hands over the fence that completes with it. A ticket dropped
  /// without track() (the enqueue threw) leaves nothing in flight.
  class Ticket {
   public:
    Ticket(Ticket&& o) noexcept : gate_(o.gate_) { o.gate_ = nullptr; }
    Ticket& operator=(Ticket&&) = delete;
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;
    ~Ticket();
    void track(std::shared_ptr<Fence> done);

   private:
    friend class CollectiveGate;
    explicit Ticket(CollectiveGate* gate) noexcept : gate_(gate) {}
    CollectiveGate* gate_;
  };

  /// Waits while a registration runs, then counts a collective as entering.
  [[nodiscard]] Ticket enter();

  /// Runs `fn` with no collective in flight and none starting meanwhile
  /// (see the Note). Returns whether the collectives drained within
  /// `patience`; `fn` runs either way. Rethrows what `fn` throws.
  template <class F>
  bool exclusive(F&& fn, std::chrono::milliseconds patience = std::chrono::seconds(2)) {
    const bool drained = lock_exclusive(patience);
    struct Unlock {
      CollectiveGate* g;
      ~Unlock() { g->unlock_exclusive(); }
    } unlock{this};
    fn();
    return drained;
  }

  /// Collectives entered or not yet complete (completed ones are pruned).
  [[nodiscard]] std::size_t in_flight();
  /// exclusive() calls that had to wait for collectives, and that gave up.
  [[nodiscard]] std::uint64_t waited() const;
  [[nodiscard]] std::uint64_t gave_up() const;

 private:
  bool lock_exclusive(std::chrono::milliseconds patience);
  void unlock_exclusive() noexcept;
  void prune_locked();

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable cv_;
  bool exclusive_ = false;    // new collectives wait (a drained registration runs)
  bool registering_ = false;  // a registration runs (drained or not)
  std::size_t entering_ = 0;
  std::vector<std::shared_ptr<Fence>> tracked_;
  std::uint64_t waited_ = 0, gave_up_ = 0;
};

}  // namespace pinfeed::memory
