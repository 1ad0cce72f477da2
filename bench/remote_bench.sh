#!/usr/bin/env bash
# pinfeed-bench remote against a real nginx on loopback: packs FOLDER (an
# ImageFolder) into shards (with their index sidecars, so they stream),
# serves them, and times the same shards from the server (no cache, a fresh
# cache_dir, a warm one) and from disk in one run.
#
#   bash bench/remote_bench.sh build/real-photos/train [per-shard] [--rtt-ms N] [extra pinfeed-bench flags...]
#
# --rtt-ms N puts pinfeed-delay-proxy between the loader and nginx, holding
# every byte N/2 ms each way (this kernel has no tc netem); its CPU time is
# printed at the end, since it shares the machine with the loader.
set -euo pipefail
folder=${1:?usage: remote_bench.sh IMAGEFOLDER [per-shard] [--rtt-ms N] [flags...]}
per_shard=${2:-64}
shift $(( $# >= 2 ? 2 : 1 ))
rtt_ms=0
args=()
while (( $# )); do
  if [[ $1 == --rtt-ms ]]; then rtt_ms=${2:?--rtt-ms needs a value}; shift 2; else args+=("$1"); shift; fi
done
build=${PINFEED_BUILD:-build/release}
work=$(mktemp -d /tmp/pinfeed-remote-bench-XXXXXX)
proxy=""
cleanup() {
  if [[ -n $proxy ]]; then kill "$proxy" 2>/dev/null || true; wait "$proxy" 2>/dev/null || true; cat "$work/proxy.err" >&2 || true; fi
  kill "$(cat "$work/nginx.pid" 2>/dev/null)" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/www/data" "$work/run"
"$build/tools/pinfeed-data" -q pack --from "$folder" --out "$work/www/data/train" --per-shard "$per_shard" >/dev/null
pattern=$(cd "$work/www/data" && ls train-*.tar | sed -n '1p;$p' | sed 's/train-\([0-9]*\)\.tar/\1/' | paste -sd' ')
read -r first last <<<"$pattern"
port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
user=""; [[ $(id -u) -eq 0 ]] && user="user root;"
cat >"$work/run/nginx.conf" <<CONF
$user
pid $work/nginx.pid;
error_log $work/run/error.log;
events { worker_connections 256; }
http {
  access_log off;
  sendfile on;
  client_body_temp_path $work/run/cb; proxy_temp_path $work/run/p; fastcgi_temp_path $work/run/f;
  uwsgi_temp_path $work/run/u; scgi_temp_path $work/run/s;
  server { listen 127.0.0.1:$port; root $work/www; }
}
CONF
nginx -c "$work/run/nginx.conf" -p "$work/run"
for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
serve=$port
if [[ $rtt_ms != 0 ]]; then
  "$build/bench/pinfeed-delay-proxy" --to "127.0.0.1:$port" --delay-ms "$(/usr/bin/python3 -c "print($rtt_ms / 2)")" \
    >"$work/proxy.port" 2>"$work/proxy.err" &
  proxy=$!
  for _ in $(seq 50); do [[ -s $work/proxy.port ]] && break; sleep 0.1; done
  serve=$(cat "$work/proxy.port")
  echo "round trip: $rtt_ms ms (pinfeed-delay-proxy on port $serve)" >&2
fi
"$build/bench/pinfeed-bench" remote --data "http://127.0.0.1:$serve/data/train-{$first..$last}.tar" \
  --local "$work/www/data/train-{$first..$last}.tar" --cache-dir "$work/cache" "${args[@]}"
