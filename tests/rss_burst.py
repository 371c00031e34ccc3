#!/usr/bin/env python3
"""RSS of `shunt proxy` before, during and after a burst of connections (issue 16).

    cargo build --release --bins -p shunt
    python3 tests/rss_burst.py target/release/shunt 1000            # 400 KiB of headers each: 431
    PAD_KB=50 HOLD=3 BATCH=1000 python3 tests/rss_burst.py target/release/shunt 1000
                                            # 1000 open at once, 50 KiB of unfinished headers each

Serves a direct_response listener on 127.0.0.1:18080; reads VmRSS from /proc. TRIM=1 calls
malloc_trim(0) in the proxy through gdb at the end, to tell glibc's retained free heap apart
from memory still in use.
"""
import socket, sys, time, threading, subprocess, re, os

BOOTSTRAP = """{"node": {"id": "rss", "cluster": "rss"},
 "static_resources": {"listeners": [{"name": "http",
  "address": {"socket_address": {"address": "127.0.0.1", "port_value": 18080}},
  "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
   "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
    "stat_prefix": "rss",
    "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
      {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok"}}}]}]},
    "http_filters": [{"name": "router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}]}]}}"""

BIN = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
import tempfile
boot = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
boot.write(BOOTSTRAP)
boot.close()
p = subprocess.Popen([BIN, "proxy", "-c", boot.name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
def rss():
    s = open(f"/proc/{p.pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+)", s).group(1)) // 1024
def wait_up():
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", 18080)).close(); return
        except OSError: time.sleep(0.05)
    raise SystemExit("not up")
wait_up(); time.sleep(1)
print("before: %d MiB" % rss(), flush=True)
peak = [0]
stop = False
def sampler():
    while not stop:
        peak[0] = max(peak[0], rss()); time.sleep(0.05)
t = threading.Thread(target=sampler); t.start()
pad = b"a" * (int(os.environ.get("PAD_KB","400")) * 1024)
HOLD = float(os.environ.get("HOLD","0"))
statuses = {}
lock = threading.Lock()
def one():
    try:
        s = socket.create_connection(("127.0.0.1", 18080))
        s.sendall(b"GET / HTTP/1.1\r\nhost: a\r\nx-pad: ")
        try:
            s.sendall(pad)
        except OSError:
            pass
        data = b""
        if HOLD:
            time.sleep(HOLD); s.close()
            with lock:
                statuses["held"] = statuses.get("held", 0) + 1
            return
        s.settimeout(10)
        while True:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk: break
            data += chunk
        st = data[9:12].decode() or "closed"
        s.close()
    except OSError as e:
        st = "err:" + type(e).__name__
    with lock:
        statuses[st] = statuses.get(st, 0) + 1
threads = []
# 200 connections open at once, 1000 in all
B = int(os.environ.get("BATCH","200"))
for batch in range(N // B):
    ts = [threading.Thread(target=one) for _ in range(B)]
    for x in ts: x.start()
    for x in ts: x.join()
stop = True; t.join()
print("statuses", statuses)
print("peak during: %d MiB" % peak[0], flush=True)
prev = 0
for secs in (0, 1, 6, 12):
    time.sleep(secs - (0 if secs == 0 else prev))
    prev = secs
    print("after %ds: %d MiB" % (secs, rss()), flush=True)
import os
if os.environ.get("TRIM"):
    subprocess.run(["gdb","-p",str(p.pid),"-batch","-ex","call (int)malloc_trim(0)"],stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL)
    print("after malloc_trim(0): %d MiB" % rss(), flush=True)
print(open(f"/proc/{p.pid}/smaps_rollup").read() if os.environ.get("SMAPS") else "", flush=True)
p.terminate(); p.wait()
os.unlink(boot.name)
