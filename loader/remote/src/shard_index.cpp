// Index sidecars (NAME.tar.index.json): written by pinfeed-data pack and
// index, read with a bounded SAX parser (Note [Bounded sidecars]), fetched
// for a remote set before it streams.
#include "streaming.hpp"

namespace pinfeed::loader {

using detail::kMaxIndexBytes;
using detail::kMaxIndexEntries;
using detail::SidecarOutcome;

std::string shard_index_url(const std::string& shard) { return shard + ".index.json"; }

std::string shard_index_json(const fs::path& tar, std::size_t max_classes) {
  const auto samples = TarShards::index(tar, max_classes);
  nlohmann::json list = nlohmann::json::array();
  for (const auto& s : samples) list.push_back({s.key, s.offset, s.size, s.label, s.header_sum});
  nlohmann::ordered_json j{{"format", "pinfeed-shard-index"},
                           {"version", 1},
                           {"shard", tar.filename().string()},
                           {"size", fs::file_size(tar)},
                           {"samples", std::move(list)}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

fs::path write_shard_index(const fs::path& tar, std::size_t max_classes) {
  const std::string text = shard_index_json(tar, max_classes);
  const fs::path out = tar.string() + ".index.json", tmp = out.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc | std::ios::binary);
    f << text;
    if (!f.flush()) throw DataError(tmp, "cannot write the shard's index");
  }
  std::error_code ec;
  fs::rename(tmp, out, ec);
  if (ec) throw DataError(out, fmt::format("cannot write the shard's index: {}", ec.message()));
  return out;
}

namespace {

/// Note [Bounded sidecars]: a sidecar is read by a SAX handler that keeps
/// only well-formed entries ([key, offset, size, label, header_sum], whole
/// numbers) and stops at the first thing that is not one, so its memory is
/// its text and its entries, never a document tree (64 MiB of "[]," was
/// 1.75 GiB as one). The entries are then held to what a tar can be: each
/// member's data on a 512-byte block after its header, inside the shard,
/// under the sample limit, no two overlapping, no key twice; and a reader
/// checks the header's name, size and checksum before using the bytes.
class IndexReader : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit IndexReader(ShardIndex& out) : out_(out) {}

  bool null() override { return scalar("null"); }
  bool boolean(bool) override { return scalar("a boolean"); }
  bool number_integer(number_integer_t v) override {
    if (v < 0) return entry_value(Value{v, true}, "a negative number");
    return entry_value(Value{v, true}, nullptr);
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (in_entry() || top_key_ == "size" || top_key_ == "version") {
      if (v > static_cast<number_unsigned_t>(std::numeric_limits<std::int64_t>::max()))
        return fail("a number too large");
    }
    return entry_value(Value{static_cast<std::int64_t>(v), true}, nullptr);
  }
  bool number_float(number_float_t, const string_t&) override {
    return in_entry() || top_key_ == "size" ? fail("a fractional number where a whole one belongs")
                                            : scalar("a fractional number");
  }
  bool string(string_t& v) override {
    if (in_entry()) {
      if (field_ != 0) return fail("a string where a number belongs");
      entry_.key = std::move(v);
      ++field_;
      return true;
    }
    if (depth_ == 1 && top_key_ == "format") format_ = v;
    return depth_ == 1 || skipping() ? true : fail("a string where an entry belongs");
  }
  bool binary(binary_t&) override { return fail("binary data"); }
  bool start_object(std::size_t) override {
    ++depth_;
    if (depth_ == 1 || skipping()) return true;
    return fail("an object where an entry belongs");
  }
  bool end_object() override {
    --depth_;
    return true;
  }
  bool key(string_t& k) override {
    if (depth_ == 1) top_key_ = k;
    return true;
  }
  bool start_array(std::size_t) override {
    ++depth_;
    if (depth_ == 2 && top_key_ == "samples") {
      samples_seen_ = true;
      return true;
    }
    if (depth_ == 3 && top_key_ == "samples") {
      entry_ = {};
      field_ = 0;
      return true;
    }
    return skipping() ? true : fail("an array where an entry's field belongs");
  }
  bool end_array() override {
    if (depth_ == 3 && top_key_ == "samples") {
      if (field_ != 5)
        return fail(fmt::format("an entry with {} fields, not [key, offset, size, label, header_sum]", field_));
      // A member takes a header and a block at least: no more entries than
      // the shard has room for (its "size" comes first in what pack writes).
      const std::uint64_t cap = size_seen_ ? out_.size / 1024 + 1 : kMaxIndexEntries;
      if (out_.samples.size() >= std::min<std::uint64_t>(cap, kMaxIndexEntries)) {
        return fail(fmt::format("more entries than a {}-byte shard can hold", size_seen_ ? out_.size : 0));
      }
      out_.samples.push_back(std::move(entry_));
    }
    --depth_;
    return true;
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& e) override {
    if (error_.empty()) error_ = fmt::format("{} (at byte {})", e.what(), position);
    return false;
  }

