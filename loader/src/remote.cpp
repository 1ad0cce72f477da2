#include "pinfeed/loader/remote.hpp"

#include <curl/curl.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <xxhash.h>

#include <algorithm>
#include <array>
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
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "pinfeed/env.hpp"
#include "pinfeed/file_io.hpp"
#include "pinfeed/log.hpp"
#include "curl_transfer.hpp"

extern char** environ;

namespace pinfeed::loader {

namespace fs = std::filesystem;

RemoteError::RemoteError(std::string url, long status, const std::string& reason)
    : Error(fmt::format("{}: {}", redact_url(url), reason)), url_(redact_url(url)), status_(status) {}

std::string redact_url(const std::string& url) {
  if (url.starts_with("pipe:")) return url;
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
      t.write_error = fmt::format("more than the {} bytes expected", t.text_limit);
      return 0;
    }
    t.text->append(data, bytes);
    return bytes;
  }
  if (t.fd < 0) return bytes;  // a HEAD's (empty) body
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
  if (line.starts_with("HTTP/")) {  // a new response (after a redirect or a 100): its own headers
    t.etag.clear();
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
  // A stalled body (under 1 byte/s for read_timeout) ends the transfer, which
  // is then resumed with a Range request.
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, std::max(1L, static_cast<long>(std::ceil(config.read_timeout))));
  if (config.cancel) {
    curl_easy_setopt(e, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(e, CURLOPT_XFERINFODATA, config.cancel.get());
    curl_easy_setopt(e, CURLOPT_XFERINFOFUNCTION,
                     +[](void* flag, curl_off_t, curl_off_t, curl_off_t, curl_off_t) -> int {
                       return static_cast<const std::atomic<bool>*>(flag)->load() ? 1 : 0;
                     });
  }
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

bool final_status(long code) { return code >= 400 && code < 500 && code != 408 && code != 429 && code != 416; }

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

void sleep_backoff(const RemoteConfig& config, unsigned attempt) {
  std::this_thread::sleep_for(std::chrono::duration<double>(backoff_seconds(config, attempt)));
}

std::uint64_t file_size_of(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : 0;
}

/// pipe:COMMAND: `sh -c COMMAND` with its stdout into fd; its exit status.
std::uint64_t file_size_of(int fd);

/// pipe:COMMAND: `sh -c COMMAND` with its stdout into fd. "" when it exited
/// 0, else why not. A command whose output stops growing for read_timeout
/// seconds is killed (a stalled `aws s3 cp` must not hold the shard's lock
/// forever).
std::string run_pipe(const std::string& command, int fd, double read_timeout) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fd, STDOUT_FILENO);
  const char* argv[] = {"/bin/sh", "-c", command.c_str(), nullptr};
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/bin/sh", &actions, nullptr, const_cast<char* const*>(argv), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return fmt::format("the command could not be started: {}", std::strerror(rc));
  int status = 0;
  std::uint64_t seen = 0;
  auto grew = std::chrono::steady_clock::now();
  bool killed = false;
  for (;;) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) return fmt::format("waiting for the command failed: {}", std::strerror(errno));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const auto now = std::chrono::steady_clock::now();
    if (const std::uint64_t size = file_size_of(fd); size != seen) {
      seen = size;
      grew = now;
    } else if (!killed && std::chrono::duration<double>(now - grew).count() > read_timeout) {
      ::kill(pid, SIGKILL);  // reaped by the next waitpid
      killed = true;
    }
  }
  if (killed) return fmt::format("the command wrote nothing for {} s: killed", read_timeout);
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
    setup(h.get(), t);
    const CURLcode rc = curl_easy_perform(h.get());
    const long code = response_code(h.get());
    if (rc == CURLE_OK && code >= 200 && code < 300) {
      done(h.get(), t);
      return;
    }
    if (rc == CURLE_ABORTED_BY_CALLBACK) throw RemoteError(url, 0, "cancelled: the dataset was closed");
    if (rc == CURLE_OK && final_status(code)) throw RemoteError(url, code, status_text(code, t.error_body));
    const std::string last = rc != CURLE_OK ? curl_easy_strerror(rc) : status_text(code, t.error_body);
    if (attempt >= config.retries) {
      throw RemoteError(url, rc == CURLE_OK ? code : 0, fmt::format("{} (gave up after {} tries)", last, attempt + 1));
    }
    sleep_backoff(config, attempt);
  }
}

