// _pinfeed: the Python binding of pinfeed::loader (pybind11). Batches leave
// as DLPack capsules pointing into the pool slot (zero-copy); the slot goes
// back to the pool when the last tensor made from them is freed. Each capsule
// also keeps the C++ Loader alive, so tensors may outlive the Python Loader.
// The Python-facing API (torch tensors, iteration, state_dict) is in
// pinfeed/__init__.py.
#include <cxxabi.h>
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>
#include <chrono>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "module_support.hpp"
#include "pinfeed/env.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/launch_env.hpp"
#include "pinfeed/loader/dataset.hpp"
#include "pinfeed/loader/loader.hpp"
#include "pinfeed/loader/options.hpp"
#include "pinfeed/loader/remote.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/memory/cuda_host.hpp"
#include "pinfeed/memory/diagnostics.hpp"
#include "pinfeed/trainer/cpu_backend.hpp"
#include "pinfeed/trainer/device_feed.hpp"
#include "pinfeed/trainer/device_type.hpp"

namespace py = pybind11;
namespace pl = pinfeed::loader;
namespace pt = pinfeed::trainer;

using pinfeed::python::Holder;
using pinfeed::python::loader_options;
using pinfeed::python::make_capsule;
using pinfeed::python::option_value;
using pinfeed::python::set_option;
using pinfeed::python::to_config;
using pinfeed::python::without_gil;

namespace {

#if PINFEED_TEST_HOOKS
// Built with the tests only (PINFEED_BUILD_TESTS): the wheel does not ship it.
/// A consumer for tests of the non_blocking rule on the CPU backend: a
/// stream that reads memory asynchronously, `delay` after it is asked to, as
/// a queued tensor.cuda(non_blocking=True) copy does.
class CpuConsumer {
 public:
  explicit CpuConsumer(std::int64_t delay_us) : delay_(delay_us) {
    backend = std::make_shared<pt::CpuBackend>(pt::CpuBackendConfig{});
    const auto current = backend->scoped_current();
    stream_ = backend->create_stream();
  }
  ~CpuConsumer() {
    py::gil_scoped_release release;
    synchronize_impl();
  }
  CpuConsumer(const CpuConsumer&) = delete;
  CpuConsumer& operator=(const CpuConsumer&) = delete;
  [[nodiscard]] std::uintptr_t handle() const noexcept { return reinterpret_cast<std::uintptr_t>(stream_.get()); }
  /// Enqueues a copy of `bytes` at `address`; returns its number for result().
  std::size_t read(std::uintptr_t address, std::size_t bytes) {
    const auto current = backend->scoped_current();
    auto out = std::make_shared<std::string>();
    results_.push_back(out);
    const auto delay = std::chrono::microseconds(delay_);
    const auto* src = reinterpret_cast<const char*>(address);
    backend->enqueue(*stream_, [out, src, bytes, delay] {
      std::this_thread::sleep_for(delay);
      out->assign(src, bytes);
    });
    return results_.size() - 1;
  }
  void synchronize() {
    py::gil_scoped_release release;
    synchronize_impl();
  }
  py::bytes result(std::size_t i) const { return py::bytes(*results_.at(i)); }

  std::shared_ptr<pt::CpuBackend> backend;

