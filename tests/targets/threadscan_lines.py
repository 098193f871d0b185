"""A process for tests/test_threadscan.py: threads parked at known lines, for comparing the scan's
Python stacks with the interpreter's own sys._current_frames(). Runs on CPython 3.9-3.13.

Prints {native_id: [[co_name, co_filename, f_lineno], ...innermost first]} for every parked thread
(the main thread included), from a helper thread that then exits, and the main thread waits.
"""

import json
import os
import select
import sys
import threading
import time

never = threading.Event()
parked = []


def nested(depth):
    if depth:
        return nested(depth - 1)
    time.sleep(1000)


class Holder:
    def method(self):
        x = 1
        y = x + 1
        select.select([], [], [], 1000 + y)

    @staticmethod
    def decorated():
        never.wait()


def gen():
    r, _w = os.pipe()
    yield os.read(r, 1)


def in_generator():
    for _ in gen():
        pass


def lambda_caller():
    f = lambda: time.sleep(1000)  # noqa: E731
    f()


def dump():
    time.sleep(0.5)  # let every thread reach its blocking call
    frames = sys._current_frames()
    out = {}
    for t in threading.enumerate():
        if t.ident in frames and t.ident in parked:
            f, stack = frames[t.ident], []
            while f is not None:
                stack.append([f.f_code.co_name, f.f_code.co_filename, f.f_lineno])
                f = f.f_back
            out[t.native_id] = stack
    print(json.dumps(out), flush=True)


for fn in (lambda: nested(5), Holder().method, Holder.decorated, in_generator, lambda_caller):
    th = threading.Thread(target=fn, daemon=True)
    th.start()
    parked.append(th.ident)
parked.append(threading.main_thread().ident)
threading.Thread(target=dump).start()
never.wait()
