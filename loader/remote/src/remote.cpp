#include "pinfeed/loader/remote.hpp"
// Naming and showing URLs (the one redaction rule), the libcurl transport
// (handles, the progress watch, retries, HEAD), S3 addressing, and
// uploads. Listings are s3_listing.cpp's. The shard cache is remote_cache.cpp's.

#include <curl/curl.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <strings.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <xxhash.h>

#include "curl_transfer.hpp"
#include "pinfeed/env.hpp"
#include "pinfeed/log.hpp"

namespace pinfeed::loader {

namespace fs = std::filesystem;
using namespace detail;

RemoteError::RemoteError(std::string url, long status, const std::string& reason)
    : Error(fmt::format("{}: {}", redact_url(url), reason)), url_(redact_url(url)), status_(status) {}

namespace {

/// pipe:COMMAND as shown: its program and the argument naming the shard
/// (itself redacted), every other word "…" (a header with a bearer token,
/// a password option). "pipe:cat a.tar" stays as it is.
/// A command's words as the shell splits them: quotes ('...', "...") and
/// backslashes kept together with what they hold, and removed.
std::vector<std::string> shell_words(std::string_view command) {
  std::vector<std::string> out;
  std::string word;
  bool in_word = false;
  char quote = 0;
  for (std::size_t i = 0; i < command.size(); ++i) {
    const char c = command[i];
    if (quote != 0) {
      if (c == quote) {
        quote = 0;
      } else if (c == '\\' && quote == '"' && i + 1 < command.size()) {
        word += command[++i];
      } else {
        word += c;
      }
    } else if (c == '\'' || c == '"') {
      quote = c;
      in_word = true;
    } else if (c == '\\' && i + 1 < command.size()) {
      word += command[++i];
      in_word = true;
    } else if (std::isspace(static_cast<unsigned char>(c)) != 0) {
      if (in_word) out.push_back(std::move(word));
      word.clear();
      in_word = false;
    } else {
      word += c;
      in_word = true;
    }
  }
  if (in_word) out.push_back(std::move(word));
  return out;
}

/// NAME=value, as the shell takes an assignment before a command.
bool is_assignment(const std::string& w) {
  const auto eq = w.find('=');
  if (eq == std::string::npos || eq == 0) return false;
  if (std::isdigit(static_cast<unsigned char>(w[0])) != 0) return false;
  return std::all_of(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(eq),
                     [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; });
}

std::string redact_pipe(const std::string& url) {
  std::string program, shard;
  bool elided = false;
  for (const std::string& w : shell_words(std::string_view(url).substr(5))) {
    if (program.empty() && is_assignment(w)) {
      elided = true;  // VAR=value before the program: a secret, often
      continue;
    }
    if (program.empty()) {
      program = w;
      continue;
    }
    const std::string& bare = w;
    const std::string path = bare.substr(0, bare.find_first_of("?#"));
    if (path.ends_with(".tar") && shard.empty()) {
      shard = redact_url(bare);
    } else {
      elided = true;
    }
  }
  std::string out = "pipe:" + program;
  if (elided) out += " \u2026";
  if (!shard.empty()) out += " " + shard;
  return out;
}

}  // namespace

std::string redact_url(const std::string& url) {
  if (url.starts_with("pipe:")) return redact_pipe(url);
  std::string out = url;
  const auto scheme = out.find("://");
  const std::size_t host = scheme == std::string::npos ? 0 : scheme + 3;
  if (const auto q = out.find_first_of("?#", host); q != std::string::npos) out.resize(q);  // signatures, tokens
  const auto path = out.find('/', host);
  if (const auto at = out.rfind('@', path == std::string::npos ? out.size() : path);
      at != std::string::npos && at >= host) {
    out.erase(host, at + 1 - host);  // user:password@
  }
  return out;
}

std::string redact_spec(const std::string& spec) {
  // Split as expand_shard_pattern splits (commas outside braces), each part shown by itself.
  std::string out, part;
  int depth = 0;
  const auto flush = [&] {
    if (!out.empty()) out += ',';
    out += is_remote_url(part) ? redact_url(part) : part;
    part.clear();
  };
  for (std::size_t i = 0; i < spec.size(); ++i) {
    const char c = spec[i];
    if (c == '\\' && i + 1 < spec.size()) {
      part += spec.substr(i++, 2);
      continue;
    }
    if (c == '{') ++depth;
    if (c == '}' && depth > 0) --depth;
    if (depth == 0 && c == ',') {
      flush();
      continue;
    }
    part += c;
  }
  flush();
  return out;
}

bool is_remote_url(std::string_view spec) noexcept {
  return spec.starts_with("http://") || spec.starts_with("https://") || spec.starts_with("s3://") ||
         spec.starts_with("pipe:");
}

namespace {

std::string env(const char* name) { return pinfeed::env::get(name).value_or(""); }

std::string trim(std::string s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

/// One section of an AWS INI file (~/.aws/credentials, ~/.aws/config).
std::map<std::string, std::string> aws_profile(const fs::path& file, const std::string& section) {
  std::map<std::string, std::string> out;
  std::ifstream in(file);
  std::string line, current;
  while (std::getline(in, line)) {
    line = trim(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[' && line.back() == ']') {
      current = trim(line.substr(1, line.size() - 2));
      if (current.starts_with("profile ")) current = trim(current.substr(8));
      continue;
    }
    const auto eq = line.find('=');
    if (current == section && eq != std::string::npos) out[trim(line.substr(0, eq))] = trim(line.substr(eq + 1));
  }
  return out;
}

struct AwsCredentials {
  std::string key, secret, token, region;
};

/// The standard places, in the AWS CLI's order: the environment, then the
/// profile (AWS_PROFILE, else "default") of ~/.aws/credentials and
/// ~/.aws/config (AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE move them).
AwsCredentials aws_credentials() {
  AwsCredentials c{env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"), env("AWS_SESSION_TOKEN"), env("AWS_REGION")};
  if (c.region.empty()) c.region = env("AWS_DEFAULT_REGION");
  const std::string home = env("HOME");
  const std::string profile = env("AWS_PROFILE").empty() ? "default" : env("AWS_PROFILE");
  if (c.key.empty() || c.secret.empty()) {
    const fs::path file = env("AWS_SHARED_CREDENTIALS_FILE").empty() ? fs::path(home) / ".aws" / "credentials"
                                                                     : fs::path(env("AWS_SHARED_CREDENTIALS_FILE"));
    auto p = aws_profile(file, profile);
    c.key = p["aws_access_key_id"];
    c.secret = p["aws_secret_access_key"];
    c.token = p["aws_session_token"];
  }
  if (c.region.empty()) {
    const fs::path file =
        env("AWS_CONFIG_FILE").empty() ? fs::path(home) / ".aws" / "config" : fs::path(env("AWS_CONFIG_FILE"));
    c.region = aws_profile(file, profile)["region"];
  }
  if (c.region.empty()) c.region = "us-east-1";
  return c;
}

}  // namespace

namespace detail {

void curl_init_once() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

long response_code(CURL* h) {
  long code = 0;
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
  return code;
}

std::size_t on_body(char* data, std::size_t size, std::size_t n, void* user) {
  auto& t = *static_cast<Transfer*>(user);
  const std::size_t bytes = size * n;
  const long code = response_code(t.handle);
  if (code < 200 || code >= 300) {
    t.error_body.append(data, std::min(bytes, std::size_t{512} - std::min<std::size_t>(512, t.error_body.size())));
    return bytes;
  }
  if (t.text != nullptr) {
    if (t.text_limit != 0 && t.text->size() + bytes > t.text_limit) {
      t.write_error =
          fmt::format("over {}, the limit for {}",
                      t.text_limit % (1ULL << 20U) == 0 && t.text_limit > 0 ? fmt::format("{} MiB", t.text_limit >> 20U)
                                                                            : fmt::format("{} bytes", t.text_limit),
                      t.text_what);
      return 0;
    }
    t.text->append(data, bytes);
    return bytes;
  }
  if (t.fd < 0) return bytes;  // a HEAD's (empty) body
  if (t.byte_limit != 0 || t.unknown_limit != 0) {
    // Note [Byte budgets]: a body past the shard's budget stops here, and a
    // server that announces one stops before its first byte is written.
    const std::uint64_t base = t.restarted || (t.resuming && code == 200) ? 0 : t.file_base;
    curl_off_t length = -1;
    curl_easy_getinfo(t.handle, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
    const bool unknown = length < 0 && t.unknown_limit != 0 && (t.byte_limit == 0 || t.unknown_limit < t.byte_limit);
    const std::uint64_t limit = unknown ? t.unknown_limit : t.byte_limit;
    const std::string& why = unknown ? t.unknown_limit_why : t.byte_limit_why;
    if (limit != 0 && length >= 0 && base + static_cast<std::uint64_t>(length) > limit) {
      t.write_error = fmt::format("the server announces {} bytes, over the {} allowed by {}",
                                  base + static_cast<std::uint64_t>(length), limit, why);
      return 0;
    }
    if (limit != 0 && base + t.written + bytes > limit) {
      t.write_error = fmt::format("more than {} bytes arrived, over the {} allowed by {}: stopped",
                                  base + t.written + bytes, limit, why);
      return 0;
    }
  }
  if (t.resuming && code == 200 && t.written == 0 && !t.restarted) {
    // Note [Remote staging]: no Range support: the whole body comes again.
    if (::ftruncate(t.fd, 0) != 0 || ::lseek(t.fd, 0, SEEK_SET) != 0) {
      t.write_error = std::strerror(errno);
      return 0;
    }
    t.restarted = true;
  }
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t w = ::write(t.fd, data + done, bytes - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      t.write_error = std::strerror(errno);
      return 0;  // curl stops with CURLE_WRITE_ERROR
    }
    done += static_cast<std::size_t>(w);
  }
  t.written += bytes;
  return bytes;
}

std::size_t on_header(char* data, std::size_t size, std::size_t n, void* user) {
  auto& t = *static_cast<Transfer*>(user);
  const std::string line(data, size * n);
  if (line.size() > 5 && strncasecmp(line.c_str(), "etag:", 5) == 0) t.etag = trim(line.substr(5));
  if (line.size() > 14 && strncasecmp(line.c_str(), "content-range:", 14) == 0) t.content_range = trim(line.substr(14));
  if (line.size() > 14 && strncasecmp(line.c_str(), "last-modified:", 14) == 0) t.last_modified = trim(line.substr(14));
  if (line.starts_with("HTTP/")) {  // a new response (after a redirect or a 100): its own headers
    t.etag.clear();
    t.last_modified.clear();
    t.content_range.clear();
  }
  return size * n;
}

Easy make_handle(const std::string& url, const RemoteConfig& config, HeaderList& headers,
                 const std::string& target_override) {
  curl_init_once();
  Easy h(curl_easy_init());
  if (!h) throw RemoteError(url, 0, "libcurl could not make a handle");
  CURL* e = h.get();
  const std::string target = target_override.empty() ? http_url(url) : target_override;
  curl_easy_setopt(e, CURLOPT_URL, target.c_str());
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  // Redirects: never for S3 (its headers carry the session token), https
  // only to https.
  curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, url.starts_with("s3://") ? 0L : 1L);
  curl_easy_setopt(e, CURLOPT_MAXREDIRS, 5L);
  curl_easy_setopt(e, CURLOPT_REDIR_PROTOCOLS_STR, url.starts_with("https://") ? "https" : "http,https");
  curl_easy_setopt(e, CURLOPT_USERAGENT, "pinfeed");
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS,
                   std::max(1L, static_cast<long>(std::min(config.connect_timeout, config.read_timeout) * 1000)));
  // A stall is watch_progress's to see (a minimum rate, headers included);
  // libcurl's own low-speed check (1 byte/s) stays as a backstop, at twice
  // the window and a second more, so that it never fires first (on a loaded
  // host it once did, at the same second, and the error named no option).
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, static_cast<long>(std::ceil(2 * config.read_timeout)) + 1);
  // A redirect target's scheme is checked by libcurl (REDIR_PROTOCOLS); a
  // response header over its limit is refused by libcurl at once.
  if (url.starts_with("s3://")) {
    const AwsCredentials c = aws_credentials();  // read each time: rotated keys and tokens are taken up
    if (c.key.empty() || c.secret.empty()) {
      throw RemoteError(url, 0,
                        "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile "
                        "in ~/.aws/credentials (AWS_PROFILE picks one); instance roles, EKS web identity "
                        "and SSO are not read: `aws configure export-credentials --format env` exports them");
    }
    const std::string sigv4 = "aws:amz:" + c.region + ":s3";
    curl_easy_setopt(e, CURLOPT_AWS_SIGV4, sigv4.c_str());  // copied by libcurl
    curl_easy_setopt(e, CURLOPT_USERNAME, c.key.c_str());
    curl_easy_setopt(e, CURLOPT_PASSWORD, c.secret.c_str());
    curl_slist* l = curl_slist_append(nullptr, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    if (!c.token.empty()) l = curl_slist_append(l, ("x-amz-security-token: " + c.token).c_str());
    headers.reset(l);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, l);
  }
  return h;
}

// Note [Bounded waits]
// Every remote wait ends: a transfer that brings less than min_rate bytes/s
// over any read_timeout seconds (counting from its start, so a server that
// trickles its headers or never answers counts too) is a stall, ended here
// and retried as one; libcurl's LOW_SPEED check (1 byte/s) let a 1 byte/s
// trickle run forever. The same callback ends a transfer at once when the
// dataset closes or the program is interrupted (RemoteConfig::cancel).
// Lock waits (Note [Cache ownership]) and pipe: commands follow the same
// rule by their own clocks.
void watch_progress(CURL* h, Transfer& t, const RemoteConfig& config) {
  t.cancel = config.cancel.get();
  t.min_rate = config.min_rate;
  t.window = std::max(0.05, config.read_timeout);
  t.window_start = std::chrono::steady_clock::now();
  t.window_bytes = 0;
  t.stalled.clear();
  t.curl_error.fill('\0');
  curl_easy_setopt(h, CURLOPT_ERRORBUFFER, t.curl_error.data());
  curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(h, CURLOPT_XFERINFODATA, &t);
  curl_easy_setopt(
      h, CURLOPT_XFERINFOFUNCTION,
      +[](void* user, curl_off_t, curl_off_t now_down, curl_off_t, curl_off_t now_up) -> int {
        auto& w = *static_cast<Transfer*>(user);
        if (w.cancel != nullptr && w.cancel->load()) return 1;
        const auto now = std::chrono::steady_clock::now();
        const double elapsed = std::chrono::duration<double>(now - w.window_start).count();
        if (elapsed < w.window) return 0;
        const auto moved = static_cast<std::uint64_t>(std::max<curl_off_t>(0, now_down + now_up));
        const double rate = static_cast<double>(moved - std::min(moved, w.window_bytes)) / elapsed;
        if (rate < std::max(w.min_rate, 1e-9)) {
          w.stalled = fmt::format(
              "{} bytes in the last {:.1f} s, under remote_min_rate {} bytes/s: "
              "a stalled or trickling server",
              moved - std::min(moved, w.window_bytes), elapsed, w.min_rate);
          return 1;
        }
        w.window_start = now;
        w.window_bytes = moved;
        return 0;
      });
}

bool final_status(long code) {
  // A 3xx that reaches us is one not followed (S3's 301 to another region,
  // a redirect past MAXREDIRS): asking again gets the same answer.
  if (code >= 300 && code < 400) return true;
  return code >= 400 && code < 500 && code != 408 && code != 429 && code != 416;
}

std::string permanent_error(CURLcode rc, const Transfer& t) {
  const std::string_view message(t.curl_error.data());
  if (rc == CURLE_RECV_ERROR && message.find("header") != std::string_view::npos &&
      (message.find("large") != std::string_view::npos || message.find("max") != std::string_view::npos)) {
    return fmt::format("{} (no retry: asking again gets the same answer)", message);  // libcurl 8: over 300 KiB
  }
  switch (rc) {
    case CURLE_URL_MALFORMAT:         // a space in the URL, an empty host
    case CURLE_UNSUPPORTED_PROTOCOL:  // a redirect to file:// or ftp://, refused by REDIR_PROTOCOLS
    case CURLE_TOO_MANY_REDIRECTS:
    case CURLE_NOT_BUILT_IN:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_LOGIN_DENIED:
      return fmt::format("{} (no retry: asking again gets the same answer)", curl_easy_strerror(rc));
    case CURLE_OUT_OF_MEMORY: return "libcurl ran out of memory (or a response header was over its limit)";
    default: return {};
  }
}

std::string retry_reason(CURLcode rc, const Transfer& t) {
  if (!t.stalled.empty()) return t.stalled;
  if (rc == CURLE_OPERATION_TIMEDOUT) {  // CI once saw libcurl's backstop fire before the window closed
    const std::string_view message(t.curl_error.data());
    return fmt::format(
        "{}: no connection, or under remote_min_rate {} bytes/s, within remote_timeout {:.1f} s: a stalled or "
        "unreachable server",
        message.empty() ? std::string_view(curl_easy_strerror(rc)) : message, t.min_rate, t.window);
  }
  return curl_easy_strerror(rc);
}

std::string status_text(long code, const std::string& body) {
  std::string reason = fmt::format("HTTP status {}", code);
  // S3's XML error: <Code>NoSuchKey</Code><Message>...</Message>.
  for (const char* tag : {"Code", "Message"}) {
    const std::string open = fmt::format("<{}>", tag), close = fmt::format("</{}>", tag);
    const auto a = body.find(open), b = body.find(close);
    if (a == std::string::npos || b == std::string::npos || b <= a) continue;
    std::string text = body.substr(a + open.size(), b - a - open.size());
    if (text.starts_with("<![CDATA[") && text.ends_with("]]>")) text = text.substr(9, text.size() - 12);
    reason += (std::string_view(tag) == "Code" ? " " : ": ") + text;
  }
  return reason;
}

double backoff_seconds(const RemoteConfig& config, unsigned attempt) {
  thread_local std::mt19937 rng{std::random_device{}()};
  const double base = std::min(8.0, config.backoff * std::pow(2.0, attempt));
  return base * std::uniform_real_distribution<double>(0.5, 1.5)(rng);  // no thundering herd of ranks
}

/// The backoff before a retry, cut short (Cancelled) when the dataset
/// closes or the program is interrupted.
void sleep_backoff(const RemoteConfig& config, unsigned attempt, const std::string& url) {
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                             std::chrono::duration<double>(backoff_seconds(config, attempt)));
  while (std::chrono::steady_clock::now() < until) {
    if (config.cancel && config.cancel->load()) throw Cancelled(fmt::format("{}: cancelled", redact_url(url)));
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
        std::chrono::milliseconds(50), until - std::chrono::steady_clock::now()));
  }
}