 private:
  void synchronize_impl() {
    const auto current = backend->scoped_current();
    backend->synchronize(*stream_);
  }
  std::int64_t delay_;
  std::unique_ptr<pt::Stream> stream_;
  std::vector<std::shared_ptr<std::string>> results_;
};
#endif

/// A Loader made on a thread of its own, the GIL released, while this
/// thread runs the interpreter's signal handlers every 50 ms: an exception
/// they raise (KeyboardInterrupt) sets `cancel`, waits for the open to end,
/// and is raised here instead of its result.
std::shared_ptr<pl::Loader> open_interruptibly(pl::LoaderConfig config, std::atomic<bool>& cancel) {
  std::shared_ptr<pl::Loader> made;
  std::exception_ptr error;
  std::atomic<bool> done{false};
  std::thread opener([&] {
    try {
      made = std::make_shared<pl::Loader>(std::move(config));
    } catch (...) {
      error = std::current_exception();
    }
    done.store(true);
  });
  std::optional<py::error_already_set> interrupted;  // fetched at once: no error stays set across GIL hand-offs
  while (!done.load()) {
    without_gil([&] {
      for (int k = 0; k < 10 && !done.load(); ++k) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    });
    if (!interrupted && !done.load() && PyErr_CheckSignals() != 0) {
      interrupted.emplace();
      cancel.store(true);
    }
  }
  without_gil([&] { opener.join(); });
  if (interrupted) {
    without_gil([&] { made.reset(); });  // opened after all, or cancelled: either way not wanted
    throw std::move(*interrupted);
  }
  if (error) std::rethrow_exception(error);
  return made;
}

class PyLoader {
 public:
  /// `device`: None, or {"type": "cpu"|"cuda", "index", "normalize",
  /// "copy_delay_us"}: batches go to that device through a DeviceFeed.
  PyLoader(const py::dict& config, const py::object& device) {
    pl::LoaderConfig c = to_config(config);
    if (!device.is_none()) {
      const auto d = device.cast<py::dict>();
      const auto type = d["type"].cast<std::string>();
      pt::BackendOptions options;
      options.copy_delay = std::chrono::microseconds(d["copy_delay_us"].cast<std::int64_t>());
      options.keep_caller_device = true;  // torch's current device stays torch's
      const pt::DeviceType& dt = pt::device_type(type);
      const int index = d["index"].cast<int>();
      if (dt.indexed) c.cuda_device = index;  // the slots belong to the device the batches go to
      if (dt.visible() <= (dt.indexed ? index : 0)) {
        throw pinfeed::ConfigError(fmt::format("device='{}:{}': {}", type, index,
                                               dt.visible() == 0
                                                   ? fmt::format("no {} device is visible to pinfeed", type)
                                                   : fmt::format("{} visible", dt.visible())));
      }
      std::shared_ptr<pt::DeviceBackend> backend = dt.make_backend(index, options);
      pt::DeviceFeedOptions fo;
      fo.normalize = d["normalize"].cast<bool>();
      const auto out = d["dtype"].cast<std::string>();
      fo.output = out == "float16" ? pt::FloatType::f16 : out == "bfloat16" ? pt::FloatType::bf16 : pt::FloatType::f32;
      std::copy(c.transform.mean.begin(), c.transform.mean.end(), fo.norm.mean.begin());
      std::copy(c.transform.std.begin(), c.transform.std.end(), fo.norm.std.begin());
      dlpack_device_ = DLDevice{dt.indexed ? kDLCUDA : kDLCPU, dt.indexed ? index : 0};
      feed_ = std::make_shared<pt::DeviceFeed>(std::move(backend), fo);
    }
    // Opening and indexing a dataset can take a while (remote shards staged,
    // sidecars fetched, another rank's lock waited for): it runs on a thread
    // of its own while this one takes signals, and Ctrl-C cancels it
    // (RemoteConfig::cancel: transfers, backoffs, lock waits and pipe:
    // commands end within 100 ms) and raises KeyboardInterrupt.
    auto cancel = std::make_shared<std::atomic<bool>>(false);
    c.remote.cancel = cancel;
    loader_ = open_interruptibly(std::move(c), *cancel);
  }
  ~PyLoader() {
    if (::getpid() != pid_) {
      // A forked child's copy: the threads these objects would join and the
      // streams they would wait for do not exist here. Destroying them would
      // hang or abort; they are left to the process's end instead.
      (void)new std::shared_ptr<pl::Loader>(std::move(loader_));
      (void)new std::shared_ptr<pt::DeviceFeed>(std::move(feed_));
      (void)new std::optional<Submitted>(std::move(ahead_));
      return;
    }
    if (_Py_IsFinalizing() != 0) {  // at shutdown: no GIL hand-off a daemon thread could be ended in
      ahead_.reset();
      feed_.reset();
      return;
    }
    py::gil_scoped_release release;  // the feed waits for its copies, the loader for its threads
    ahead_.reset();
    feed_.reset();
    // Stopped without the GIL: a decoding thread may wait for bytes an
    // in-process Python server (a test's, a user's proxy) sends only when it
    // gets the GIL.
    loader_.reset();
  }
  PyLoader(const PyLoader&) = delete;
  PyLoader& operator=(const PyLoader&) = delete;

  /// The loader's threads exist only in the process that created it.
  void check_process() const {
    if (::getpid() == pid_) return;
    throw pinfeed::Error(fmt::format(
        "pinfeed.Loader: this loader was created in process {} and is used in process {}, a fork of it "
        "(multiprocessing's 'fork' start method, os.fork, a DataLoader worker). Its decode threads do not exist in a "
        "forked process, so it would wait forever: create the Loader in the child process (or use the 'spawn' start "
        "method)",
        pid_, ::getpid()));
  }

