// Between Python and the loader: DLPack capsules over a batch's slot, and
// the keyword dict of pinfeed.Loader as a LoaderConfig (module_support.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <string>
#include <string_view>

#include "module_support.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/memory/cuda_host.hpp"

namespace pinfeed::python {

namespace {

/// A tensor's owner (a host batch's Holder, or a DeviceBatch) and shape.
struct Ctx {
  std::shared_ptr<void> owner;
  std::int64_t shape[4] = {};
  DLManagedTensor tensor{};
};

void delete_managed(DLManagedTensor* t) { delete static_cast<Ctx*>(t->manager_ctx); }

}  // namespace

/// A "dltensor" capsule; if nobody consumes it, its destructor frees it.
py::capsule make_capsule(std::shared_ptr<void> owner, void* data, DLDataType dtype, int ndim, const std::int64_t* shape,
                         DLDevice device) {
  auto* ctx = new Ctx{std::move(owner), {}, {}};
  std::copy(shape, shape + ndim, ctx->shape);
  DLTensor& t = ctx->tensor.dl_tensor;
  t.data = data;
  t.device = device;
  t.ndim = ndim;
  t.dtype = dtype;
  t.shape = ctx->shape;
  t.strides = nullptr;  // compact, row-major
  t.byte_offset = 0;
  ctx->tensor.manager_ctx = ctx;
  ctx->tensor.deleter = delete_managed;
  return py::capsule(&ctx->tensor, "dltensor", [](PyObject* cap) {
    // Consumed capsules are renamed "used_dltensor" and owned by the consumer.
    if (PyCapsule_IsValid(cap, "dltensor") != 0) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
      if (m != nullptr && m->deleter != nullptr) m->deleter(m);
    }
  });
}

/// A Python value into option `o` of `c`: TypeError naming the option for a
/// value of the wrong type, ConfigError (ValueError) for one out of range.
void set_option(pl::LoaderConfig& c, const pl::LoaderOption& o, const py::handle& v) {
  // Integral: anything with __index__ (int, numpy integers, IntEnum), not
  // bool; real: anything with __float__ (float, numpy floats) or integral.
  const bool is_bool =
      PyBool_Check(v.ptr()) != 0 || py::str(py::type::handle_of(v).attr("__name__")).cast<std::string>() == "bool_";
  const bool is_int = !is_bool && PyIndex_Check(v.ptr()) != 0;
  const bool is_real = is_int || (!is_bool && PyUnicode_Check(v.ptr()) == 0 && py::hasattr(v, "__float__"));
  const auto wrong = [&](const char* want) {
    return py::type_error(fmt::format("{} must be {}, not {} ({})", o.name, want,
                                      py::str(py::type::handle_of(v).attr("__name__")).cast<std::string>(),
                                      py::repr(v).cast<std::string>()));
  };
  const auto as_int_text = [&] {
    return py::str(py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()))).cast<std::string>();
  };
  switch (o.type) {
    case pl::OptionType::integer:
      if (!is_int) throw wrong("an integer");
      o.set_text(c, as_int_text());  // negative and huge values fail the range, named
      return;
    case pl::OptionType::real:
      if (!is_real) throw wrong("a number");
      o.set_text(c, fmt::format("{:.17g}", py::float_(py::reinterpret_borrow<py::object>(v)).cast<double>()));
      return;
    case pl::OptionType::boolean:
      if (is_bool) {
        o.set_bool(c, py::bool_(py::reinterpret_borrow<py::object>(v)).cast<bool>());
      } else if (is_int && (as_int_text() == "0" || as_int_text() == "1")) {
        o.set_bool(c, as_int_text() == "1");
      } else {
        throw wrong("True or False");
      }
      return;
    case pl::OptionType::choice:
      if (PyUnicode_Check(v.ptr()) == 0) throw wrong("a string");
      o.set_text(c, v.cast<std::string>());
      return;
  }
}