/// One request that has no state between tries (HEAD, a listing, an
/// upload; a fetch resumes, so it has its own loop in remote_fetch.cpp): `setup` prepares each
/// try's handle, `done` reads a 2xx answer. A final 4xx throws at once, the
/// rest is retried per `config`; the last failure throws naming the URL.
void request(const std::string& url, const RemoteConfig& config, const std::string& target,
             const std::function<void(CURL*, Transfer&)>& setup, const std::function<void(CURL*, Transfer&)>& done) {
  for (unsigned attempt = 0;; ++attempt) {
    HeaderList headers;
    Easy h = make_handle(url, config, headers, target);
    Transfer t;
    t.handle = h.get();
    curl_easy_setopt(h.get(), CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h.get(), CURLOPT_WRITEDATA, &t);
    curl_easy_setopt(h.get(), CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h.get(), CURLOPT_HEADERDATA, &t);
    watch_progress(h.get(), t, config);
    setup(h.get(), t);
    const CURLcode rc = curl_easy_perform(h.get());
    const long code = response_code(h.get());
    if (rc == CURLE_OK && code >= 200 && code < 300) {
      done(h.get(), t);
      return;
    }
    if (rc == CURLE_ABORTED_BY_CALLBACK && t.stalled.empty())
      throw Cancelled(fmt::format("{}: cancelled", redact_url(url)));
    if (!t.write_error.empty()) throw RemoteError(url, code, t.write_error);  // a bound: no retry changes it
    if (rc == CURLE_OK && final_status(code)) throw RemoteError(url, code, status_text(code, t.error_body));
    if (const std::string why = permanent_error(rc, t); !why.empty()) throw RemoteError(url, 0, why);
    const std::string last =
        !t.stalled.empty() || rc != CURLE_OK ? retry_reason(rc, t) : status_text(code, t.error_body);
    if (attempt >= config.retries) {
      throw RemoteError(url, rc == CURLE_OK ? code : 0, fmt::format("{} (gave up after {} tries)", last, attempt + 1));
    }
    sleep_backoff(config, attempt, url);
  }
}