  void begin_epoch(std::uint64_t epoch) {
    check_process();
    without_gil([&] {
      ahead_.reset();
      loader_->begin_epoch(epoch);
    });
  }
  void begin_order(std::uint64_t epoch, std::vector<std::size_t> order, std::size_t position) {
    check_process();
    without_gil([&] {
      ahead_.reset();
      loader_->begin_epoch(epoch, std::move(order), position);
    });
  }
  void restore(std::uint64_t seed, std::uint64_t epoch, std::size_t position, unsigned world_size, unsigned rank) {
    check_process();
    without_gil([&] {
      ahead_.reset();
      loader_->restore(pl::LoaderState{seed, epoch, position, world_size, rank});
    });
  }

  /// (images capsule, labels capsule, indices, pinned) or None at the end.
  /// `consumer`: None, ("cuda", device, cudaStream_t) or a CpuConsumer:
  /// where the batch may be read asynchronously, so that its slot goes back
  /// after that stream's work at the tensors' death, not at their death.
  py::object next(const py::object& consumer) {
    check_process();
    // Batches the program holds are lent out of the pool as needed (Note
    // [Lent slots]): holding them never stops the loop.
    std::vector<pt::ConsumerStream> c = to_consumers(consumer);
    std::optional<pl::Batch> b = wait_next();
    if (!b) return py::none();
    auto h = std::make_shared<Holder>(loader_, live_, std::move(*b), std::move(c));
    pl::Batch& batch = h->batch;
    const auto shape = batch.shape();
    for (std::size_t i = 0; i < 4; ++i) h->shape[i] = static_cast<std::int64_t>(shape[i]);
    h->shape[0] = static_cast<std::int64_t>(batch.size());
    h->label_shape[0] = static_cast<std::int64_t>(batch.size());
    const bool u8 = batch.layout() == pl::Layout::nhwc_u8;
    const DLDataType dtype = u8 ? DLDataType{kDLUInt, 8, 1} : DLDataType{kDLFloat, 32, 1};
    auto images = make_capsule(h, batch.mutable_data().data(), dtype, 4, h->shape);
    // The labels are the program's own memory, never a view of the slot: a
    // loop that keeps them (all_labels.append(labels)) keeps a few bytes, as
    // with DataLoader, not a whole batch.
    auto owned = std::make_shared<std::vector<std::int64_t>>(batch.labels().begin(), batch.labels().end());
    auto labels = make_capsule(owned, owned->data(), DLDataType{kDLInt, 64, 1}, 1, h->label_shape);
    std::vector<std::size_t> indices(batch.indices().begin(), batch.indices().end());
    return py::make_tuple(images, labels, indices, batch.pinned());
  }

  /// With a device: (images capsule, labels capsule, host labels, indices,
  /// pinned) of the next batch, on the device and ready for `consumer`
  /// (Note [Consumer streams]), or None at the end. One batch is copied
  /// ahead, so its copy overlaps the consumer's work on this one.
  py::object next_device(std::uintptr_t consumer) {
    check_process();
    if (!feed_) throw pinfeed::ConfigError("this loader has no device");
    if (!ahead_) ahead_ = submit_next();
    if (!ahead_) return py::none();
    // The next batch first: if waiting for it fails (a DataError, Ctrl-C),
    // this one stays ahead_ for the next call instead of being lost.
    std::optional<Submitted> next = submit_next();
    Submitted current = std::move(*ahead_);
    ahead_ = std::move(next);
    without_gil([&] { current.batch->hand_to(consumer); });  // a host consumer waits for the copy here
    const pt::DeviceBatch& d = *current.batch;
    DLDataType dtype{kDLUInt, 8, 1};
    if (d.floats()) {
      dtype = d.float_type() == pt::FloatType::f16    ? DLDataType{kDLFloat, 16, 1}
              : d.float_type() == pt::FloatType::bf16 ? DLDataType{kDLBfloat, 16, 1}
                                                      : DLDataType{kDLFloat, 32, 1};
    }
    auto images = make_capsule(current.batch, d.images(), dtype, 4, d.shape().data(), dlpack_device_);
    const std::int64_t n = d.shape()[0];
    auto labels = make_capsule(current.batch, d.labels(), DLDataType{kDLInt, 64, 1}, 1, &n, dlpack_device_);
    return py::make_tuple(images, labels, current.labels, current.indices, current.pinned);
  }

