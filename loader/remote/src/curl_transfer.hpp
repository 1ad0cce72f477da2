#pragma once
// The libcurl pieces remote.cpp (uploads, HEAD), remote_fetch.cpp (staging),
// s3_listing.cpp and streamed.cpp
// (per-sample Range reads) share: one way to make a handle (timeouts, S3
// signing, redirect rules), one body/header sink, one reading of statuses.
// Private to the loader library.
#include <curl/curl.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "pinfeed/loader/remote.hpp"

namespace pinfeed::loader::detail {

struct EasyDeleter {
  void operator()(CURL* h) const noexcept { curl_easy_cleanup(h); }
};
struct ListDeleter {
  void operator()(curl_slist* l) const noexcept { curl_slist_free_all(l); }
};
using Easy = std::unique_ptr<CURL, EasyDeleter>;
using HeaderList = std::unique_ptr<curl_slist, ListDeleter>;

/// What one transfer saw.
struct Transfer {
  int fd = -1;                ///< the body goes here (2xx only)
  bool resuming = false;      ///< a Range request: 206 appends, 200 starts over
  std::uint64_t written = 0;  ///< body bytes written by this transfer
  bool restarted = false;     ///< the server ignored the Range: the file was truncated
  std::string error_body;     ///< the start of a non-2xx body, for the message
  std::string etag;
  std::string last_modified;  ///< the answer's Last-Modified
  std::string content_range;  ///< a 206's Content-Range value ("bytes a-b/total")
  std::string write_error;
  std::string* text = nullptr;            ///< a 2xx body kept in memory instead (a listing, a sample)
  std::uint64_t text_limit = 0;           ///< with text: more than this many bytes ends the transfer (0: no limit)
  const char* text_what = "this answer";  ///< what the limit is for, in its message
  /// With fd: the file may not grow past this many bytes (0: no bound);
  /// `byte_limit_why` says what set it, for the message.
  std::uint64_t byte_limit = 0;
  std::uint64_t file_base = 0;  ///< bytes the file held when this transfer began (a resume)
  std::string byte_limit_why;
  std::uint64_t unknown_limit = 0;  ///< also, for a body of no announced length (0: no bound)
  std::string unknown_limit_why;
  CURL* handle = nullptr;
  // Note [Bounded waits]: watch_progress's state.
  const std::atomic<bool>* cancel = nullptr;
  double min_rate = 0;  ///< bytes/s a transfer must keep up over `window` seconds
  double window = 0;
  std::chrono::steady_clock::time_point window_start{};
  std::uint64_t window_bytes = 0;
  std::string stalled;                             ///< set when the progress check ended the transfer: why
  std::array<char, CURL_ERROR_SIZE> curl_error{};  ///< libcurl's message for the failure (CURLOPT_ERRORBUFFER)
};

/// curl_global_init, once per process, before any handle.
void curl_init_once();
long response_code(CURL* h);
std::size_t on_body(char* data, std::size_t size, std::size_t n, void* user);
std::size_t on_header(char* data, std::size_t size, std::size_t n, void* user);
/// A handle set up for `url` (s3:// signed), with the timeouts; its
/// headers (S3's) go into `headers`, which must outlive the transfer.
Easy make_handle(const std::string& url, const RemoteConfig& config, HeaderList& headers,
                 const std::string& target_override = {});
/// Ends the transfer when `config.cancel` is set, or when it brings less than
/// `config.min_rate` bytes/s over any `config.read_timeout` seconds (headers
/// included: a trickled answer is a stall), setting t.stalled. libcurl's
/// own low-speed check is 1 byte/s and sees only the body. The transfer then
/// ends with CURLE_ABORTED_BY_CALLBACK: t.stalled says which.
void watch_progress(CURL* h, Transfer& t, const RemoteConfig& config);
/// 4xx answers no retry changes (429, 408 and 416 are retried, as is 5xx).
bool final_status(long code);
/// Why a libcurl failure no retry changes is final ("" for the others:
/// timeouts, resets, refused connections are retried).
/// `t.curl_error` (libcurl's own message) tells a response header over its
/// limit, which libcurl 8 reports as a receive error, from a reset.
std::string permanent_error(CURLcode rc, const Transfer& t);
/// Why a failed try failed, for the retry's log and the last error: the
/// stall watch_progress saw (t.stalled); a libcurl timeout (no connection
/// in time, or its own low-speed backstop) with the options that bound it;
/// else libcurl's word for `rc`.
std::string retry_reason(CURLcode rc, const Transfer& t);
/// "HTTP status 404 NoSuchKey: The specified key does not exist."
std::string status_text(long code, const std::string& body);
/// Seconds before retry `attempt` (0-based): backoff doubling to 8 s, 0.5-1.5x jitter.
double backoff_seconds(const RemoteConfig& config, unsigned attempt);
/// The backoff before retry `attempt`, cut short (Cancelled naming `url`)
/// when config.cancel is set.
void sleep_backoff(const RemoteConfig& config, unsigned attempt, const std::string& url);
/// One request without state between tries, retried per `config`.
void request(const std::string& url, const RemoteConfig& config, const std::string& target,
             const std::function<void(CURL*, Transfer&)>& setup, const std::function<void(CURL*, Transfer&)>& done);

/// What a HEAD says of an object.
struct Head {
  std::uint64_t size = 0;
  bool size_known = false;
  std::string etag;
  std::string last_modified;  ///< the server's Last-Modified, as it gave it
};
/// The server's size, ETag and Last-Modified for `url` (HEAD), with the retries.
Head head_url(const std::string& url, const RemoteConfig& config);
/// Whether the server's bytes still are those of `local` (`size` bytes),
/// for a server that gives neither ETag nor Last-Modified: its first and
/// last 64 KiB, by Range (false when it cannot say: no Range support).
bool same_ends(const std::string& url, int local, std::uint64_t size, const RemoteConfig& config);

}  // namespace pinfeed::loader::detail