std::string fetch_text(const std::string& url, const RemoteConfig& config, std::uint64_t limit) {
  std::string body;
  request(
      url, config, {},
      [&](CURL*, Transfer& t) {
        body.clear();
        t.text = &body;
        t.text_limit = limit;
      },
      [](CURL*, Transfer&) {});
  return body;
}

}  // namespace detail

namespace {

Head head_url(const std::string& url, const RemoteConfig& config) {
  Head out;
  request(
      url, config, {}, [](CURL* h, Transfer&) { curl_easy_setopt(h, CURLOPT_NOBODY, 1L); },
      [&](CURL* h, Transfer& t) {
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
  if (bucket.empty()) throw ConfigError(fmt::format("'{}': no bucket (s3://bucket/key)", url));
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
    throw ConfigError(fmt::format("'{}': the URL names no file (a shard URL ends in its file name)", url));
  }
  return name;
}

FetchResult fetch_url(const std::string& url, const fs::path& dest, const RemoteConfig& config) {
  const fs::path part = fs::path(dest.string() + ".part");
  UniqueFd fd(::open(part.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));  // read back: the tar check
  if (!fd) throw RemoteError(url, 0, fmt::format("cannot write {}: {}", part.string(), std::strerror(errno)));
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
      last = run_pipe(url.substr(5), fd.get(), config.read_timeout);
      done = last.empty();
    } else {
      HeaderList headers;
      Easy h = make_handle(url, config, headers);
      Transfer t;
      t.fd = fd.get();
      t.handle = h.get();
      t.resuming = have > 0;
      if (::lseek(fd.get(), 0, SEEK_END) < 0) throw RemoteError(url, 0, std::strerror(errno));
      curl_easy_setopt(h.get(), CURLOPT_WRITEFUNCTION, on_body);
      curl_easy_setopt(h.get(), CURLOPT_WRITEDATA, &t);
      curl_easy_setopt(h.get(), CURLOPT_HEADERFUNCTION, on_header);
      curl_easy_setopt(h.get(), CURLOPT_HEADERDATA, &t);
      if (have > 0) {
        curl_easy_setopt(h.get(), CURLOPT_RESUME_FROM_LARGE, static_cast<curl_off_t>(have));
        // The rest of the same object, or (a changed one) all of the new:
        // never the tail of one version after the head of another.
        if (!out.etag.empty()) {
          headers.reset(curl_slist_append(headers.release(), ("If-Range: " + out.etag).c_str()));
          curl_easy_setopt(h.get(), CURLOPT_HTTPHEADER, headers.get());
        }
      }
      const CURLcode rc = curl_easy_perform(h.get());
      const long code = response_code(h.get());
      last_code = code;
      if (rc == CURLE_ABORTED_BY_CALLBACK) {
        fd.reset();
        std::error_code ec;
        fs::remove(part, ec);
        throw RemoteError(url, 0, "cancelled: the dataset was closed");
      }
      if (!t.write_error.empty()) throw RemoteError(url, code, fmt::format("cannot write {}: {}", part.string(), t.write_error));
      if (have > 0 && !t.restarted && code == 206) out.resumed += have;
      if (!t.etag.empty()) out.etag = t.etag;
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
        fd.reset();
        std::error_code ec;
        fs::remove(part, ec);
        throw RemoteError(url, code, status_text(code, t.error_body));
      } else {
        last = rc != CURLE_OK ? fmt::format("{} after {} bytes", curl_easy_strerror(rc), have + t.written)
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
      fd.reset();
      std::error_code ec;
      fs::remove(part, ec);
      throw RemoteError(url, last_code, fmt::format("{} (gave up after {} tries)", last, attempt + 1));
    }
    pinfeed::detail::log().warn("remote: {}: {}; try {} of {} in a moment", redact_url(url), last, attempt + 2,
                                config.retries + 1);
    sleep_backoff(config, attempt);
  }
  if (::fsync(fd.get()) != 0) throw RemoteError(url, 0, fmt::format("cannot write {}: {}", part.string(), std::strerror(errno)));
  out.bytes = file_size_of(fd.get());
  fd.reset();
  std::error_code ec;
  fs::rename(part, dest, ec);  // complete, or not there at all
  if (ec) throw RemoteError(url, 0, fmt::format("cannot rename {} to {}: {}", part.string(), dest.string(), ec.message()));
  return out;
}