  [[nodiscard]] py::dict feed_stats() const {
    py::dict out;
    if (!feed_) return out;
    const pt::DeviceFeedStats s = feed_->stats();
    out["batches"] = s.batches;
    out["bytes"] = s.bytes;
    out["device_buffers"] = s.device_buffers;
    out["wait_copy_seconds"] = s.wait_copy_seconds;
    out["copy_seconds"] = s.copy_seconds;
    out["wait_consumer_seconds"] = s.wait_consumer_seconds;
    out["copy_gb_per_s"] = s.copy_seconds > 0 ? static_cast<double>(s.bytes) / s.copy_seconds / 1e9 : 0.0;
    out["wait_batch_seconds"] = wait_batch_seconds_;
    out["device"] = feed_->backend().name();
    return out;
  }

  [[nodiscard]] py::dict state() const {
    const auto s = loader_->state();
    py::dict d;
    d["seed"] = s.seed;
    d["epoch"] = s.epoch;
    // The batch copied ahead was taken from the loader but not yielded.
    d["position"] = s.position - (ahead_ ? ahead_->indices.size() : 0);
    d["world_size"] = s.world_size;
    d["rank"] = s.rank;
    return d;
  }
  [[nodiscard]] std::size_t batches_per_epoch() const { return loader_->batches_per_epoch(); }
  [[nodiscard]] std::size_t samples_per_epoch() const { return loader_->samples_per_epoch(); }
  [[nodiscard]] std::size_t num_classes() const { return loader_->dataset().num_classes(); }
  [[nodiscard]] std::size_t dataset_size() const { return loader_->dataset().size(); }
  [[nodiscard]] long live_batches() const { return live_->load(); }
  [[nodiscard]] unsigned threads() const { return loader_->threads(); }
  // Paths and class names cross into Python as bytes, decoded there with
  // os.fsdecode (the filesystem encoding with surrogateescape): a name that
  // is not UTF-8 is legal on Linux and must neither raise nor be lost.