  [[nodiscard]] const std::string& error() const { return error_; }
  [[nodiscard]] const std::string& format() const { return format_; }
  [[nodiscard]] std::int64_t version() const { return version_; }
  [[nodiscard]] bool has_size() const { return size_seen_; }
  [[nodiscard]] bool has_samples() const { return samples_seen_; }

 private:
  struct Value {
    std::int64_t v;
    bool whole;
  };
  [[nodiscard]] bool in_entry() const { return depth_ == 3 && top_key_ == "samples"; }
  [[nodiscard]] bool skipping() const { return depth_ >= 2 && top_key_ != "samples"; }  // another key's value
  bool fail(const std::string& what) {
    if (error_.empty()) {
      error_ = fmt::format("{} (entry {} of \"samples\")", what, out_.samples.size());
      if (!in_entry() && depth_ <= 2) error_ = what;
    }
    return false;
  }
  bool scalar(const char* what) {
    if (in_entry()) return fail(fmt::format("{} in an entry", what));
    return true;
  }
  bool entry_value(Value x, const char* problem) {
    if (depth_ == 1) {
      if (top_key_ == "size") {
        if (problem != nullptr) return fail(fmt::format("\"size\" is {}", problem));
        out_.size = static_cast<std::uint64_t>(x.v);
        size_seen_ = true;
      } else if (top_key_ == "version") {
        version_ = x.v;
      }
      return true;
    }
    if (!in_entry()) return skipping() ? true : fail("a number where an entry belongs");
    if (field_ == 0 || field_ >= 5) return fail("a number where the key belongs, or a sixth field");
    if (problem != nullptr && field_ != 3) return fail(fmt::format("{} for an offset, size or checksum", problem));
    switch (field_) {
      case 1: entry_.offset = static_cast<std::uint64_t>(x.v); break;
      case 2: entry_.size = static_cast<std::uint64_t>(x.v); break;
      case 3: entry_.label = x.v; break;
      default: entry_.header_sum = static_cast<std::uint64_t>(x.v); break;
    }
    ++field_;
    return true;
  }

  ShardIndex& out_;
  int depth_ = 0;
  std::string top_key_, format_, error_;
  std::int64_t version_ = 0;
  bool size_seen_ = false, samples_seen_ = false;
  TarShards::IndexedSample entry_;
  unsigned field_ = 0;
};

}  // namespace