void upload_file(const fs::path& file, const std::string& url, const RemoteConfig& config) {
  if (url.starts_with("pipe:")) throw ConfigError(fmt::format("'{}': pipe: is for reading shards", url));
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
// A remote shard is fetched whole into <cache>/<hash of its URL's folder>/
// <its file name>, beside <name>.meta (JSON: url, size, etag) and <name>.lock.
// The file appears only complete (written as .part, fsync'ed, renamed), and
// the .meta after it, so a crash leaves a .part or a file without .meta, and
// neither is ever read. A cached file is used when its .meta names the same
// URL and size, and the server (HEAD) still gives that size and ETag; else it
// is fetched again. Ranks of one node share the cache: the check and fetch
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

/// The cache's name for a URL: without query, fragment and user (ranks that
/// sign their own presigned URLs share one copy).
std::string folder_of(const std::string& raw) {
  const std::string url = redact_url(raw);
  const auto slash = url.rfind('/');
  const std::string prefix = url.starts_with("pipe:") || slash == std::string::npos ? url : url.substr(0, slash);
  return fmt::format("{:016x}", XXH3_64bits(prefix.data(), prefix.size()));
}

std::optional<nlohmann::json> read_meta(const fs::path& meta) {
  std::ifstream in(meta);
  if (!in) return std::nullopt;
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;  // a torn sidecar: fetched again
  }
}

void write_meta(const fs::path& meta, const nlohmann::json& j) {
  const fs::path tmp = meta.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << j.dump();
    if (!out.flush()) throw DataError(tmp, "cannot write the cache's sidecar");
  }
  fs::rename(tmp, meta);
}

struct ShardOutcome {
  std::uint64_t bytes = 0;
  bool fetched = false;
};

UniqueFd open_lock(const fs::path& path) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (!fd) throw DataError(path, fmt::format("cannot open the cache's lock: {}", std::strerror(errno)));
  return fd;
}

void lock_or_throw(const UniqueFd& fd, int how, const fs::path& path) {
  while (::flock(fd.get(), how) != 0) {
    if (errno != EINTR) throw DataError(path, fmt::format("cannot lock: {}", std::strerror(errno)));
  }
}