  /// The class names: ImageFolder's folders, else "0", "1", ... (labels).
  [[nodiscard]] py::list classes() const {
    py::list out;
    if (named_classes()) {
      for (const auto& name : loader_->dataset().class_names()) out.append(py::bytes(name));
      return out;
    }
    for (std::size_t c = 0; c < loader_->dataset().num_classes(); ++c) out.append(py::bytes(std::to_string(c)));
    return out;
  }
  /// Where each of `indices` lives (a path, or "shard.tar:member").
  /// (top, left, height, width, flipped): the box of the source image that
  /// sample `index` shows in `epoch`, as torchvision's get_params gives it
  /// (RandomResizedCrop's crop; the whole image for center and full).
  [[nodiscard]] py::tuple crop_params(std::size_t index, std::uint64_t epoch) const {
    const pl::CropPlan p = without_gil([&] { return loader_->crop_plan(index, epoch); });
    return py::make_tuple(p.y.lo, p.x.lo, p.y.hi - p.y.lo, p.x.hi - p.x.lo, p.flip);
  }
  [[nodiscard]] py::list describe(const std::vector<std::size_t>& indices) const {
    const pl::Dataset& d = loader_->dataset();
    py::list out;
    for (const std::size_t i : indices) {
      if (i >= d.size()) throw py::index_error(fmt::format("sample {} is not in the dataset of {}", i, d.size()));
      out.append(py::bytes(d.describe(i)));
    }
    return out;
  }
  /// Every sample's (path, label), in dataset order.
  [[nodiscard]] py::list samples() const {
    const pl::Dataset& d = loader_->dataset();
    py::list out;
    for (std::size_t i = 0; i < d.size(); ++i) out.append(py::make_tuple(py::bytes(d.describe(i)), d.label(i)));
    return out;
  }
  /// The dataset's fingerprint (computed once): samples, num_classes,
  /// classes (bytes; None for numeric labels) and hash (16 hex digits).
  [[nodiscard]] py::dict fingerprint() {
    if (!fingerprint_) {
      pl::DatasetFingerprint f;
      {
        py::gil_scoped_release release;  // stats; another thread may run Python meanwhile
        f = pl::fingerprint(loader_->dataset());
      }
      if (!fingerprint_) fingerprint_ = std::move(f);  // with the GIL: one writer
    }
    py::dict d;
    d["samples"] = fingerprint_->samples;
    d["num_classes"] = fingerprint_->num_classes;
    if (fingerprint_->classes.empty()) {
      d["classes"] = py::none();
    } else {
      py::list names;
      for (const auto& c : fingerprint_->classes) names.append(py::bytes(c));
      d["classes"] = names;
    }
    d["hash"] = fmt::format("{:016x}", fingerprint_->hash);
    return d;
  }
  /// Whether the classes have names (an ImageFolder), not label numbers.
  [[nodiscard]] bool named_classes() const { return !loader_->dataset().class_names().empty(); }
  /// What changed from the fingerprint `was` (fingerprint()'s form) to this
  /// loader's dataset; "" when nothing did.
  [[nodiscard]] std::string dataset_change(const py::dict& was) {
    (void)fingerprint();
    pl::DatasetFingerprint w;
    w.samples = was["samples"].cast<std::uint64_t>();
    w.num_classes = was["num_classes"].cast<std::uint64_t>();
    if (!was["classes"].is_none()) w.classes = was["classes"].cast<std::vector<std::string>>();
    const auto hash = was["hash"].cast<std::string>();
    const auto [end, ec] = std::from_chars(hash.data(), hash.data() + hash.size(), w.hash, 16);
    if (ec != std::errc{} || end != hash.data() + hash.size() || hash.empty()) {
      throw pinfeed::ConfigError(fmt::format("state_dict's dataset hash '{}' is not 16 hexadecimal digits", hash));
    }
    return pl::describe_change(w, *fingerprint_);
  }
  [[nodiscard]] py::dict pin_report() const {
    const pl::PinReport& r = loader_->pin_report();
    py::dict d;
    d["slots"] = r.slots;
    d["pinned_slots"] = r.pinned_slots;
    d["slot_bytes"] = r.slot_bytes;
    d["budget_bytes"] = r.budget_bytes;
    d["limiting"] = r.limiting;
    d["local_ranks"] = r.local_ranks;
    d["cuda_device"] = loader_->config().cuda_device;
    d["reason"] = r.reason;
    d["note"] = r.note;
    return d;
  }
  [[nodiscard]] std::string stats_json() const { return pl::stats_json(loader_->stats()); }

 private:
  /// The next batch (None at the end), waited for in slices with the GIL
  /// released, running the interpreter's signal handlers between them:
  /// Ctrl-C raises KeyboardInterrupt within ~50 ms however long the batch
  /// takes, and the loader stays usable.
  std::optional<pl::Batch> wait_next() {
    for (;;) {
      const bool ready = without_gil([&] { return loader_->wait_ready(std::chrono::milliseconds(50)); });
      if (ready) break;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
    return without_gil([&] { return loader_->next(); });
  }

  /// None, a CpuConsumer, or a list of ("cuda", device, cudaStream_t).
  std::vector<pt::ConsumerStream> to_consumers(const py::object& consumer) {
    if (consumer.is_none()) return {};
#if PINFEED_TEST_HOOKS
    if (py::isinstance<CpuConsumer>(consumer)) {
      auto& cpu = consumer.cast<CpuConsumer&>();
      return {pt::ConsumerStream{cpu.backend, cpu.handle()}};
    }
#endif
    std::vector<pt::ConsumerStream> out;
    for (const auto& item : consumer.cast<py::list>()) out.push_back(cuda_consumer(item.cast<py::tuple>()));
    return out;
  }
  pt::ConsumerStream cuda_consumer(const py::tuple& t) {
    const int device = t[1].cast<int>();
    auto& backend = cuda_consumers_[device];
    if (!backend) {
      const pt::DeviceType& cuda = pt::device_type("cuda");
      if (cuda.visible() <= device) {
        throw pinfeed::ConfigError(fmt::format("torch's CUDA device {} is not visible to pinfeed", device));
      }
      pt::BackendOptions options;
      options.keep_caller_device = true;
      backend = cuda.make_backend(device, options);
    }
    return {backend, t[2].cast<std::uintptr_t>()};
  }

  /// A batch on its way to the device, with its host fields.
  struct Submitted {
    std::shared_ptr<pt::DeviceBatch> batch;
    std::vector<std::int64_t> labels;
    std::vector<std::size_t> indices;
    bool pinned = false;
  };
  std::optional<Submitted> submit_next() {
    const auto t0 = std::chrono::steady_clock::now();
    std::optional<pl::Batch> b = wait_next();
    wait_batch_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!b) return std::nullopt;
    Submitted s;
    s.labels.assign(b->labels().begin(), b->labels().end());
    s.indices.assign(b->indices().begin(), b->indices().end());
    s.pinned = b->pinned();
    s.batch = without_gil([&] { return feed_->submit(std::move(*b)); });
    return s;
  }