Head head_url(const std::string& url, const RemoteConfig& config) {
  Head out;
  request(
      url, config, {}, [](CURL* h, Transfer&) { curl_easy_setopt(h, CURLOPT_NOBODY, 1L); },
      [&](CURL* h, Transfer& t) {
        out.last_modified = t.last_modified;
        curl_off_t length = -1;
        curl_easy_getinfo(h, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
        out.size_known = length >= 0;
        out.size = length >= 0 ? static_cast<std::uint64_t>(length) : 0;
        out.etag = t.etag;
      });
  return out;
}

/// Whether the server's bytes still are the cached copy's, for a server that
/// gives neither ETag nor Last-Modified: its first and last 64 KiB.
bool same_ends(const std::string& url, int local, std::uint64_t size, const RemoteConfig& config) {
  const std::uint64_t span = std::min<std::uint64_t>(size, 64 * 1024);
  for (const std::uint64_t first : {std::uint64_t{0}, size - span}) {
    std::string body, mine(span, '\0');
    const std::string range = fmt::format("{}-{}", first, first + span - 1);
    try {
      request(
          url, config, {},
          [&](CURL* h, Transfer& t) {
            body.clear();
            t.text = &body;
            t.text_limit = span;
            curl_easy_setopt(h, CURLOPT_RANGE, range.c_str());
          },
          [](CURL*, Transfer&) {});
    } catch (const RemoteError&) {
      return false;  // no Range support (the whole object came): fetched again
    }
    if (::pread(local, mine.data(), span, static_cast<off_t>(first)) != static_cast<ssize_t>(span) || body != mine) {
      return false;
    }
  }
  return true;
}

}  // namespace detail

