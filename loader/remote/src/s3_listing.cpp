// S3 prefixes: s3://bucket/prefix/ stands for the .tar objects under it,
// listed with ListObjectsV2 (every page, bounded), signed as every request
// is (remote.cpp's make_handle).
#include <curl/curl.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "curl_transfer.hpp"
#include "pinfeed/error.hpp"
#include "pinfeed/loader/remote.hpp"

namespace pinfeed::loader {

using namespace detail;

namespace {

std::string xml_unescape(std::string s) {
  static const std::pair<const char*, const char*> kEntities[] = {{"&lt;", "<"},   {"&gt;", ">"},   {"&quot;", "\""},
                                                                  {"&apos;", "'"}, {"&#13;", "\r"}, {"&amp;", "&"}};
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
  char* e =
      curl_easy_escape(nullptr, s.c_str(), static_cast<int>(s.size()));  // all but unreserved: S3's canonical form
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
      throw RemoteError(url, 0,
                        fmt::format("the listing repeats its continuation token after {} pages: the store "
                                    "would be listed forever",
                                    page + 1));
    }
    if (out.size() > 10'000'000) throw RemoteError(url, 0, "the listing names over 10 million .tar objects");
  }
  std::sort(out.begin(), out.end());
  if (out.empty()) throw RemoteError(url, 404, "no .tar object under this prefix");
  return out;
}

}  // namespace pinfeed::loader
