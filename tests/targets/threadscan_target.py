"""A process for tests/test_threadscan.py: threads blocked in a C library (via ctypes) and in Python.

argv: LIBRARY MODE [CONTROL_FILE]. MODE "block": a thread blocked in lib.blocker() from wait_here()
and a thread in time.sleep; "alternate": also a thread that naps in the library, or spins in Python
while CONTROL_FILE exists; "worker": only the library's own thread and a sleeper; "many": a
blocked thread, the library's thread and 18 sleepers (a process the size of a rank). Prints the
threads' native ids as JSON, then the main thread waits on stdin.
"""

import ctypes
import json
import os
import sys
import threading
import time

lib = ctypes.CDLL(sys.argv[1])
MODE = sys.argv[2]
CONTROL = sys.argv[3] if len(sys.argv) > 3 else ""


def wait_here():
    lib.blocker()  # @blocker


def sleepy():
    while True:
        time.sleep(100)  # @sleeper


def alternate():
    while True:
        if os.path.exists(CONTROL):
            end = time.perf_counter() + 0.02
            while time.perf_counter() < end:
                pass
        else:
            lib.napper(200)  # @napper


def start(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    while t.native_id is None:
        time.sleep(0.001)
    return t.native_id


ids = {"sleeper": start(sleepy)}
if MODE in ("block", "alternate", "many"):
    ids["blocker"] = start(wait_here)
if MODE == "alternate":
    ids["alternator"] = start(alternate)
if MODE in ("worker", "many"):
    lib.start_worker()
if MODE == "many":
    for _ in range(18):
        start(sleepy)
print(json.dumps(ids), flush=True)
sys.stdin.read()  # @main