  pid_t pid_ = ::getpid();  // the process whose threads the loader has
  // Declared first, destroyed last: batches and the feed go before the loader.
  std::shared_ptr<pl::Loader> loader_;
  std::shared_ptr<pt::DeviceFeed> feed_;
  std::optional<Submitted> ahead_;
  DLDevice dlpack_device_{kDLCPU, 0};
  double wait_batch_seconds_ = 0;  // device path: waiting for the decoders (a free slot, a decoded batch)
  std::map<int, std::shared_ptr<pt::DeviceBackend>> cuda_consumers_;  // torch's devices, for next(consumer)
  std::shared_ptr<std::atomic<long>> live_ = std::make_shared<std::atomic<long>>(0);
  std::optional<pl::DatasetFingerprint> fingerprint_;
};

}  // namespace

/// Sets `type` as the pending Python error. The message is decoded as
/// os.fsdecode does: a path in it that is not UTF-8 must not turn the error
/// into a UnicodeDecodeError that hides it.
template <typename E>
void raise(py::exception<E>& type, const char* what) {
  PyObject* message = PyUnicode_DecodeFSDefault(what);
  if (message == nullptr) return;  // MemoryError is pending
  PyErr_SetObject(type.ptr(), message);
  Py_DECREF(message);
}

namespace {

/// pinfeed's errors become Python exceptions with the same message.
void bind_errors(py::module_& m) {
  static py::exception<pinfeed::Error> base(m, "Error");
  static py::exception<pinfeed::ConfigError> config_error(m, "ConfigError", PyExc_ValueError);
  static py::exception<pinfeed::DataError> data_error(m, "DataError", base.ptr());
  static py::exception<pinfeed::HeldLimit> held_limit(m, "HeldLimitError", base.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pinfeed::ConfigError& e) {
      raise(config_error, e.what());
    } catch (const pinfeed::DataError& e) {
      raise(data_error, e.what());
    } catch (const pinfeed::HeldLimit& e) {
      raise(held_limit, e.what());
    } catch (const pinfeed::Error& e) {
      raise(base, e.what());
    } catch (const std::system_error& e) {
      // A thread that could not start: which limit, and what to lower.
      PyErr_SetString(PyExc_RuntimeError, pinfeed::describe_failure(e).c_str());
    } catch (const std::bad_alloc& e) {
      PyErr_SetString(PyExc_MemoryError, pinfeed::describe_failure(e).c_str());
    }
  });
}

void bind_loader(py::module_& m) {
#if PINFEED_TEST_HOOKS
  py::class_<CpuConsumer>(m, "CpuConsumer")
      .def(py::init<std::int64_t>(), py::arg("delay_us"))
      .def("read", &CpuConsumer::read)
      .def("synchronize", &CpuConsumer::synchronize)
      .def("result", &CpuConsumer::result);
#endif
  py::class_<PyLoader>(m, "Loader")
      .def(py::init<const py::dict&, const py::object&>(), py::arg("config"), py::arg("device") = py::none())
      .def("next_device", &PyLoader::next_device)
      .def("feed_stats", &PyLoader::feed_stats)
      .def("begin_epoch", &PyLoader::begin_epoch)
      .def("restore", &PyLoader::restore)
      .def("begin_order", &PyLoader::begin_order, py::arg("epoch"), py::arg("order"), py::arg("position") = 0)
      .def("next", &PyLoader::next, py::arg("consumer") = py::none())
      .def("state", &PyLoader::state)
      .def("batches_per_epoch", &PyLoader::batches_per_epoch)
      .def("samples_per_epoch", &PyLoader::samples_per_epoch)
      .def("num_classes", &PyLoader::num_classes)
      .def("dataset_size", &PyLoader::dataset_size)
      .def("live_batches", &PyLoader::live_batches)
      .def("threads", &PyLoader::threads)
      .def("classes", &PyLoader::classes)
      .def("fingerprint", &PyLoader::fingerprint)
      .def("named_classes", &PyLoader::named_classes)
      .def("dataset_change", &PyLoader::dataset_change)
      .def("describe", &PyLoader::describe)
      .def("crop_params", &PyLoader::crop_params, py::arg("index"), py::arg("epoch"))
      .def("samples", &PyLoader::samples)
      .def("pin_report", &PyLoader::pin_report)
      .def("stats_json", &PyLoader::stats_json);
}