ShardIndex parse_shard_index(const std::string& text, const std::string& source, std::size_t max_classes) {
  ShardIndex out;
  IndexReader reader(out);
  const bool ok = nlohmann::json::sax_parse(text, &reader, nlohmann::json::input_format_t::json, true, true);
  if (!ok || !reader.error().empty()) {
    throw DataError(
        source, fmt::format("not a readable shard index: {}", reader.error().empty() ? "malformed" : reader.error()));
  }
  if (reader.format() != "pinfeed-shard-index" || reader.version() != 1) {
    throw DataError(source, "not a pinfeed shard index (format pinfeed-shard-index, version 1)");
  }
  if (!reader.has_size() || !reader.has_samples()) {
    throw DataError(source, "not a readable shard index: no \"size\" or no \"samples\"");
  }
  std::vector<std::pair<std::uint64_t, std::size_t>> by_offset;
  std::unordered_set<std::string_view> keys;
  by_offset.reserve(out.samples.size());
  for (std::size_t k = 0; k < out.samples.size(); ++k) {
    const TarShards::IndexedSample& s = out.samples[k];
    if (s.offset < kHeader || s.offset > out.size || s.size > out.size - s.offset) {
      throw DataError(source, fmt::format("sample '{}' at byte {} ({} bytes) is outside the {}-byte shard", s.key,
                                          s.offset, s.size, out.size));
    }
    if (s.offset % kHeader != 0) {
      throw DataError(source, fmt::format("sample '{}' at byte {}: a tar member's data starts on a 512-byte block",
                                          s.key, s.offset));
    }
    if (s.size > kMaxSampleBytes) {
      throw DataError(source, fmt::format("sample '{}' is {} bytes, over the {}-byte limit for one sample", s.key,
                                          s.size, kMaxSampleBytes));
    }
    if (s.label < 0 || static_cast<std::uint64_t>(s.label) >= max_classes) {
      throw DataError(
          source, fmt::format("sample '{}': label {} is not in 0..{} (max_classes)", s.key, s.label, max_classes - 1));
    }
    if (!keys.insert(s.key).second) throw DataError(source, fmt::format("sample '{}' is listed twice", s.key));
    by_offset.emplace_back(s.offset, k);
  }
  std::sort(by_offset.begin(), by_offset.end());
  for (std::size_t k = 1; k < by_offset.size(); ++k) {
    const TarShards::IndexedSample& prev = out.samples[by_offset[k - 1].second];
    const TarShards::IndexedSample& next = out.samples[by_offset[k].second];
    if (next.offset == prev.offset && next.size == prev.size && next.header_sum == prev.header_sum) {
      continue;  // a hard link: its entry is its target's bytes, as tar extracts it
    }
    // The next member's header comes after this member's data, rounded up to a block.
    if (next.offset < prev.offset + (prev.size + kHeader - 1) / kHeader * kHeader + kHeader) {
      throw DataError(source, fmt::format("samples '{}' (byte {}) and '{}' (byte {}) overlap: not one tar's members",
                                          prev.key, prev.offset, next.key, next.offset));
    }
  }
  return out;
}

SidecarOutcome detail::fetch_sidecars(const std::vector<std::string>& specs, const std::vector<std::size_t>& remote,
                                      std::size_t max_classes, const RemoteConfig& config,
                                      std::vector<ShardIndex>& indexes) {
  std::atomic<std::size_t> next{0};
  std::atomic<bool> missing{false}, no_ranges{false};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  {
    std::vector<std::jthread> pool;
    const unsigned workers = std::max(1U, std::min<unsigned>(config.parallel, static_cast<unsigned>(remote.size())));
    for (unsigned w = 0; w < workers && !remote.empty(); ++w) {
      pool.emplace_back([&] {
        for (std::size_t k = next++; k < remote.size() && !missing; k = next++) {
          const std::size_t s = remote[k];
          const std::string url = shard_index_url(specs[s]);
          try {
            // Asked for as a Range (bytes 0-): a 206 says the server streams;
            // a plain server (python3 -m http.server) sends a 200, and the
            // set is staged instead, with no request more than the sidecars.
            std::string text;
            detail::request(
                url, config, {},
                [&](CURL* h, detail::Transfer& t) {
                  text.clear();
                  t.text = &text;
                  t.text_limit = kMaxIndexBytes;
                  t.text_what = "a shard's index sidecar";
                  curl_easy_setopt(h, CURLOPT_RANGE, "0-");
                },
                [&](CURL* h, detail::Transfer&) {
                  if (detail::response_code(h) != 206) no_ranges = true;
                });
            indexes[s] = parse_shard_index(text, redact_url(url), max_classes);
          } catch (const RemoteError& e) {
            // S3 answers 403 for a missing key to a reader without
            // s3:ListBucket: staging then says what the shard itself gets.
            if (e.status() == 404 || e.status() == 410 || e.status() == 403) {
              pinfeed::detail::log().info(
                  "remote: {} has no index sidecar ({}): staging whole shards instead of "
                  "streaming (pinfeed-data index makes sidecars)",
                  redact_url(specs[s]), e.what());
              missing = true;
              continue;
            }
            const std::scoped_lock lock(failure_mutex);
            if (!failure) failure = std::current_exception();
            next = remote.size();
          } catch (...) {
            const std::scoped_lock lock(failure_mutex);
            if (!failure) failure = std::current_exception();
            next = remote.size();
          }
        }
      });
    }
  }
  if (failure) std::rethrow_exception(failure);
  return missing ? SidecarOutcome::missing : no_ranges ? SidecarOutcome::no_ranges : SidecarOutcome::indexed;
}

}  // namespace pinfeed::loader
