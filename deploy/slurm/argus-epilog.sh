#!/bin/bash
# Slurm Epilog: stop the Argus agent that argus-prolog.sh started for this job on this node.
#
# slurm.conf: Epilog=/etc/slurm/argus-epilog.sh (with Prolog=/etc/slurm/argus-prolog.sh). slurmd
# runs it as root on each node of the job after the job's processes there have ended.
#
# SIGTERM: the agent publishes what it still holds, says how much it dropped and exits 0. Its keeper
# process (argus/agent/keeper.py) then removes the uprobes from the ranks' libraries on its own,
# ~0.13 s each; nothing here waits for it (the ranks are gone by now anyway). An agent that has not
# exited after ARGUS_STOP_WAIT seconds (default 20) is killed: even then the keeper removes the
# probes.
#
# A failing Epilog drains the node: this script always exits 0.
set -u

ARGUS_STATE_DIR=${ARGUS_STATE_DIR:-/run/argus}
ARGUS_STOP_WAIT=${ARGUS_STOP_WAIT:-20}

say() { echo "argus-epilog: job ${SLURM_JOB_ID:-?}: $*" >&2; }

if [[ ! ${SLURM_JOB_ID:-} =~ ^[0-9]+$ ]]; then
    say "no SLURM_JOB_ID: not run by slurmd; nothing to do"
    exit 0
fi
pidfile=$ARGUS_STATE_DIR/slurm-$SLURM_JOB_ID.pid
if [[ ! -f $pidfile ]]; then
    exit 0 # the prolog started no agent for this job here
fi
pid=$(<"$pidfile")
rm -f "$pidfile"

# Is it still our agent? A pid is reused once its process is gone: look for `--job slurm-JOBID`
# in its command line before signalling it.
ours() {
    local argv=() i
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    mapfile -d '' -t argv 2>/dev/null <"/proc/$pid/cmdline" || return 1
    for ((i = 0; i + 1 < ${#argv[@]}; i++)); do
        if [[ ${argv[i]} == --job && ${argv[i + 1]} == "slurm-$SLURM_JOB_ID" ]]; then
            return 0
        fi
    done
    return 1
}

if ! ours; then
    say "agent (pid $pid) already gone"
    exit 0
fi
kill -TERM "$pid" 2>/dev/null
for ((i = 0; i < ARGUS_STOP_WAIT * 10; i++)); do
    ours || {
        say "agent (pid $pid) stopped"
        exit 0
    }
    sleep 0.1
done
say "agent (pid $pid) still running after ${ARGUS_STOP_WAIT}s: SIGKILL (its keeper still removes the probes)"
kill -KILL "$pid" 2>/dev/null
exit 0