py::dict launch_env_dict(const std::optional<std::pair<int, int>>& group) {
  std::optional<pinfeed::ProcessGroupView> view;
  if (group) {
    view.emplace();
    view->rank = group->first;
    view->world_size = group->second;
  }
  const pinfeed::LaunchEnv e = group
                                   ? pinfeed::read_launch_env([](const char* n) { return pinfeed::env::raw(n); }, view)
                                   : pinfeed::read_launch_env();
  py::dict d;
  d["rank"] = e.rank;
  d["world_size"] = e.world_size;
  d["local_rank"] = e.local_rank;
  d["local_world_size"] = e.local_size;
  d["launcher"] = e.launcher;
  d["source"] = e.source;
  return d;
}

std::string diag_json(const std::string& root, unsigned gpus, const std::string& batch, unsigned prefetch,
                      unsigned sample_ms) {
  pinfeed::memory::DiagnosticsRequest r;
  r.root = root;
  r.gpus = gpus;
  r.batch_shape = batch;
  r.prefetch = prefetch;
  r.sample_ms = sample_ms;
  py::gil_scoped_release release;
  return pinfeed::memory::diagnostics_json(r);
}

void bind_functions(py::module_& m) {
  m.def("launch_env", &launch_env_dict, py::arg("group") = py::none(),
        "where this process sits in a launch (pinfeed/launch_env.hpp); group: torch.distributed's (rank, world_size)");
  m.def(
      "sampler_indices",
      [](std::size_t dataset_size, unsigned rank, unsigned world_size, bool shuffle, std::uint64_t seed, bool drop_last,
         std::uint64_t epoch) {
        pl::SamplerConfig c{dataset_size, rank, world_size, shuffle, drop_last, seed};
        c.validate();
        return pl::DistributedSampler(c).indices(epoch);
      },
      py::arg("dataset_size"), py::arg("rank"), py::arg("world_size"), py::arg("shuffle"), py::arg("seed"),
      py::arg("drop_last"), py::arg("epoch"), "pinfeed's DistributedSampler: rank's indices of an epoch");
  m.def(
      "expand_shard_pattern",
      [](const std::string& pattern) {
        std::vector<std::string> out;
        for (const auto& p : pl::expand_shard_pattern(pattern)) out.push_back(p.string());
        return out;
      },
      "a shard pattern's sources, as webdataset's braceexpand expands it ('\\,' a literal comma)");
  m.def("redact_spec", &pl::redact_spec,
        "a dataset spec as pinfeed shows it: URLs without user:password@, query and fragment, pipe: commands "
        "as their program and shard");
  m.def("loader_options", &loader_options, "the loader's option table: name, type, default, range, help");
  m.def("default_normalization", [] {
    const pl::TransformConfig t;
    return py::make_tuple(py::make_tuple(t.mean[0], t.mean[1], t.mean[2]),
                          py::make_tuple(t.std[0], t.std[1], t.std[2]));
  });
  m.def("set_log_level", [](const std::string& level) {
    const auto l = spdlog::level::from_str(level);
    if (l == spdlog::level::off && level != "off")
      throw pinfeed::ConfigError("log level '" + level + "' is not trace, debug, info, warning, error or off");
    pinfeed::detail::log().set_level(l);
  });
  m.def("check_same_classes", &pl::check_same_class_names, py::arg("train"), py::arg("val"),
        "ConfigError naming the first difference unless the class names (bytes) are the same");
  m.def("diag_json", &diag_json, py::arg("root"), py::arg("gpus"), py::arg("batch"), py::arg("prefetch"),
        py::arg("sample_ms"));
}

}  // namespace

PYBIND11_MODULE(_pinfeed, m) {
  m.doc() = "pinfeed's C++ loader (use the pinfeed package, not this module)";
  // Warnings only until pinfeed.set_log_level says otherwise: an info line
  // per Loader on every rank is noise in a training log.
  pinfeed::detail::log().set_level(spdlog::level::warn);
  bind_errors(m);
  bind_loader(m);
  bind_functions(m);
}
