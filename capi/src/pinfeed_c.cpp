// The C ABI over pinfeed::loader and the memory diagnostics. Every entry
// point catches everything: errors become a status and a thread-local message.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "pinfeed/error.hpp"
#include "pinfeed/loader/loader.hpp"
#include "pinfeed/loader/options.hpp"
#include "pinfeed/memory/diagnostics.hpp"
#include "pinfeed/pinfeed.h"

#include <nlohmann/json.hpp>

struct pinfeed_loader {
  std::shared_ptr<pinfeed::loader::Loader> loader;
};

struct pinfeed_options {
  pinfeed::loader::LoaderConfig config;
};

struct pinfeed_batch {
  std::shared_ptr<pinfeed::loader::Loader> loader;  // the batch must go before its Loader
  pinfeed::loader::Batch batch;
  std::string layout;
};

namespace {

thread_local std::string g_last_error;

template <class F>
pinfeed_status guarded(F&& f) noexcept {
  try {
    g_last_error.clear();
    return f();
  } catch (const pinfeed::ConfigError& e) {
    g_last_error = e.what();
    return PINFEED_ERROR_CONFIG;
  } catch (const pinfeed::DataError& e) {
    g_last_error = e.what();
    return PINFEED_ERROR_DATA;
  } catch (const pinfeed::OutOfMemory& e) {
    g_last_error = e.what();
    return PINFEED_ERROR_MEMORY;
  } catch (const std::bad_alloc&) {
    g_last_error = "out of memory";
    return PINFEED_ERROR_MEMORY;
  } catch (const pinfeed::Cancelled& e) {
    g_last_error = e.what();
    return PINFEED_ERROR_CANCELLED;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return PINFEED_ERROR;
  } catch (...) {
    g_last_error = "unknown error";
    return PINFEED_ERROR;
  }
}

pinfeed_status null_argument(const char* what) {
  g_last_error = std::string(what) + " is NULL";
  return PINFEED_ERROR_CONFIG;
}

char* copy_string(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out == nullptr) throw std::bad_alloc();
  std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

pinfeed::loader::LoaderConfig to_config(const pinfeed_loader_config& c) {
  namespace pl = pinfeed::loader;
  if (c.dataset == nullptr || *c.dataset == '\0') throw pinfeed::ConfigError("config.dataset is empty");
  pl::LoaderConfig lc;
  lc.dataset = c.dataset;
  if (c.list_root != nullptr) lc.list_root = c.list_root;
  lc.batch_size = c.batch_size;
  lc.threads = c.threads;
  lc.prefetch = c.prefetch;
  lc.rank = c.rank;
  lc.world_size = c.world_size;
  lc.shuffle = c.shuffle != 0;
  lc.drop_last = c.drop_last != 0;
  lc.drop_last_batch = c.drop_last_batch != 0;
  lc.seed = c.seed;
  // A NULL word keeps LoaderConfig's default (options.hpp).
  if (c.crop != nullptr) lc.transform.crop = pl::parse_crop_mode(c.crop);
  lc.transform.size = c.size;
  lc.transform.resize = c.resize;
  lc.transform.flip = c.flip != 0;
  if (c.layout != nullptr) lc.transform.layout = pl::parse_layout(c.layout);
  for (std::size_t i = 0; i < 3; ++i) {
    lc.transform.mean[i] = c.mean[i];
    lc.transform.std[i] = c.std[i];
  }
  if (c.bad_sample != nullptr) lc.on_bad_sample = pl::parse_bad_sample_policy(c.bad_sample);
  lc.pin = c.pin != 0;
  lc.watch_pressure = c.watch_pressure != 0;
  lc.validate();
  return lc;
}

}  // namespace