std::string http_url(const std::string& url) {
  if (!url.starts_with("s3://")) return url;
  const std::string rest = url.substr(5);
  const auto slash = rest.find('/');
  const std::string bucket = rest.substr(0, slash), key = slash == std::string::npos ? "" : rest.substr(slash + 1);
  if (bucket.empty()) throw ConfigError(fmt::format("'{}': no bucket (s3://bucket/key)", redact_url(url)));
  std::string endpoint = env("AWS_ENDPOINT_URL_S3");
  if (endpoint.empty()) endpoint = env("AWS_ENDPOINT_URL");
  // An s3:// URL names the key as it is (the AWS CLI's convention): a space
  // or a '%' in it is sent percent-encoded, as S3 and SigV4 want.
  std::string path;
  for (const char c : key) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalnum(u) != 0 || c == '-' || c == '.' || c == '_' || c == '~' || c == '/') {
      path += c;
    } else {
      path += fmt::format("%{:02X}", u);
    }
  }
  if (!endpoint.empty()) {
    while (endpoint.ends_with('/')) endpoint.pop_back();
    return fmt::format("{}/{}/{}", endpoint, bucket, path);  // path style: what S3-compatible stores serve
  }
  std::string region = env("AWS_REGION");
  if (region.empty()) region = aws_credentials().region;
  return fmt::format("https://{}.s3.{}.amazonaws.com/{}", bucket, region, path);
}

