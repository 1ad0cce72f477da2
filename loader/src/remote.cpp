#include "pinfeed/loader/remote.hpp"

#include <curl/curl.h>
#include <fcntl.h>
#include <spawn.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/sysmacros.h>
#include <sys/statvfs.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <ctime>
#include <atomic>
#include <cerrno>
#include <cctype>
#include <csignal>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <new>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "pinfeed/env.hpp"
#include "pinfeed/file_io.hpp"
#include "pinfeed/log.hpp"
#include "pinfeed/units.hpp"
#include "curl_transfer.hpp"

extern char** environ;

namespace pinfeed::loader {

namespace fs = std::filesystem;

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
  if (const auto at = out.rfind('@', path == std::string::npos ? out.size() : path); at != std::string::npos && at >= host) {
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
    const fs::path file = env("AWS_CONFIG_FILE").empty() ? fs::path(home) / ".aws" / "config" : fs::path(env("AWS_CONFIG_FILE"));
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
      t.write_error = fmt::format("over {}, the limit for {}", t.text_limit % (1ULL << 20U) == 0 && t.text_limit > 0
                                                                  ? fmt::format("{} MiB", t.text_limit >> 20U)
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
  // libcurl's own low-speed check (1 byte/s, body only) stays as a backstop.
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, std::max(1L, static_cast<long>(std::ceil(config.read_timeout))));
  // A redirect target's scheme is checked by libcurl (REDIR_PROTOCOLS); a
  // response header over 100 KiB is refused by libcurl at once.
  if (url.starts_with("s3://")) {
    const AwsCredentials c = aws_credentials();  // read each time: rotated keys and tokens are taken up
    if (c.key.empty() || c.secret.empty()) {
      throw RemoteError(url, 0, "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile "
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
  curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(h, CURLOPT_XFERINFODATA, &t);
  curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION,
                   +[](void* user, curl_off_t, curl_off_t now_down, curl_off_t, curl_off_t now_up) -> int {
                     auto& w = *static_cast<Transfer*>(user);
                     if (w.cancel != nullptr && w.cancel->load()) return 1;
                     const auto now = std::chrono::steady_clock::now();
                     const double elapsed = std::chrono::duration<double>(now - w.window_start).count();
                     if (elapsed < w.window) return 0;
                     const auto moved = static_cast<std::uint64_t>(std::max<curl_off_t>(0, now_down + now_up));
                     const double rate = static_cast<double>(moved - std::min(moved, w.window_bytes)) / elapsed;
                     if (rate < std::max(w.min_rate, 1e-9)) {
                       w.stalled = fmt::format("{} bytes in the last {:.1f} s, under remote_min_rate {} bytes/s: "
                                               "a stalled or trickling server",
                                               moved - std::min(moved, w.window_bytes), elapsed, w.min_rate);
                       return 1;
                     }
                     w.window_start = now;
                     w.window_bytes = moved;
                     return 0;
                   });
}

/// Why a transfer ended by its progress callback ended: a stall (retried)
/// or the dataset closing (final).
std::string aborted_why(const Transfer& t) { return t.stalled; }

bool final_status(long code) {
  // A 3xx that reaches us is one not followed (S3's 301 to another region,
  // a redirect past MAXREDIRS): asking again gets the same answer.
  if (code >= 300 && code < 400) return true;
  return code >= 400 && code < 500 && code != 408 && code != 429 && code != 416;
}

std::string permanent_error(CURLcode rc) {
  switch (rc) {
    case CURLE_URL_MALFORMAT:  // a space in the URL, an empty host
    case CURLE_UNSUPPORTED_PROTOCOL:  // a redirect to file:// or ftp://, refused by REDIR_PROTOCOLS
    case CURLE_TOO_MANY_REDIRECTS:
    case CURLE_NOT_BUILT_IN:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_LOGIN_DENIED:
      return fmt::format("{} (no retry: asking again gets the same answer)", curl_easy_strerror(rc));
    case CURLE_OUT_OF_MEMORY:
      return "libcurl ran out of memory (or a response header was over its 100 KiB limit)";
    default:
      return {};
  }
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

}  // namespace detail

namespace {

using namespace detail;

/// The backoff before a retry, cut short (Cancelled) when the dataset
/// closes or the program is interrupted.
void sleep_backoff(const RemoteConfig& config, unsigned attempt, const std::string& url) {
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double>(backoff_seconds(config, attempt)));
  while (std::chrono::steady_clock::now() < until) {
    if (config.cancel && config.cancel->load()) throw Cancelled(fmt::format("{}: cancelled", redact_url(url)));
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(
        std::chrono::milliseconds(50), until - std::chrono::steady_clock::now()));
  }
}

std::uint64_t file_size_of(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : 0;
}

/// pipe:COMMAND: `sh -c COMMAND` in a process group of its own, with its
/// stdout into fd. "" when it exited 0, else why not. The whole group is
/// killed (SIGKILL to -pid: the shell's children too, which hold the file)
/// when the output falls under min_rate bytes/s over read_timeout seconds (a
/// stalled `aws s3 cp` must not hold the shard's lock forever), grows past
/// `limit` bytes (Note [Byte budgets]), or the dataset closes.
std::string run_pipe(const std::string& command, int fd, const RemoteConfig& config, std::uint64_t limit,
                     const std::string& limit_why) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fd, STDOUT_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);  // its own group: -pid reaches every process it starts
  const char* argv[] = {"/bin/sh", "-c", command.c_str(), nullptr};
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/bin/sh", &actions, &attr, const_cast<char* const*>(argv), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) return fmt::format("the command could not be started: {}", std::strerror(rc));
  int status = 0;
  const double window = std::max(0.05, config.read_timeout);
  std::uint64_t window_bytes = 0;
  auto window_start = std::chrono::steady_clock::now();
  std::string killed;
  for (;;) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) {
      ::kill(-pid, SIGKILL);
      return fmt::format("waiting for the command failed: {}", std::strerror(errno));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (!killed.empty()) continue;  // reaped by the next waitpid
    const auto now = std::chrono::steady_clock::now();
    const std::uint64_t size = file_size_of(fd);
    const double elapsed = std::chrono::duration<double>(now - window_start).count();
    if (config.cancel && config.cancel->load()) {
      killed = "cancelled";
    } else if (limit != 0 && size > limit) {
      killed = fmt::format("the command wrote more than {} bytes ({}): killed", limit, limit_why);
    } else if (elapsed >= window) {
      if (static_cast<double>(size - std::min(size, window_bytes)) / elapsed < std::max(config.min_rate, 1e-9)) {
        killed = fmt::format("the command wrote {} bytes in {:.1f} s, under remote_min_rate {} bytes/s: killed",
                             size - std::min(size, window_bytes), elapsed, config.min_rate);
      }
      window_start = now;
      window_bytes = size;
    }
    if (!killed.empty()) ::kill(-pid, SIGKILL);
  }
  ::kill(-pid, SIGKILL);  // whatever the shell left running in the background
  if (killed == "cancelled") throw Cancelled("pipe: cancelled");
  if (!killed.empty()) return killed;
  if (WIFEXITED(status)) return WEXITSTATUS(status) == 0 ? "" : fmt::format("the command exited with status {}", WEXITSTATUS(status));
  return fmt::format("the command was killed by signal {}", WTERMSIG(status));
}