/// The Python value of option `o` in `c`.
py::object option_value(const pl::LoaderConfig& c, const pl::LoaderOption& o) {
  switch (o.type) {
    case pl::OptionType::integer: return py::int_(o.get_int(c));
    case pl::OptionType::real: return py::float_(o.get_real(c));
    case pl::OptionType::boolean: return py::bool_(o.get_bool(c));
    case pl::OptionType::choice: return py::str(std::string(o.get_choice(c)));
  }
  return py::none();
}

/// The option table (options.hpp) for the Python wrapper: its keyword
/// defaults, its docstring and its tests come from here.
py::list loader_options() {
  py::list out;
  const pl::LoaderConfig defaults;
  for (const pl::LoaderOption& o : pl::loader_options()) {
    py::dict d;
    d["name"] = std::string(o.name);
    d["type"] = std::string(pl::to_string(o.type));
    d["default"] = option_value(defaults, o);
    d["range"] = o.range_text();
    d["help"] = std::string(o.help);
    if (o.type == pl::OptionType::integer || o.type == pl::OptionType::real) {
      d["min"] = o.type == pl::OptionType::integer ? py::object(py::int_(static_cast<std::uint64_t>(o.min)))
                                                   : py::object(py::float_(o.min));
      d["max"] = o.type == pl::OptionType::integer
                     ? py::object(py::int_(o.max >= 1.8446744073709552e19 ? ~std::uint64_t{0}
                                                                          : static_cast<std::uint64_t>(o.max)))
                     : py::object(py::float_(o.max));
      d["min_exclusive"] = o.min_exclusive;
    }
    if (o.type == pl::OptionType::choice) {
      py::list choices;
      for (const auto w : o.choices) choices.append(std::string(w));
      d["choices"] = choices;
    }
    out.append(d);
  }
  return out;
}

pl::LoaderConfig to_config(const py::dict& d) {
  pl::LoaderConfig c;
  c.dataset = d["dataset"].cast<std::string>();
  if (d.contains("list_root") && !d["list_root"].is_none()) c.list_root = d["list_root"].cast<std::string>();
  if (d.contains("rank")) c.rank = d["rank"].cast<unsigned>();
  if (d.contains("world_size")) c.world_size = d["world_size"].cast<unsigned>();
  // The GPU the slots are registered with (its NUMA node, its context): the
  // rank's own, never a default device 0 in every rank. None or a device
  // this process cannot see (a CPU-only host): none.
  if (d.contains("cuda_device") && !d["cuda_device"].is_none()) {
    const int dev = d["cuda_device"].cast<int>();
    c.cuda_device = dev >= 0 && dev < pinfeed::memory::cuda::runtime_status().device_count ? dev : -1;
  }
  // Every other key is an option of the table (an unknown one is an error)
  // or a field row (loader_config_fields()): those above and mean/std below
  // take Python's types; a row added later is set from its text.
  static constexpr std::array<std::string_view, 7> kTyped{"dataset",     "list_root", "rank", "world_size",
                                                          "cuda_device", "mean",      "std"};
  for (const auto& [key, value] : d) {
    const auto name = key.cast<std::string>();
    if (const pl::LoaderField* f = pl::find_loader_field(name)) {
      if (std::find(kTyped.begin(), kTyped.end(), name) == kTyped.end()) f->set(c, py::str(value).cast<std::string>());
    } else {
      set_option(c, pl::loader_option(name), value);
    }
  }
  if (d.contains("mean")) {
    const auto mean = d["mean"].cast<std::vector<float>>();
    if (mean.size() != 3) throw pinfeed::ConfigError("mean must have 3 values (R, G, B)");
    std::copy(mean.begin(), mean.end(), c.transform.mean.begin());
  }
  if (d.contains("std")) {
    const auto deviation = d["std"].cast<std::vector<float>>();
    if (deviation.size() != 3) throw pinfeed::ConfigError("std must have 3 values (R, G, B)");
    std::copy(deviation.begin(), deviation.end(), c.transform.std.begin());
  }
  c.validate();
  return c;
}

}  // namespace pinfeed::python
