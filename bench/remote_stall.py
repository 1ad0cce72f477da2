"""How long a stall takes to be noticed (issue 51): a server trickling 1 byte/s
against pinfeed.Loader with remote_timeout T and no retry; the error should
come after T seconds (libcurl's own 1 byte/s low-speed check never ended it).

    PYTHONPATH=build/release/python python3 bench/remote_stall.py
"""
import socket, time, threading, http.server, statistics, sys
import pinfeed
class Trickle(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "100000"); self.end_headers()
        try:
            for _ in range(100000):
                self.wfile.write(b"\0"); self.wfile.flush(); time.sleep(1)
        except OSError: pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle); s.daemon_threads = True
threading.Thread(target=s.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{s.server_address[1]}/x/train-000000.tar"
pinfeed.Loader  # torch imported before the clock starts
for timeout in (2, 5):
    times = []
    for _ in range(3):
        t = time.monotonic()
        try:
            pinfeed.Loader(url, batch_size=2, remote_timeout=timeout, remote_retries=0)
        except pinfeed.Error as e:
            assert "remote_min_rate" in str(e), e
        times.append(time.monotonic() - t)
    print(f"1 byte/s trickle, remote_timeout={timeout}, no retry: error after {statistics.median(times):.2f} s (median of 3: {', '.join(f'{x:.2f}' for x in times)})")