/// Why fd's bytes are not a whole tar ("" when they are): a tar is whole
/// 512-byte blocks ending in its two zero blocks.
std::string tar_tail_problem(int fd) {
  const std::uint64_t size = file_size_of(fd);
  if (size < 1024 || size % 512 != 0) return fmt::format("not a tar shard: {} bytes, not whole 512-byte blocks", size);
  std::array<char, 1024> tail{};
  if (::pread(fd, tail.data(), tail.size(), static_cast<off_t>(size - tail.size())) != static_cast<ssize_t>(tail.size())) {
    return fmt::format("cannot read it back: {}", std::strerror(errno));
  }
  if (std::any_of(tail.begin(), tail.end(), [](char c) { return c != 0; })) {
    return "not a whole tar shard: it does not end with the end-of-archive blocks (cut short, or not a tar)";
  }
  return {};
}

struct Head {
  std::uint64_t size = 0;
  bool size_known = false;
  std::string etag;
  std::string last_modified;  ///< the server's Last-Modified, as it gave it
};

/// The server's size and ETag for `url` (HEAD), with the retries.
}  // namespace

namespace detail {

/// One request that has no state between tries (HEAD, a listing, an
/// upload; fetch_url resumes, so it has its own loop): `setup` prepares each
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
    if (rc == CURLE_ABORTED_BY_CALLBACK && t.stalled.empty()) throw Cancelled(fmt::format("{}: cancelled", redact_url(url)));
    if (!t.write_error.empty()) throw RemoteError(url, code, t.write_error);  // a bound: no retry changes it
    if (rc == CURLE_OK && final_status(code)) throw RemoteError(url, code, status_text(code, t.error_body));
    if (const std::string why = permanent_error(rc); !why.empty()) throw RemoteError(url, 0, why);
    const std::string last = !t.stalled.empty() ? t.stalled
                             : rc != CURLE_OK   ? curl_easy_strerror(rc)
                                                : status_text(code, t.error_body);
    if (attempt >= config.retries) {
      throw RemoteError(url, rc == CURLE_OK ? code : 0, fmt::format("{} (gave up after {} tries)", last, attempt + 1));
    }
    sleep_backoff(config, attempt, url);
  }
}

}  // namespace detail