/// Note [Remote staging]: NAME.fetch is held exclusively while a shard is
/// checked and fetched (briefly); NAME.lock is held shared by every dataset
/// using the shard, taken before NAME.fetch is let go, so an evictor (who
/// must get both, without waiting) never removes a shard between its check
/// and its use. A fetch never waits for a user: another node's rank
/// training on the shard does not hold NAME.fetch.
ShardOutcome stage_one(const std::string& url, const fs::path& file, UniqueFd& use, const RemoteConfig& config) {
  std::error_code ec;
  fs::create_directories(file.parent_path(), ec);
  const fs::path fetch_path = file.string() + ".fetch", use_path = file.string() + ".lock";
  const fs::path meta_path = file.string() + ".meta";
  const UniqueFd fetch = open_lock(fetch_path);
  lock_or_throw(fetch, LOCK_EX, fetch_path);
  ShardOutcome out;
  const auto meta = read_meta(meta_path);
  const auto on_disk = fs::file_size(file, ec);
  const std::string key = redact_url(url);
  bool valid = !ec && meta && meta->value("url", "") == key && meta->value("size", std::uint64_t{0}) == on_disk;
  if (valid && !url.starts_with("pipe:")) {
    try {
      const Head head = head_url(url, config);
      const std::string etag = meta->value("etag", "");
      valid = (!head.size_known || head.size == on_disk) && (etag.empty() || head.etag.empty() || etag == head.etag);
      if (!valid) pinfeed::detail::log().info("remote: {} changed on the server: fetching it again", key);
    } catch (const RemoteError& e) {
      // Gone (404, 410) is gone. Otherwise (unreachable, a presigned GET URL
      // that refuses HEAD with 403) the copy the server confirmed earlier is used.
      if (e.status() == 404 || e.status() == 410) throw;
      pinfeed::detail::log().warn("remote: {}: using the cached copy, unchecked: {}", key, e.what());
    }
  }
  if (valid) {
    out.bytes = on_disk;
  } else {
    fs::remove(meta_path, ec);
    const FetchResult r = fetch_url(url, file, config);
    write_meta(meta_path, {{"url", key}, {"size", r.bytes}, {"etag", r.etag}});
    out = {r.bytes, true};
  }
  // Last use, for eviction: the access time only. The modification time is
  // part of the identity an open dataset checks its shards against.
  const struct timespec times[2] = {{0, UTIME_NOW}, {0, UTIME_OMIT}};
  ::utimensat(AT_FDCWD, file.c_str(), times, 0);
  use = open_lock(use_path);
  lock_or_throw(use, LOCK_SH, use_path);  // kept while the dataset is open
  return out;  // NAME.fetch is let go here
}