extern "C" {

const char* pinfeed_version(void) { return "0.1.0"; }
const char* pinfeed_last_error(void) { return g_last_error.c_str(); }
void pinfeed_free_string(char* s) { std::free(s); }

pinfeed_status pinfeed_options_create(pinfeed_options** out) {
  if (out == nullptr) return null_argument("out");
  *out = nullptr;
  return guarded([&] {
    *out = new pinfeed_options{};
    return PINFEED_OK;
  });
}

void pinfeed_options_destroy(pinfeed_options* options) { delete options; }

pinfeed_status pinfeed_options_set(pinfeed_options* options, const char* name, const char* value) {
  if (options == nullptr) return null_argument("options");
  if (name == nullptr) return null_argument("name");
  if (value == nullptr) return null_argument("value");
  return guarded([&] {
    pinfeed::loader::LoaderConfig next = options->config;  // a refused value leaves the options as they were
    pinfeed::loader::set_loader_field(next, name, value);
    options->config = std::move(next);
    return PINFEED_OK;
  });
}

pinfeed_status pinfeed_options_get(const pinfeed_options* options, const char* name, char** value_out) {
  if (options == nullptr) return null_argument("options");
  if (name == nullptr) return null_argument("name");
  if (value_out == nullptr) return null_argument("value_out");
  *value_out = nullptr;
  return guarded([&] {
    *value_out = copy_string(pinfeed::loader::loader_field(options->config, name));
    return PINFEED_OK;
  });
}

pinfeed_status pinfeed_options_list_json(char** json_out) {
  if (json_out == nullptr) return null_argument("json_out");
  *json_out = nullptr;
  return guarded([&] {
    namespace pl = pinfeed::loader;
    const pl::LoaderConfig defaults;
    nlohmann::json list = nlohmann::json::array();
    for (const pl::LoaderField& f : pl::loader_config_fields()) {
      list.push_back(
          {{"name", f.name}, {"type", f.type}, {"default", f.get(defaults)}, {"range", f.range}, {"help", f.help}});
    }
    for (const pl::LoaderOption& o : pl::loader_options()) {
      list.push_back({{"name", o.name},
                      {"type", pl::to_string(o.type)},
                      {"default", pl::loader_field(defaults, o.name)},
                      {"range", o.range_text()},
                      {"help", o.help}});
    }
    *json_out = copy_string(list.dump());
    return PINFEED_OK;
  });
}

pinfeed_status pinfeed_loader_create_from_options(const pinfeed_options* options, pinfeed_loader** out) {
  if (options == nullptr) return null_argument("options");
  if (out == nullptr) return null_argument("out");
  *out = nullptr;
  return guarded([&] {
    if (options->config.dataset.empty()) throw pinfeed::ConfigError("option 'dataset' is not set");
    pinfeed::loader::LoaderConfig c = options->config;
    c.validate();
    auto handle = std::make_unique<pinfeed_loader>();
    handle->loader = std::make_shared<pinfeed::loader::Loader>(std::move(c));
    *out = handle.release();
    return PINFEED_OK;
  });
}

pinfeed_status pinfeed_loader_get_option(const pinfeed_loader* loader, const char* name, char** value_out) {
  if (loader == nullptr) return null_argument("loader");
  if (name == nullptr) return null_argument("name");
  if (value_out == nullptr) return null_argument("value_out");
  *value_out = nullptr;
  return guarded([&] {
    *value_out = copy_string(pinfeed::loader::loader_field(loader->loader->config(), name));
    return PINFEED_OK;
  });
}

void pinfeed_loader_config_init(pinfeed_loader_config* c) {
  if (c == nullptr) return;
  const pinfeed::loader::LoaderConfig d;
  *c = pinfeed_loader_config{};
  c->batch_size = d.batch_size;
  c->threads = d.threads;
  c->prefetch = d.prefetch;
  c->rank = d.rank;
  c->world_size = d.world_size;
  c->shuffle = d.shuffle ? 1 : 0;
  c->drop_last = d.drop_last ? 1 : 0;
  c->drop_last_batch = d.drop_last_batch ? 1 : 0;
  c->seed = d.seed;
  // The words are the option table's (static strings: safe to keep).
  c->crop = pinfeed::loader::loader_option("crop").get_choice(d).data();
  c->size = d.transform.size;
  c->resize = d.transform.resize;
  c->flip = d.transform.flip ? 1 : 0;
  c->layout = pinfeed::loader::loader_option("layout").get_choice(d).data();
  for (std::size_t i = 0; i < 3; ++i) {
    c->mean[i] = d.transform.mean[i];
    c->std[i] = d.transform.std[i];
  }
  c->bad_sample = pinfeed::loader::loader_option("bad_sample").get_choice(d).data();
  c->pin = d.pin ? 1 : 0;
  c->watch_pressure = d.watch_pressure ? 1 : 0;
}

pinfeed_status pinfeed_loader_create(const pinfeed_loader_config* config, pinfeed_loader** out) {
  if (config == nullptr) return null_argument("config");
  if (out == nullptr) return null_argument("out");
  *out = nullptr;
  return guarded([&] {
    auto handle = std::make_unique<pinfeed_loader>();
    handle->loader = std::make_shared<pinfeed::loader::Loader>(to_config(*config));
    *out = handle.release();
    return PINFEED_OK;
  });
}

void pinfeed_loader_destroy(pinfeed_loader* loader) { delete loader; }

pinfeed_status pinfeed_loader_begin_epoch(pinfeed_loader* loader, uint64_t epoch) {
  if (loader == nullptr) return null_argument("loader");
  return guarded([&] {
    loader->loader->begin_epoch(epoch);
    return PINFEED_OK;
  });
}

pinfeed_status pinfeed_loader_next(pinfeed_loader* loader, pinfeed_batch** out) {
  if (loader == nullptr) return null_argument("loader");
  if (out == nullptr) return null_argument("out");
  *out = nullptr;
  return guarded([&] {
    std::optional<pinfeed::loader::Batch> b = loader->loader->next();
    if (!b) return PINFEED_END;
    const std::string layout(pinfeed::loader::to_string(b->layout()));
    *out = new pinfeed_batch{loader->loader, std::move(*b), layout};
    return PINFEED_OK;
  });
}

size_t pinfeed_loader_batches_per_epoch(const pinfeed_loader* loader) {
  return loader == nullptr ? 0 : loader->loader->batches_per_epoch();
}

size_t pinfeed_loader_num_classes(const pinfeed_loader* loader) {
  return loader == nullptr ? 0 : loader->loader->dataset().num_classes();
}

pinfeed_status pinfeed_loader_get_state(const pinfeed_loader* loader, pinfeed_loader_state* out) {
  if (loader == nullptr) return null_argument("loader");
  if (out == nullptr) return null_argument("out");
  return guarded([&] {
    const auto s = loader->loader->state();
    *out = pinfeed_loader_state{s.seed, s.epoch, s.position, s.world_size, s.rank};
    return PINFEED_OK;
  });
}

pinfeed_status pinfeed_loader_restore(pinfeed_loader* loader, const pinfeed_loader_state* s) {
  if (loader == nullptr) return null_argument("loader");
  if (s == nullptr) return null_argument("state");
  return guarded([&] {
    loader->loader->restore(
        pinfeed::loader::LoaderState{s->seed, s->epoch, static_cast<std::size_t>(s->position), s->world_size, s->rank});
    return PINFEED_OK;
  });
}

pinfeed_status pinfeed_loader_stats_json(const pinfeed_loader* loader, char** json_out) {
  if (loader == nullptr) return null_argument("loader");
  if (json_out == nullptr) return null_argument("json_out");
  return guarded([&] {
    *json_out = copy_string(pinfeed::loader::stats_json(loader->loader->stats()));
    return PINFEED_OK;
  });
}

pinfeed_status pinfeed_batch_get_view(const pinfeed_batch* batch, pinfeed_batch_view* out) {
  if (batch == nullptr) return null_argument("batch");
  if (out == nullptr) return null_argument("out");
  return guarded([&] {
    const auto& b = batch->batch;
    const auto data = b.data();
    out->data = const_cast<std::byte*>(data.data());
    out->bytes = data.size();
    out->size = b.size();
    out->sample_bytes = b.sample_bytes();
    const auto shape = b.shape();
    for (std::size_t i = 0; i < 4; ++i) out->shape[i] = static_cast<int64_t>(shape[i]);
    out->shape[0] = static_cast<int64_t>(b.size());
    out->dtype = b.layout() == pinfeed::loader::Layout::nhwc_u8 ? "uint8" : "float32";
    out->layout = batch->layout.c_str();
    out->labels = b.labels().data();
    out->indices = b.indices().data();
    out->pinned = b.pinned() ? 1 : 0;
    out->epoch = b.epoch();
    out->index = b.index();
    out->position = b.position();
    return PINFEED_OK;
  });
}

void pinfeed_batch_release(pinfeed_batch* batch) { delete batch; }

pinfeed_status pinfeed_diag_json(const char* root, unsigned gpus, const char* batch_shape, unsigned prefetch,
                                 char** json_out) {
  if (json_out == nullptr) return null_argument("json_out");
  return guarded([&] {
    pinfeed::memory::DiagnosticsRequest r;
    if (root != nullptr) r.root = root;
    r.gpus = gpus;
    if (batch_shape != nullptr) r.batch_shape = batch_shape;
    r.prefetch = prefetch;
    r.sample_ms = 100;
    *json_out = copy_string(pinfeed::memory::diagnostics_json(r));
    return PINFEED_OK;
  });
}

}  // extern "C"