namespace {

Head head_url(const std::string& url, const RemoteConfig& config) {
  Head out;
  request(
      url, config, {},
      [](CURL* h, Transfer&) { curl_easy_setopt(h, CURLOPT_NOBODY, 1L); },
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

}  // namespace

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

// Note [Cache ownership]
// cache_dir may be a folder others use too ($HOME, a shared scratch): the
// cache touches only what it made. Its entries are folders named
// pinfeed-<16 hex digits> holding a regular file .pinfeed-cache (the
// marker), owned by this user; each is made whole under a temporary name
// and renamed into place (RENAME_NOREPLACE), so a folder without the marker
// was never ours. Inside one, every file is reached with openat() from the
// folder's descriptor and O_NOFOLLOW: a symbolic link planted where a file
// of ours goes (a <hash> folder linked elsewhere, NAME.meta.tmp linked to a
// victim, a dangling NAME.lock) is refused, naming it, never followed. Files
// we write anew (.part, .meta.tmp) are unlinked and made with O_EXCL, so a
// planted hard link is never written through either. The sweep (.part left
// by a killed fetch) and eviction walk only entry folders with the marker,
// and in them only NAME + NAME.meta pairs: a user's movie.mkv.part or a
// backup/X beside backup/X.meta elsewhere under cache_dir is not ours.

namespace {

constexpr std::string_view kEntryPrefix = "pinfeed-";
constexpr const char* kMarker = ".pinfeed-cache";

/// A folder held open: what is in it is reached through `fd`, never through
/// a path a planted link could redirect.
struct CacheFolder {
  UniqueFd fd;
  fs::path path;
};

[[noreturn]] void refuse_planted(const fs::path& p, const char* what) {
  throw DataError(p, fmt::format("is {} where pinfeed's cache keeps its own files: pinfeed did not make it and "
                                 "does not follow or overwrite it; remove it, or choose another cache_dir",
                                 what));
}

/// `name` in `dir`, opened without following a link; only a regular file.
UniqueFd open_in(const CacheFolder& dir, const std::string& name, int flags, mode_t mode = 0644) {
  UniqueFd fd(::openat(dir.fd.get(), name.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode));
  if (!fd) {
    const int err = errno;
    if (err == ELOOP) refuse_planted(dir.path / name, "a symbolic link");
    throw DataError(dir.path / name, fmt::format("cannot open: {}", std::strerror(err)));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) refuse_planted(dir.path / name, "not a regular file");
  return fd;
}

/// A new file `name` in `dir` (whatever was there, a planted link included,
/// is unlinked first; O_EXCL never writes through a link made meanwhile).
UniqueFd create_in(const CacheFolder& dir, const std::string& name, mode_t mode) {
  if (::unlinkat(dir.fd.get(), name.c_str(), 0) != 0 && errno != ENOENT) {
    throw DataError(dir.path / name, fmt::format("cannot replace it: {}", std::strerror(errno)));
  }
  return open_in(dir, name, O_RDWR | O_CREAT | O_EXCL, mode);
}

CacheFolder open_folder(const fs::path& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) throw DataError(path, fmt::format("cannot open the folder: {}", std::strerror(errno)));
  return {std::move(fd), path};
}

/// Whether `name` in `root` is an entry folder of the cache (a real folder,
/// named so, ours, with the marker). Never follows a link.
bool is_entry(const CacheFolder& root, const std::string& name) {
  if (name.size() != kEntryPrefix.size() + 16 || !name.starts_with(kEntryPrefix)) return false;
  if (!std::all_of(name.begin() + static_cast<std::ptrdiff_t>(kEntryPrefix.size()), name.end(),
                   [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); })) {
    return false;
  }
  struct stat st {};
  if (::fstatat(root.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode) ||
      st.st_uid != ::geteuid()) {
    return false;
  }
  const std::string marker = name + "/" + kMarker;
  return ::fstatat(root.fd.get(), marker.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
}

/// This host's name, for names other hosts sharing cache_dir must not take
/// for theirs.
std::string host_name() {
  std::array<char, 256> h{};
  if (::gethostname(h.data(), h.size() - 1) != 0) return "host";
  std::string out(h.data());
  std::replace(out.begin(), out.end(), '-', '_');
  return out.empty() ? "host" : out;
}

/// cache_dir (made if missing; the user's choice, so a link to it is fine).
CacheFolder open_cache_root(const fs::path& root) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw DataError(root, fmt::format("cannot make cache_dir: {}", ec.message()));
  return open_folder(root);
}

/// The entry folder `name` of the cache at `root`, made (whole, with its
/// marker) if missing; a folder of that name that is not ours is refused.
CacheFolder open_entry(const CacheFolder& root, const std::string& name) {
  struct stat st {};
  if (::fstatat(root.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    // Made under a temporary name with its marker, then renamed into place:
    // nobody ever sees an entry without its marker.
    std::string temp = fmt::format(".{}new-{}-{}-XXXXXX", kEntryPrefix, ::getpid(), host_name());
    const std::string full = (root.path / temp).string();
    std::string templ = full;
    if (::mkdtemp(templ.data()) == nullptr) {
      throw DataError(root.path, fmt::format("cannot make a folder in cache_dir: {}", std::strerror(errno)));
    }
    temp = fs::path(templ).filename().string();
    {
      const CacheFolder fresh = open_folder(templ);
      (void)open_in(fresh, kMarker, O_WRONLY | O_CREAT | O_EXCL);
    }
    int rc = ::renameat2(root.fd.get(), temp.c_str(), root.fd.get(), name.c_str(), RENAME_NOREPLACE);
    if (rc != 0 && (errno == EINVAL || errno == ENOSYS)) {
      // NFS, CephFS, Lustre and most FUSE file systems have no
      // RENAME_NOREPLACE: a plain rename cannot replace a folder that holds
      // anything (an entry holds its marker), so it is as safe here.
      rc = ::renameat(root.fd.get(), temp.c_str(), root.fd.get(), name.c_str());
    }
    if (rc != 0) {
      const int err = errno;
      std::error_code e2;
      fs::remove_all(templ, e2);
      if (err != EEXIST && err != ENOTEMPTY) {
        throw DataError(root.path / name, fmt::format("cannot make the cache's folder: {}", std::strerror(err)));
      }  // another rank made it meanwhile
    }
  }
  if (::fstatat(root.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) {
    refuse_planted(root.path / name, "a symbolic link");
  }
  if (!is_entry(root, name)) {
    refuse_planted(root.path / name, "a folder without pinfeed's .pinfeed-cache marker (or another user's)");
  }
  UniqueFd fd(::openat(root.fd.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) refuse_planted(root.path / name, "not a folder of pinfeed's");
  // The folder opened is the one checked (not one swapped in since): ours,
  // with its marker.
  if (::fstat(fd.get(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid() ||
      ::fstatat(fd.get(), kMarker, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) {
    refuse_planted(root.path / name, "a folder without pinfeed's .pinfeed-cache marker (or another user's)");
  }
  return {std::move(fd), root.path / name};
}

/// Note [Byte budgets]: what a fetch into `fd` may write, and why: the
/// shard's known size, cache_limit, and the free space of the disk less a
/// reserve (the least of 1 GiB and 5% of it), so an endless body never
/// fills the disk.
struct Budget {
  std::uint64_t limit = 0;    ///< always (0: none)
  std::string why;
  std::uint64_t unknown = 0;  ///< also, for a body of no announced length (0: none)
  std::string unknown_why;
};

/// cache_limit bounds what has no length of its own (a chunked body, a
/// command's output): a shard whose size is known may pass it, and stays
/// with a warning while in use, as before.
Budget fetch_budget(int fd, const fs::path& where, const RemoteConfig& config, std::uint64_t expected) {
  Budget b;
  std::uint64_t limit = expected;
  std::string why = expected != 0 ? "the size its index gives" : "";
  if (config.cache_limit != 0 && expected == 0) {
    b.unknown = config.cache_limit;
    b.unknown_why = "cache_limit (the answer gave no length)";
  }
  struct statvfs v {};
  if (::fstatvfs(fd, &v) == 0) {
    const std::uint64_t avail = static_cast<std::uint64_t>(v.f_bavail) * v.f_frsize;
    const std::uint64_t reserve = std::min<std::uint64_t>(1ULL << 30U, static_cast<std::uint64_t>(v.f_blocks) * v.f_frsize / 20);
    const std::uint64_t room = avail > reserve ? avail - reserve : 0;
    if (limit == 0 || room < limit) {
      limit = std::max<std::uint64_t>(room, 1);
      why = fmt::format("the free space of the disk holding {} ({} free, {} kept in reserve)", where.string(),
                        format_bytes(avail), format_bytes(reserve));
    }
  }
  b.limit = limit;
  b.why = why;
  return b;
}

FetchResult fetch_into(const std::string& url, const CacheFolder& dir, const std::string& name,
                       const RemoteConfig& config, std::uint64_t expected) {
  const std::string part_name = name + ".part";
  const fs::path part = dir.path / part_name;
  UniqueFd fd = create_in(dir, part_name, 0644);  // read back: the tar check
  // Every way out but the rename takes the partial file with it.
  struct DropPart {
    const CacheFolder& dir;
    const std::string& name;
    bool keep = false;
    ~DropPart() {
      if (!keep) ::unlinkat(dir.fd.get(), name.c_str(), 0);
    }
  } drop{dir, part_name};
  const Budget budget = fetch_budget(fd.get(), dir.path, config, expected);
  FetchResult out;
  std::string last;
  long last_code = 0;
  for (unsigned attempt = 0;; ++attempt) {
    ++out.attempts;
    const std::uint64_t have = file_size_of(fd.get());
    bool done = false;
    if (url.starts_with("pipe:")) {
      // A command has no Range: every try starts over.
      if (::ftruncate(fd.get(), 0) != 0 || ::lseek(fd.get(), 0, SEEK_SET) != 0) {
        throw RemoteError(url, 0, fmt::format("cannot write {}: {}", part.string(), std::strerror(errno)));
      }
      // A command's output has no length: the tighter bound holds.
      const bool unknown_tighter = budget.unknown != 0 && (budget.limit == 0 || budget.unknown < budget.limit);
      const std::uint64_t limit = unknown_tighter ? budget.unknown : budget.limit;
      const std::string& why = unknown_tighter ? budget.unknown_why : budget.why;
      last = run_pipe(url.substr(5), fd.get(), config, limit, why);
      if (limit != 0 && file_size_of(fd.get()) > limit) {
        throw RemoteError(url, 0, last.empty() ? fmt::format("the command wrote more than {} bytes ({})", limit, why)
                                               : last);  // a bound: no retry changes it
      }
      done = last.empty();
    } else {
      HeaderList headers;
      Easy h = make_handle(url, config, headers);
      Transfer t;
      t.fd = fd.get();
      t.handle = h.get();
      t.resuming = have > 0;
      t.file_base = have;
      t.byte_limit = budget.limit;
      t.byte_limit_why = budget.why;
      t.unknown_limit = budget.unknown;
      t.unknown_limit_why = budget.unknown_why;
      watch_progress(h.get(), t, config);
      if (::lseek(fd.get(), 0, SEEK_END) < 0) throw RemoteError(url, 0, std::strerror(errno));
      curl_easy_setopt(h.get(), CURLOPT_WRITEFUNCTION, on_body);
      curl_easy_setopt(h.get(), CURLOPT_WRITEDATA, &t);
      curl_easy_setopt(h.get(), CURLOPT_HEADERFUNCTION, on_header);
      curl_easy_setopt(h.get(), CURLOPT_HEADERDATA, &t);
      if (have > 0) {
        curl_easy_setopt(h.get(), CURLOPT_RESUME_FROM_LARGE, static_cast<curl_off_t>(have));
        // The rest of the same object, or (a changed one) all of the new:
        // never the tail of one version after the head of another.
        // Without an ETag, Last-Modified is the validator (RFC 9110).
        const std::string validator = !out.etag.empty() ? out.etag : out.last_modified;
        if (!validator.empty()) {
          headers.reset(curl_slist_append(headers.release(), ("If-Range: " + validator).c_str()));
          curl_easy_setopt(h.get(), CURLOPT_HTTPHEADER, headers.get());
        }
      }
      const CURLcode rc = curl_easy_perform(h.get());
      const long code = response_code(h.get());
      last_code = code;
      if (rc == CURLE_ABORTED_BY_CALLBACK && t.stalled.empty()) {
        throw Cancelled(fmt::format("{}: cancelled", redact_url(url)));
      }
      if (!t.write_error.empty()) throw RemoteError(url, code, fmt::format("{} ({})", t.write_error, part.string()));
      if (have > 0 && !t.restarted && code == 206) out.resumed += have;
      if (!t.etag.empty()) out.etag = t.etag;
      if (!t.last_modified.empty()) out.last_modified = t.last_modified;
      if (rc == CURLE_RANGE_ERROR || (rc == CURLE_OK && code == 200 && have > 0 && !t.restarted)) {
        // No Range support (libcurl stops at a 200 to a Range request), or
        // If-Range found another version: the whole object again.
        last = "the server sent the whole object to a Range request: starting over";
        if (::ftruncate(fd.get(), 0) != 0) throw RemoteError(url, code, std::strerror(errno));
      } else if (rc == CURLE_OK && code >= 200 && code < 300) {
        curl_off_t length = -1;
        curl_easy_getinfo(h.get(), CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &length);
        const std::uint64_t start = t.restarted || code == 200 ? 0 : have;
        const std::uint64_t size = file_size_of(fd.get());
        if (length >= 0 && size != start + static_cast<std::uint64_t>(length)) {
          last = fmt::format("{} bytes arrived of {}", size, start + static_cast<std::uint64_t>(length));
        } else {
          done = true;
        }
      } else if (rc == CURLE_OK && code == 416) {
        last = "HTTP status 416 on a resumed transfer: starting over";
        if (::ftruncate(fd.get(), 0) != 0) throw RemoteError(url, code, std::strerror(errno));
      } else if (rc == CURLE_OK && final_status(code)) {
        throw RemoteError(url, code, status_text(code, t.error_body));
      } else if (const std::string why = permanent_error(rc); !why.empty()) {
        throw RemoteError(url, 0, why);
      } else {
        last = !t.stalled.empty() ? t.stalled
               : rc != CURLE_OK   ? fmt::format("{} after {} bytes", curl_easy_strerror(rc), have + t.written)
                                  : status_text(code, t.error_body);
      }
    }
    if (done) {
      const std::string not_tar = tar_tail_problem(fd.get());
      if (not_tar.empty()) break;
      // An error page with a 200, a command that printed something else, a
      // body cut short without a Content-Length: never cached as a shard.
      last = not_tar;
      if (::ftruncate(fd.get(), 0) != 0) throw RemoteError(url, 0, std::strerror(errno));
    }
    if (attempt >= config.retries) {
      throw RemoteError(url, last_code, fmt::format("{} (gave up after {} tries)", last, attempt + 1));
    }
    pinfeed::detail::log().warn("remote: {}: {}; try {} of {} in a moment", redact_url(url), last, attempt + 2,
                                config.retries + 1);
    sleep_backoff(config, attempt, url);
  }
  if (::fsync(fd.get()) != 0) throw RemoteError(url, 0, fmt::format("cannot write {}: {}", part.string(), std::strerror(errno)));
  out.bytes = file_size_of(fd.get());
  fd.reset();
  // Complete, or not there at all (a rename replaces a planted link itself).
  if (::renameat(dir.fd.get(), part_name.c_str(), dir.fd.get(), name.c_str()) != 0) {
    throw RemoteError(url, 0, fmt::format("cannot rename {} to {}: {}", part.string(), name, std::strerror(errno)));
  }
  drop.keep = true;
  return out;
}

}  // namespace

FetchResult fetch_url(const std::string& url, const fs::path& dest, const RemoteConfig& config) {
  const CacheFolder dir = open_folder(dest.parent_path().empty() ? fs::path(".") : dest.parent_path());
  return fetch_into(url, dir, dest.filename().string(), config, 0);
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

// Note [Remote staging]
// A remote shard is fetched whole into <cache>/pinfeed-<hash of its URL's
// folder>/<its file name>, beside <name>.meta (JSON: the URL as shown, a
// hash of the URL as given, size, ETag, Last-Modified) and <name>.lock;
// Note [Cache ownership] says what else the cache touches (nothing).
// The file appears only complete (written as .part, fsync'ed, renamed), and
// the .meta after it, so a crash leaves a .part or a file without .meta, and
// neither is ever read. A cached file is used when its .meta names the same
// URL and size, and the server (HEAD) still gives that size and ETag, or
// without an ETag that Last-Modified, or without either the same first and
// last 64 KiB (two Range requests); else it is fetched again. Waiting for
// another process's lock ends (Note [Bounded waits]): past remote_timeout x
// (remote_retries + 1) seconds in which its shard did not change, the error
// names the holder's pid. Ranks of one node share the cache: the check and fetch
// happen under an exclusive flock on <name>.fetch (the others wait, then find
// it cached), and every user holds a shared flock on <name>.lock while its
// dataset is open, so eviction (least recently used first, by the access
// time staging sets, past cache_limit;
// it must get both locks without waiting) skips shards in use. The
// name is the URL's file name, so fingerprints, resume states and sample
// order are those of the same shards read from a local folder.

namespace {

struct Staged {
  std::vector<UniqueFd> locks;
  fs::path private_dir;  // removed with the dataset
  Staged() = default;
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  ~Staged() {
    locks.clear();
    if (!private_dir.empty()) {
      std::error_code ec;
      fs::remove_all(private_dir, ec);
    }
  }
};

/// The cache's entry folder for a URL: its folder's address without query,
/// fragment and user (ranks that sign their own presigned URLs share one
/// copy); a pipe: command's whole text (hashed: its secrets never reach a
/// name).
std::string folder_of(const std::string& raw) {
  const std::string url = raw.starts_with("pipe:") ? raw : redact_url(raw);
  const auto slash = url.rfind('/');
  const std::string prefix = url.starts_with("pipe:") || slash == std::string::npos ? url : url.substr(0, slash);
  return fmt::format("{}{:016x}", kEntryPrefix, XXH3_64bits(prefix.data(), prefix.size()));
}

/// What a .meta's "key" must be for its file to be `url`'s.
std::string cache_key(const std::string& url) {
  const std::string k = url.starts_with("pipe:") ? url : redact_url(url);
  const XXH128_hash_t h = XXH3_128bits(k.data(), k.size());
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

/// `name` in `dir` opened for reading, or nothing when it is not there.
std::optional<UniqueFd> open_existing(const CacheFolder& dir, const std::string& name) {
  struct stat st {};
  if (::fstatat(dir.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT) return std::nullopt;
  return open_in(dir, name, O_RDONLY);
}

/// A regular file's size in `dir` (nothing: missing); a link is refused.
std::optional<std::uint64_t> size_in(const CacheFolder& dir, const std::string& name) {
  const auto fd = open_existing(dir, name);
  if (!fd) return std::nullopt;
  return file_size_of(fd->get());
}

std::optional<nlohmann::json> read_meta(const CacheFolder& dir, const std::string& name) {
  const auto fd = open_existing(dir, name);
  if (!fd) return std::nullopt;
  std::string text(std::min<std::uint64_t>(file_size_of(fd->get()), 64 * 1024), '\0');
  if (::pread(fd->get(), text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) return std::nullopt;
  try {
    auto j = nlohmann::json::parse(text);
    if (!j.is_object()) return std::nullopt;
    return j;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;  // a torn sidecar: fetched again
  }
}

void write_meta(const CacheFolder& dir, const std::string& name, const nlohmann::json& j) {
  const std::string tmp = name + ".tmp";
  {
    const UniqueFd fd = create_in(dir, tmp, 0600);
    const std::string text = j.dump();
    if (::write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
      throw DataError(dir.path / tmp, fmt::format("cannot write the cache's sidecar: {}", std::strerror(errno)));
    }
  }
  if (::renameat(dir.fd.get(), tmp.c_str(), dir.fd.get(), name.c_str()) != 0) {
    throw DataError(dir.path / name, fmt::format("cannot write the cache's sidecar: {}", std::strerror(errno)));
  }
}

struct ShardOutcome {
  std::uint64_t bytes = 0;
  bool fetched = false;
};

/// Who holds a flock on the file behind `fd`, in words, from /proc/locks
/// ("process 1234"; another host's lock over NFS is not listed there).
std::string lock_holder(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return "another process";
  const std::string where = fmt::format("{:02x}:{:02x}:{}", major(st.st_dev), minor(st.st_dev), st.st_ino);
  std::ifstream in("/proc/locks");
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("->") != std::string::npos) continue;  // a waiter, not the holder
    std::istringstream words(line);
    std::string id, type, advisory, mode, pid, dev;
    words >> id >> type >> advisory >> mode >> pid >> dev;
    if (type == "FLOCK" && dev == where) {
      return pid == std::to_string(::getpid()) ? "this process (another of its datasets)" : "process " + pid;
    }
  }
  return "another process (not on this host, or gone meanwhile)";
}

/// Takes flock `how` on `fd` (`name` in `dir`), waiting while the shard
/// that lock guards changes: past remote_timeout x (remote_retries + 1)
/// seconds without a change (a holder stopped in a debugger, a hung NFS
/// client), gives up naming the holder. Cancelled when the dataset closes.
void lock_bounded(const UniqueFd& fd, int how, const CacheFolder& dir, const std::string& name,
                  const std::string& shard, const std::string& url, const RemoteConfig& config) {
  using Clock = std::chrono::steady_clock;
  const auto progress = [&] {
    std::uint64_t sum = 0;
    for (const std::string& f : {shard + ".part", shard + ".meta", shard}) {
      struct stat st {};
      if (::fstatat(dir.fd.get(), f.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
        sum = sum * 31 + static_cast<std::uint64_t>(st.st_size) * 7 + static_cast<std::uint64_t>(st.st_mtim.tv_nsec) +
              static_cast<std::uint64_t>(st.st_ino);
      }
    }
    return sum;
  };
  const double budget = std::max(0.05, config.read_timeout) * (static_cast<double>(config.retries) + 1);
  const auto start = Clock::now();
  auto changed = start;
  std::uint64_t seen = progress();
  bool told = false;
  for (;;) {
    if (::flock(fd.get(), how | LOCK_NB) == 0) return;
    if (errno != EWOULDBLOCK && errno != EINTR) {
      throw DataError(dir.path / name, fmt::format("cannot lock: {}", std::strerror(errno)));
    }
    if (config.cancel && config.cancel->load()) throw Cancelled(fmt::format("{}: cancelled", redact_url(url)));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const auto now = Clock::now();
    if (const std::uint64_t p = progress(); p != seen) {
      seen = p;
      changed = now;
    }
    if (!told && now - start > std::chrono::seconds(2)) {
      told = true;
      pinfeed::detail::log().info("remote: waiting for {}, which holds {}", lock_holder(fd.get()), (dir.path / name).string());
    }
    const double idle = std::chrono::duration<double>(now - changed).count();
    if (idle > budget) {
      throw RemoteError(url, 0, fmt::format("{} holds {} and the shard has not changed for {:.1f} s (remote_timeout x "
                                            "(remote_retries + 1)): giving up. Is it stopped (a debugger) or hung "
                                            "(a network file system)? If it is gone, remove that file",
                                            lock_holder(fd.get()), (dir.path / name).string(), idle));
    }
  }
}

/// Whether the server's bytes still are the cached copy's, for a server that
/// gives neither ETag nor Last-Modified: its first and last 64 KiB.
bool same_ends(const std::string& url, const CacheFolder& dir, const std::string& name, std::uint64_t size,
               const RemoteConfig& config) {
  const auto local = open_existing(dir, name);
  if (!local) return false;
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
    if (::pread(local->get(), mine.data(), span, static_cast<off_t>(first)) != static_cast<ssize_t>(span) || body != mine) {
      return false;
    }
  }
  return true;
}

/// Note [Remote staging]: NAME.fetch is held exclusively while a shard is
/// checked and fetched (briefly); NAME.lock is held shared by every dataset
/// using the shard, taken before NAME.fetch is let go, so an evictor (who
/// must get both, without waiting) never removes a shard between its check
/// and its use. A fetch never waits for a user: another node's rank
/// training on the shard does not hold NAME.fetch.
ShardOutcome stage_one(const std::string& url, const CacheFolder& root, const fs::path& file, UniqueFd& use,
                       const RemoteConfig& config, std::uint64_t expected) {
  const CacheFolder dir = open_entry(root, file.parent_path().filename().string());
  const std::string name = file.filename().string();
  const UniqueFd fetch = open_in(dir, name + ".fetch", O_RDWR | O_CREAT);
  lock_bounded(fetch, LOCK_EX, dir, name + ".fetch", name, url, config);
  ShardOutcome out;
  const auto meta = read_meta(dir, name + ".meta");
  const auto on_disk = size_in(dir, name);
  const std::string shown = redact_url(url);
  bool valid = on_disk && meta && meta->value("key", "") == cache_key(url) &&
               meta->value("size", std::uint64_t{0}) == *on_disk && (expected == 0 || expected == *on_disk);
  if (valid && !url.starts_with("pipe:")) {
    try {
      const Head head = head_url(url, config);
      const std::string etag = meta->value("etag", ""), modified = meta->value("last_modified", "");
      std::string by;
      if (head.size_known && head.size != *on_disk) {
        valid = false;
        by = "its size";
      } else if (!etag.empty() && !head.etag.empty()) {
        valid = etag == head.etag;
        by = "its ETag";
      } else if (!modified.empty() && !head.last_modified.empty()) {
        valid = modified == head.last_modified;
        by = "its Last-Modified";
      } else {
        valid = same_ends(url, dir, name, *on_disk, config);
        by = "its size and first and last 64 KiB (the server gives no ETag or Last-Modified)";
      }
      if (valid) {
        pinfeed::detail::log().debug("remote: {}: the cached copy is current, by {}", shown, by);
      } else {
        pinfeed::detail::log().info("remote: {} changed on the server ({}): fetching it again", shown, by);
      }
    } catch (const RemoteError& e) {
      // Gone (404, 410) is gone. Otherwise (unreachable, a presigned GET URL
      // that refuses HEAD with 403) the copy the server confirmed earlier is used.
      if (e.status() == 404 || e.status() == 410) throw;
      pinfeed::detail::log().warn("remote: {}: using the cached copy, unchecked: {}", shown, e.what());
    }
  }
  if (valid) {
    out.bytes = *on_disk;
  } else {
    if (::unlinkat(dir.fd.get(), (name + ".meta").c_str(), 0) != 0 && errno != ENOENT) {
      throw DataError(dir.path / (name + ".meta"), fmt::format("cannot remove: {}", std::strerror(errno)));
    }
    const FetchResult r = fetch_into(url, dir, name, config, expected);
    write_meta(dir, name + ".meta",
               {{"url", shown}, {"key", cache_key(url)}, {"size", r.bytes}, {"etag", r.etag},
                {"last_modified", r.last_modified}});
    out = {r.bytes, true};
  }
  // Last use, for eviction: the access time only. The modification time is
  // part of the identity an open dataset checks its shards against.
  const struct timespec times[2] = {{0, UTIME_NOW}, {0, UTIME_OMIT}};
  ::utimensat(dir.fd.get(), name.c_str(), times, AT_SYMLINK_NOFOLLOW);
  use = open_in(dir, name + ".lock", O_RDWR | O_CREAT);
  lock_bounded(use, LOCK_SH, dir, name + ".lock", name, url, config);  // kept while the dataset is open
  return out;  // NAME.fetch is let go here
}

/// The entry folders of the cache at `root` (Note [Cache ownership]), by
/// name: one is opened at a time (thousands of pipe: shards are thousands
/// of folders, and descriptors are the readers' too).
std::vector<std::string> entries_of(const CacheFolder& root) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto it = fs::directory_iterator(root.path, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    std::string name = it->path().filename().string();
    if (is_entry(root, name)) out.push_back(std::move(name));
  }
  return out;
}

/// An entry folder that exists, opened and checked (nothing: not one now).
std::optional<CacheFolder> open_existing_entry(const CacheFolder& root, const std::string& name) {
  UniqueFd fd(::openat(root.fd.get(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  struct stat st {};
  if (!fd || ::fstat(fd.get(), &st) != 0 || st.st_uid != ::geteuid() ||
      ::fstatat(fd.get(), kMarker, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) {
    return std::nullopt;
  }
  return CacheFolder{std::move(fd), root.path / name};
}

/// The names in `dir` (never following a link).
std::vector<std::string> names_in(const CacheFolder& dir) {
  std::vector<std::string> out;
  const int copy = ::fcntl(dir.fd.get(), F_DUPFD_CLOEXEC, 0);
  if (copy < 0) return out;
  DIR* d = ::fdopendir(copy);
  if (d == nullptr) {
    ::close(copy);
    return out;
  }
  ::rewinddir(d);
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  return out;
}

/// Takes `name`'s lock in `dir` exclusively without waiting (an evictor's
/// or a sweep's right to remove); nothing when someone holds it.
std::optional<UniqueFd> try_lock(const CacheFolder& dir, const std::string& name) {
  try {
    UniqueFd fd = open_in(dir, name, O_RDWR | O_CREAT);
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) return std::nullopt;
    return fd;
  } catch (const DataError& e) {
    pinfeed::detail::log().warn("remote cache: passed over: {}", e.what());
    return std::nullopt;
  }
}

/// Past cache_limit, the least recently used shards that nobody holds go:
/// only NAME + NAME.meta pairs in the cache's own entry folders.
void evict(const CacheFolder& root, std::uint64_t limit, std::uint64_t own_bytes) {
  struct Entry {
    std::string folder, name;
    std::uint64_t bytes;
    std::int64_t used_ns;
  };
  std::vector<Entry> entries;
  std::uint64_t total = 0;
  for (const std::string& folder : entries_of(root)) {
    const auto dir = open_existing_entry(root, folder);
    if (!dir) continue;
    for (const std::string& meta : names_in(*dir)) {
      if (!meta.ends_with(".meta")) continue;
      const std::string name = meta.substr(0, meta.size() - 5);
      struct stat st {}, ms {};
      if (::fstatat(dir->fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode) ||
          ::fstatat(dir->fd.get(), meta.c_str(), &ms, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(ms.st_mode)) {
        continue;
      }
      entries.push_back({folder, name, static_cast<std::uint64_t>(st.st_size),
                         static_cast<std::int64_t>(st.st_atim.tv_sec) * 1'000'000'000 + st.st_atim.tv_nsec});
      total += static_cast<std::uint64_t>(st.st_size);
    }
  }
  if (total <= limit) return;
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.used_ns < b.used_ns; });
  for (const Entry& e : entries) {
    if (total <= limit) break;
    const auto opened = open_existing_entry(root, e.folder);
    if (!opened) continue;
    const CacheFolder& dir = *opened;
    const auto fetch = try_lock(dir, e.name + ".fetch");  // being checked or fetched
    if (!fetch) continue;
    const auto use = try_lock(dir, e.name + ".lock");  // in use by a dataset
    if (!use) continue;
    ::unlinkat(dir.fd.get(), (e.name + ".meta").c_str(), 0);
    ::unlinkat(dir.fd.get(), e.name.c_str(), 0);
    total -= e.bytes;
    pinfeed::detail::log().debug("remote cache: evicted {} ({} bytes)", (dir.path / e.name).string(), e.bytes);
  }
  if (total > limit) {
    pinfeed::detail::log().warn("remote cache {}: {} bytes held, over cache_limit {}: this dataset's shards ({} bytes) "
                                "are in use and stay until it closes",
                                root.path.string(), total, limit, own_bytes);
  }
}

/// Whether pid names a process that is gone.
bool process_gone(const std::string& pid_text) {
  if (pid_text.empty() || !std::all_of(pid_text.begin(), pid_text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
  return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

/// In the cache's own entry folders, NAME.part files nobody is fetching
/// (NAME.fetch free): a killed fetch's; and entry folders a killed process
/// was making (.pinfeed-new-PID-*).
void sweep_parts(const CacheFolder& root) {
  for (const std::string& folder : entries_of(root)) {
    const auto opened = open_existing_entry(root, folder);
    if (!opened) continue;
    const CacheFolder& dir = *opened;
    for (const std::string& part : names_in(dir)) {
      if (!part.ends_with(".part")) continue;
      struct stat st {};
      if (::fstatat(dir.fd.get(), part.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) continue;
      const auto fetch = try_lock(dir, part.substr(0, part.size() - 5) + ".fetch");
      if (fetch) ::unlinkat(dir.fd.get(), part.c_str(), 0);
    }
  }
  // .pinfeed-new-PID-HOST-XXXXXX: this host's, its process gone, and old
  // (another host sharing the folder has its own name in it).
  const std::string temp = fmt::format(".{}new-", kEntryPrefix);
  std::size_t old_layout = 0;
  for (const std::string& name : names_in(root)) {
    if (name.size() == 16 && std::all_of(name.begin(), name.end(), [](char c) {
          return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
        })) {
      ++old_layout;  // a cache folder of pinfeed before December 2026
    }
    if (!name.starts_with(temp)) continue;
    const std::string rest = name.substr(temp.size());
    const auto dash = rest.find('-');
    const std::string host = dash == std::string::npos ? "" : rest.substr(dash + 1, rest.rfind('-') - dash - 1);
    struct stat st {};
    if (dash == std::string::npos || host != host_name() || !process_gone(rest.substr(0, dash)) ||
        ::fstatat(root.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode) ||
        st.st_uid != ::geteuid() || ::time(nullptr) - st.st_mtim.tv_sec < 600) {
      continue;
    }
    std::error_code ec;
    fs::remove_all(root.path / name, ec);  // holds only a marker
  }
  if (old_layout > 0) {
    static std::once_flag told;
    std::call_once(told, [&] {
      pinfeed::detail::log().warn("remote cache {}: {} folder(s) named by a bare 16-digit hash are an older pinfeed's "
                                  "cache, no longer read or evicted: delete them to get their space back",
                                  root.path.string(), old_layout);
    });
  }
}

}  // namespace

namespace {

/// Private shard folders (pinfeed-shards-PID-XXXXXX) whose process is gone:
/// a killed rank's, which its own close never removed.
void sweep_private_dirs(const fs::path& base) {
  std::error_code ec;
  for (auto it = fs::directory_iterator(base, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with("pinfeed-shards-")) continue;
    const std::string rest = name.substr(15);
    const auto dash = rest.find('-');
    if (dash == std::string::npos || dash == 0) continue;
    const std::string pid_text = rest.substr(0, dash);
    if (!std::all_of(pid_text.begin(), pid_text.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    const long pid = std::strtol(pid_text.c_str(), nullptr, 10);
    if (pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (or not ours to know)
    struct stat st {};
    if (::stat(it->path().c_str(), &st) != 0 || st.st_uid != ::geteuid()) continue;
    std::error_code e2;
    fs::remove_all(it->path(), e2);
    if (!e2) pinfeed::detail::log().info("remote: removed {}, left by process {} which is gone", it->path().string(), pid);
  }
}

std::string xml_unescape(std::string s) {
  static const std::pair<const char*, const char*> kEntities[] = {
      {"&lt;", "<"}, {"&gt;", ">"}, {"&quot;", "\""}, {"&apos;", "'"}, {"&#13;", "\r"}, {"&amp;", "&"}};
  for (const auto& [from, to] : kEntities) {
    for (auto at = s.find(from); at != std::string::npos; at = s.find(from, at + std::strlen(to))) {
      s.replace(at, std::strlen(from), to);
    }
  }
  return s;
}

/// Every <tag>text</tag> of `xml`, unescaped.
std::vector<std::string> xml_values(const std::string& xml, const std::string& tag) {
  std::vector<std::string> out;
  const std::string open = "<" + tag + ">", close = "</" + tag + ">";
  for (auto a = xml.find(open); a != std::string::npos; a = xml.find(open, a)) {
    const auto b = xml.find(close, a);
    if (b == std::string::npos) break;
    out.push_back(xml_unescape(xml.substr(a + open.size(), b - a - open.size())));
    a = b;
  }
  return out;
}

std::string escape_query(const std::string& s) {
  curl_init_once();
  char* e = curl_easy_escape(nullptr, s.c_str(), static_cast<int>(s.size()));  // all but unreserved: S3's canonical form
  if (e == nullptr) throw std::bad_alloc();
  std::string out(e);
  curl_free(e);
  return out;
}

}  // namespace

std::vector<std::string> list_s3_shards(const std::string& url, const RemoteConfig& config) {
  if (!url.starts_with("s3://") || !url.ends_with('/')) {
    throw ConfigError(fmt::format("'{}': a listing is an s3:// prefix ending in '/'", redact_url(url)));
  }
  const std::string rest = url.substr(5);
  const auto slash = rest.find('/');
  const std::string bucket = rest.substr(0, slash), prefix = rest.substr(slash + 1);
  // The bucket's address: the one a key's would have, less "/key".
  std::string base = http_url(fmt::format("s3://{}/k", bucket));
  base.resize(base.size() - 2);
  std::vector<std::string> out;
  std::string token;
  std::set<std::string> tokens;
  for (int page = 0;; ++page) {
    if (page >= 100000) {
      throw RemoteError(url, 0, "the listing goes on past 100000 pages (100 million keys): refusing it");
    }
    // Parameters in sorted order and escaped: the query as libcurl signs it
    // is then the canonical one SigV4 wants (libcurl < 8.3 signs it as given).
    const std::string query = (token.empty() ? "" : "continuation-token=" + escape_query(token) + "&") +
                              "list-type=2&prefix=" + escape_query(prefix);
    std::string body;
    request(
        url, config, base + (base.ends_with('/') ? "?" : "/?") + query,
        [&](CURL*, Transfer& t) {
          body.clear();
          t.text = &body;
          t.text_limit = 64ULL << 20U;  // a page is 1000 keys: well under 1 MiB
          t.text_what = "a page of an S3 listing";
        },
        [](CURL*, Transfer&) {});
    for (const std::string& key : xml_values(body, "Key")) {
      if (key.ends_with(".tar")) out.push_back(fmt::format("s3://{}/{}", bucket, key));
    }
    const auto truncated = xml_values(body, "IsTruncated");
    const auto next = xml_values(body, "NextContinuationToken");
    if (truncated.empty() || truncated.front() != "true" || next.empty()) break;
    token = next.front();
    if (!tokens.insert(token).second) {
      throw RemoteError(url, 0, fmt::format("the listing repeats its continuation token after {} pages: the store "
                                            "would be listed forever",
                                            page + 1));
    }
    if (out.size() > 10'000'000) throw RemoteError(url, 0, "the listing names over 10 million .tar objects");
  }
  std::sort(out.begin(), out.end());
  if (out.empty()) throw RemoteError(url, 404, "no .tar object under this prefix");
  return out;
}

void check_upload_target(const std::string& url) {
  if (url.starts_with("pipe:")) throw ConfigError(fmt::format("'{}': pipe: is for reading shards", redact_url(url)));
  if (!url.starts_with("s3://")) return;
  const AwsCredentials c = aws_credentials();
  if (c.key.empty() || c.secret.empty()) {
    throw RemoteError(url, 0, "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile in "
                              "~/.aws/credentials (AWS_PROFILE picks one); instance roles, EKS web identity and SSO "
                              "are not read: `aws configure export-credentials --format env` exports them");
  }
}

fs::path cache_path(const std::string& url, const RemoteConfig& config) {
  if (config.cache_dir.empty()) return {};
  return config.cache_dir / folder_of(url) / remote_shard_name(url);
}

StagedShards stage_shards(const std::vector<std::string>& urls, const RemoteConfig& config,
                          const std::vector<std::uint64_t>& sizes) {
  auto keep = std::make_shared<Staged>();
  fs::path root = config.cache_dir;
  if (root.empty()) {
    std::error_code ec;
    const fs::path tmp = fs::temp_directory_path(ec);
    const fs::path base = ec ? fs::path("/tmp") : tmp;
    sweep_private_dirs(base);
    std::string templ = (base / fmt::format("pinfeed-shards-{}-XXXXXX", ::getpid())).string();
    if (::mkdtemp(templ.data()) == nullptr) {
      throw DataError(templ, fmt::format("cannot make a folder for the shards: {}", std::strerror(errno)));
    }
    root = keep->private_dir = templ;
  }
  const CacheFolder root_dir = open_cache_root(root);
  if (keep->private_dir.empty()) sweep_parts(root_dir);
  StagedShards out;
  out.urls = urls;
  out.local.resize(urls.size());
  keep->locks.resize(urls.size());
  std::vector<ShardOutcome> outcomes(urls.size());
  std::map<fs::path, std::pair<std::string, std::string>> owner;  // file -> (key, shown)
  for (std::size_t i = 0; i < urls.size(); ++i) {
    out.local[i] = root / folder_of(urls[i]) / remote_shard_name(urls[i]);
    const auto [it, fresh] = owner.emplace(out.local[i], std::pair{cache_key(urls[i]), redact_url(urls[i])});
    if (!fresh && it->second.first != cache_key(urls[i])) {
      throw ConfigError(fmt::format("'{}' and '{}' name the same shard file '{}' (a URL's file name, its query "
                                    "left out): give each shard its own name",
                                    it->second.second, redact_url(urls[i]), out.local[i].filename().string()));
    }
  }
  // The first failure, or the caller's cancel, stops the other fetches.
  RemoteConfig local = config;
  const auto stop = std::make_shared<std::atomic<bool>>(false);
  local.cancel = stop;
  std::atomic<std::size_t> next{0};
  std::atomic<unsigned> running{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  {
    const unsigned workers = std::max(1U, std::min<unsigned>(config.parallel, static_cast<unsigned>(urls.size())));
    std::vector<std::jthread> pool;
    running = workers;
    for (unsigned w = 0; w < workers; ++w) {
      pool.emplace_back([&] {
        for (std::size_t i = next++; i < urls.size(); i = next++) {
          try {
            outcomes[i] = stage_one(urls[i], root_dir, out.local[i], keep->locks[i], local, i < sizes.size() ? sizes[i] : 0);
          } catch (...) {
            const std::scoped_lock lock(failure_mutex);
            // The first failure is the one to tell; the rest it cancelled.
            if (!failure) failure = std::current_exception();
            next = urls.size();
            stop->store(true);
          }
        }
        --running;
      });
    }
    while (running.load() > 0) {
      if (config.cancel && config.cancel->load()) stop->store(true);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (failure) std::rethrow_exception(failure);
  std::uint64_t own = 0;
  for (const ShardOutcome& o : outcomes) {
    own += o.bytes;
    (o.fetched ? out.fetched_bytes : out.reused_bytes) += o.bytes;
  }
  if (config.cache_limit > 0 && keep->private_dir.empty()) evict(root_dir, config.cache_limit, own);
  out.keep = keep;
  return out;
}

}  // namespace pinfeed::loader
