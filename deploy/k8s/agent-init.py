#!/usr/bin/env python3
"""The agent container's first process: runs `argus probe ...` and, when it ends, waits for its
keeper to finish removing the uprobes before the container may stop.

Why: the agent hands a copy of every uprobe to a keeper process (argus/agent/keeper.py) that removes
them from the training processes after the agent exits, ~0.13 s each (~45 s for 8 ranks). A
container that shares the host's PID namespace (hostPID: true) has no PID namespace of its own to
tear down, so when its first process exits the container runtime SIGKILLs whatever is left in it,
and a keeper killed mid-removal leaves int3s in the ranks' libraries until they exit. Run directly
as the container's command, `argus probe` would be that first process.

So this process makes itself the child subreaper (the keeper is reparented to it when the agent
exits), forwards SIGTERM/SIGINT to the agent, and exits with the agent's status only when no child
is left. The agent's stdout (its rank table, printed every interval off a terminal) is discarded
unless ARGUS_KEEP_STDOUT=1; stderr (attach lines, warnings, errors) is the container's log.

Usage (the DaemonSet's command and args): agent-init.py /opt/argus/bin/argus probe --all --wait ...
Stdlib only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list) -> int:
    if not argv:
        print("usage: agent-init.py ARGUS_COMMAND...", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(
            f"agent-init: warning: PR_SET_CHILD_SUBREAPER failed (errno {ctypes.get_errno()}): "
            "the keeper will not be waited for",
            file=sys.stderr,
        )
    out = None if os.environ.get("ARGUS_KEEP_STDOUT") == "1" else subprocess.DEVNULL
    agent = subprocess.Popen(argv, stdout=out)

    def forward(signum: int, _frame: object) -> None:
        if agent.poll() is None:
            agent.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc = agent.wait()
    # the keeper (and anything else the agent left) is our child now: wait for every one of them
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