/// Past cache_limit, the least recently used shards that nobody holds go.
void evict(const fs::path& root, std::uint64_t limit, std::uint64_t own_bytes) {
  struct Entry {
    fs::path file;
    std::uint64_t bytes;
    std::int64_t used_ns;
  };
  std::vector<Entry> entries;
  std::uint64_t total = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(root, ec); !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    const fs::path& p = it->path();
    if (p.extension() != ".meta") continue;
    fs::path file = p;
    file.replace_extension();
    std::error_code e2;
    const auto bytes = fs::file_size(file, e2);
    if (e2) continue;
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0) continue;
    entries.push_back({file, bytes, static_cast<std::int64_t>(st.st_atim.tv_sec) * 1'000'000'000 + st.st_atim.tv_nsec});
    total += bytes;
  }
  if (total <= limit) return;
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.used_ns < b.used_ns; });
  for (const Entry& e : entries) {
    if (total <= limit) break;
    const UniqueFd fetch(::open((e.file.string() + ".fetch").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (!fetch || ::flock(fetch.get(), LOCK_EX | LOCK_NB) != 0) continue;  // being checked or fetched
    const UniqueFd use(::open((e.file.string() + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (!use || ::flock(use.get(), LOCK_EX | LOCK_NB) != 0) continue;  // in use by a dataset
    std::error_code e3;
    fs::remove(e.file.string() + ".meta", e3);
    fs::remove(e.file, e3);
    total -= e.bytes;
    pinfeed::detail::log().debug("remote cache: evicted {} ({} bytes)", e.file.string(), e.bytes);
  }
  if (total > limit) {
    pinfeed::detail::log().warn("remote cache {}: {} bytes held, over cache_limit {}: this dataset's shards ({} bytes) "
                                "are in use and stay until it closes",
                                root.string(), total, limit, own_bytes);
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

/// NAME.part files nobody is fetching (NAME.fetch free): a killed fetch's.
void sweep_parts(const fs::path& root) {
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(root, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    const fs::path& p = it->path();
    if (p.extension() != ".part") continue;
    fs::path shard = p;
    shard.replace_extension();
    const UniqueFd fetch(::open((shard.string() + ".fetch").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (!fetch || ::flock(fetch.get(), LOCK_EX | LOCK_NB) != 0) continue;  // being fetched
    std::error_code e2;
    fs::remove(p, e2);
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
    throw ConfigError(fmt::format("'{}': a listing is an s3:// prefix ending in '/'", url));
  }
  const std::string rest = url.substr(5);
  const auto slash = rest.find('/');
  const std::string bucket = rest.substr(0, slash), prefix = rest.substr(slash + 1);
  // The bucket's address: the one a key's would have, less "/key".
  std::string base = http_url(fmt::format("s3://{}/k", bucket));
  base.resize(base.size() - 2);
  std::vector<std::string> out;
  std::string token;
  for (int page = 0; page < 100000; ++page) {
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
        },
        [](CURL*, Transfer&) {});
    for (const std::string& key : xml_values(body, "Key")) {
      if (key.ends_with(".tar")) out.push_back(fmt::format("s3://{}/{}", bucket, key));
    }
    const auto truncated = xml_values(body, "IsTruncated");
    const auto next = xml_values(body, "NextContinuationToken");
    if (truncated.empty() || truncated.front() != "true" || next.empty()) break;
    token = next.front();
  }
  std::sort(out.begin(), out.end());
  if (out.empty()) throw RemoteError(url, 404, "no .tar object under this prefix");
  return out;
}

void check_upload_target(const std::string& url) {
  if (url.starts_with("pipe:")) throw ConfigError(fmt::format("'{}': pipe: is for reading shards", url));
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

StagedShards stage_shards(const std::vector<std::string>& urls, const RemoteConfig& config) {
  if (!config.cache_dir.empty()) sweep_parts(config.cache_dir);
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
  StagedShards out;
  out.urls = urls;
  out.local.resize(urls.size());
  keep->locks.resize(urls.size());
  std::vector<ShardOutcome> outcomes(urls.size());
  std::map<fs::path, std::string> owner;
  for (std::size_t i = 0; i < urls.size(); ++i) {
    out.local[i] = root / folder_of(urls[i]) / remote_shard_name(urls[i]);
    const auto [it, fresh] = owner.emplace(out.local[i], redact_url(urls[i]));
    if (!fresh && it->second != redact_url(urls[i])) {
      throw ConfigError(fmt::format("'{}' and '{}' name the same shard file '{}' (a URL's file name, its query "
                                    "left out): give each shard its own name",
                                    it->second, redact_url(urls[i]), out.local[i].filename().string()));
    }
  }
  std::atomic<std::size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  {
    const unsigned workers = std::max(1U, std::min<unsigned>(config.parallel, static_cast<unsigned>(urls.size())));
    std::vector<std::jthread> pool;
    for (unsigned w = 0; w < workers; ++w) {
      pool.emplace_back([&] {
        for (std::size_t i = next++; i < urls.size(); i = next++) {
          try {
            outcomes[i] = stage_one(urls[i], out.local[i], keep->locks[i], config);
          } catch (...) {
            const std::scoped_lock lock(failure_mutex);
            if (!failure) failure = std::current_exception();
            next = urls.size();  // the first failure ends the staging
          }
        }
      });
    }
  }
  if (failure) std::rethrow_exception(failure);
  std::uint64_t own = 0;
  for (const ShardOutcome& o : outcomes) {
    own += o.bytes;
    (o.fetched ? out.fetched_bytes : out.reused_bytes) += o.bytes;
  }
  if (config.cache_limit > 0 && keep->private_dir.empty()) evict(root, config.cache_limit, own);
  out.keep = keep;
  return out;
}

}  // namespace pinfeed::loader
