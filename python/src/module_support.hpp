#pragma once
// What the binding's files share (private to python/src): the GIL helper,
// the batch holder behind DLPack capsules, and the conversions between
// Python values and the loader's config (convert.cpp).
#include <cxxabi.h>
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "pinfeed/loader/loader.hpp"
#include "pinfeed/loader/options.hpp"
#include "pinfeed/trainer/device_feed.hpp"

namespace pinfeed::python {

namespace py = pybind11;
namespace pl = pinfeed::loader;
namespace pt = pinfeed::trainer;

/// Runs `f` with the GIL released and takes it back in ordinary code, never
/// in a destructor. At interpreter shutdown a daemon thread that takes the
/// GIL back is ended by the interpreter (pthread_exit, a forced unwind);
/// from pybind11's gil_scoped_release destructor, which is noexcept, that
/// unwind called std::terminate: "terminate called without an active
/// exception", exit 134. Here the unwind passes through plain
/// frames and the thread just ends.
template <class F>
auto without_gil(F&& f) -> decltype(f()) {
  PyThreadState* state = PyEval_SaveThread();
  std::exception_ptr error;
  if constexpr (std::is_void_v<decltype(f())>) {
    try {
      f();
    } catch (abi::__forced_unwind&) {
      throw;  // a thread being ended: never swallowed
    } catch (...) {
      error = std::current_exception();
    }
    PyEval_RestoreThread(state);
    if (error) std::rethrow_exception(error);
  } else {
    std::optional<decltype(f())> out;
    try {
      out.emplace(f());
    } catch (abi::__forced_unwind&) {
      throw;
    } catch (...) {
      error = std::current_exception();
    }
    PyEval_RestoreThread(state);
    if (error) std::rethrow_exception(error);
    return std::move(*out);
  }
}

/// One batch shared by its image and label tensors. The slot goes back when
/// both die, or, with a consumer, after the consumer's work at that moment
/// (Note [Consumer streams]).
struct Holder {
  std::shared_ptr<pl::Loader> loader;  // the batch must go before its Loader
  std::shared_ptr<std::atomic<long>> live;
  pl::Batch batch;
  std::vector<pt::ConsumerStream> consumers;
  std::int64_t shape[4] = {};
  std::int64_t label_shape[1] = {};
  Holder(std::shared_ptr<pl::Loader> l, std::shared_ptr<std::atomic<long>> n, pl::Batch b,
         std::vector<pt::ConsumerStream> c)
      : loader(std::move(l)), live(std::move(n)), batch(std::move(b)), consumers(std::move(c)) {
    ++*live;
  }
  ~Holder() {
    // The slot goes back now, or after the consumers' queued work (the
    // non_blocking rule, Note [Consumer streams]).
    if (!consumers.empty()) pt::release_after_consumers(batch.lease(), consumers);
    --*live;
  }
  Holder(const Holder&) = delete;
  Holder& operator=(const Holder&) = delete;
};

/// A "dltensor" capsule; if nobody consumes it, its destructor frees it.
py::capsule make_capsule(std::shared_ptr<void> owner, void* data, DLDataType dtype, int ndim, const std::int64_t* shape,
                         DLDevice device = DLDevice{kDLCPU, 0});
/// A Python value into option `o` of `c`: TypeError naming the option for a
/// value of the wrong type, ConfigError (ValueError) for one out of range.
void set_option(pl::LoaderConfig& c, const pl::LoaderOption& o, const py::handle& v);
/// The Python value of option `o` in `c`.
py::object option_value(const pl::LoaderConfig& c, const pl::LoaderOption& o);
/// The option table (options.hpp) for the Python wrapper.
py::list loader_options();
/// The Python Loader's keyword dict as a validated LoaderConfig.
pl::LoaderConfig to_config(const py::dict& d);

}  // namespace pinfeed::python
