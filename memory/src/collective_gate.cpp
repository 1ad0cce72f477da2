#include "pinfeed/memory/collective_gate.hpp"

#include <algorithm>

#include "pinfeed/log.hpp"

namespace pinfeed::memory {

CollectiveGate& CollectiveGate::process() {
  static CollectiveGate gate;
  return gate;
}

CollectiveGate::Ticket::~Ticket() {
  if (gate_ == nullptr) return;
  {
    const std::scoped_lock lock(gate_->mutex_);
    --gate_->entering_;
  }
  gate_->cv_.notify_all();
}

void CollectiveGate::Ticket::track(std::shared_ptr<Fence> done) {
  if (gate_ == nullptr) return;
  {
    const std::scoped_lock lock(gate_->mutex_);
    --gate_->entering_;
    gate_->prune_locked();  // keeps the list to what is really in flight
    if (done) gate_->tracked_.push_back(std::move(done));
  }
  gate_->cv_.notify_all();
  gate_ = nullptr;
}

CollectiveGate::Ticket CollectiveGate::enter() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return !exclusive_; });
  ++entering_;
  return Ticket(this);
}

void CollectiveGate::prune_locked() {
  std::erase_if(tracked_, [](const std::shared_ptr<Fence>& f) { return f->ready(); });
}

std::size_t CollectiveGate::in_flight() {
  const std::scoped_lock lock(mutex_);
  prune_locked();
  return entering_ + tracked_.size();
}

std::uint64_t CollectiveGate::waited() const {
  const std::scoped_lock lock(mutex_);
  return waited_;
}

std::uint64_t CollectiveGate::gave_up() const {
  const std::scoped_lock lock(mutex_);
  return gave_up_;
}

bool CollectiveGate::lock_exclusive(std::chrono::milliseconds patience) {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return !registering_; });  // one registration at a time
  registering_ = true;
  const auto deadline = std::chrono::steady_clock::now() + patience;
  bool waited = false, drained = true;
  for (;;) {
    prune_locked();
    if (entering_ == 0 && tracked_.empty()) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      drained = false;
      ++gave_up_;
      pinfeed::detail::log().warn("collective gate: {} collective(s) still in flight after {} ms; registering anyway",
                                  entering_ + tracked_.size(), patience.count());
      break;
    }
    waited = true;
    // Fences do not notify: poll them, and wake at once on a track().
    cv_.wait_for(lock, std::chrono::milliseconds(1));
  }
  if (waited) ++waited_;
  // Drained: hold new collectives back while the registration runs. Not
  // drained: a collective in flight may wait for one that has yet to enter
  // (another GPU of this process), so nothing is held back: the
  // registration runs beside them, as it would without the gate.
  exclusive_ = drained;
  return drained;
}

void CollectiveGate::unlock_exclusive() noexcept {
  {
    const std::scoped_lock lock(mutex_);
    exclusive_ = false;
    registering_ = false;
  }
  cv_.notify_all();
}

}  // namespace pinfeed::memory