std::string remote_shard_name(const std::string& url) {
  std::string path = url;
  if (url.starts_with("pipe:")) {
    // The command's argument naming the shard: `aws s3 cp s3://b/x-000001.tar -`.
    std::istringstream words(url.substr(5));
    std::string w, found;
    while (words >> w) {
      if (w.ends_with(".tar") || w.ends_with(".tar'") || w.ends_with(".tar\"")) found = w;
    }
    std::erase(found, '\'');
    std::erase(found, '"');
    if (found.empty()) return fmt::format("pipe-{:016x}.tar", XXH3_64bits(url.data(), url.size()));
    path = found;
  }
  if (const auto q = path.find_first_of("?#", path.find("://") == std::string::npos ? 0 : path.find("://") + 3);
      q != std::string::npos) {
    path.resize(q);  // a presigned URL's query is not part of the name
  }
  const auto slash = path.rfind('/');
  std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (name.empty() || name == "." || name == "..") {
    throw ConfigError(fmt::format("'{}': the URL names no file (a shard URL ends in its file name)", redact_url(url)));
  }
  return name;
}

void upload_file(const fs::path& file, const std::string& url, const RemoteConfig& config) {
  if (url.starts_with("pipe:")) throw ConfigError(fmt::format("'{}': pipe: is for reading shards", redact_url(url)));
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> in(std::fopen(file.c_str(), "rb"), &std::fclose);
  if (!in) throw DataError(file, std::strerror(errno));
  const auto bytes = static_cast<curl_off_t>(fs::file_size(file));
  request(
      url, config, {},
      [&](CURL* h, Transfer&) {
        std::rewind(in.get());  // each try sends the whole file
        curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
        curl_easy_setopt(h, CURLOPT_READDATA, in.get());
        curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, bytes);
      },
      [](CURL*, Transfer&) {});
}

void check_upload_target(const std::string& url) {
  if (url.starts_with("pipe:")) throw ConfigError(fmt::format("'{}': pipe: is for reading shards", redact_url(url)));
  if (!url.starts_with("s3://")) return;
  const AwsCredentials c = aws_credentials();
  if (c.key.empty() || c.secret.empty()) {
    throw RemoteError(url, 0,
                      "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile in "
                      "~/.aws/credentials (AWS_PROFILE picks one); instance roles, EKS web identity and SSO "
                      "are not read: `aws configure export-credentials --format env` exports them");
  }
}

}  // namespace pinfeed::loader
