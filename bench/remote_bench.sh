#!/usr/bin/env bash
# pinfeed-bench remote against a real nginx on loopback: packs FOLDER (an
# ImageFolder) into shards, serves them, and times the same shards from the
# server (cold and cached) and from disk in one run.
#
#   bash bench/remote_bench.sh build/real-photos/train [per-shard] [extra pinfeed-bench flags...]
set -euo pipefail
folder=${1:?usage: remote_bench.sh IMAGEFOLDER [per-shard] [flags...]}
per_shard=${2:-64}
shift $(( $# >= 2 ? 2 : 1 ))
build=${PINFEED_BUILD:-build/release}
work=$(mktemp -d /tmp/pinfeed-remote-bench-XXXXXX)
trap 'kill $(cat "$work/nginx.pid" 2>/dev/null) 2>/dev/null || true; rm -rf "$work"' EXIT
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
"$build/bench/pinfeed-bench" remote --data "http://127.0.0.1:$port/data/train-{$first..$last}.tar" \
  --local "$work/www/data/train-{$first..$last}.tar" --cache-dir "$work/cache" "$@"
