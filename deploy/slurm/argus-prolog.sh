#!/bin/bash
# Slurm Prolog: start an Argus agent for this job's processes on this node.
#
# slurm.conf on every compute node (or add a line calling this script to your existing Prolog):
#     Prolog=/etc/slurm/argus-prolog.sh
#     Epilog=/etc/slurm/argus-epilog.sh
# slurmd runs it as root, once per job on each node, before the job's first process starts there.
# Settings: /etc/argus/argus.env (deploy/systemd/argus.env: ARGUS_REDIS_URL, ARGUS_SLURM_MATCH,
# ARGUS_SLURM_PROBE_ARGS) and the per-host agent's Redis password in /etc/argus/agent.pw (root,
# 0600). Use either this or the per-host service (deploy/systemd/argus-probe.service) on a node, not
# both: each rank would be probed twice. ARGUS, ARGUS_ENV_FILE, ARGUS_STATE_DIR and ARGUS_LOG_DIR
# below are there for tests/test_deploy.py, which runs this script with a stand-in argus.
#
# What it runs, in the background:
#     argus probe --all --wait --job slurm-$SLURM_JOB_ID --match '^slurmstepd: \[$SLURM_JOB_ID\.|...'
#                 --redis $ARGUS_REDIS_URL
# - `--all --wait`: the job has no process yet; the agent looks every 2 s and attaches to each one
#   that maps libcuda/libcudart/libnccl and matches;
# - `--match`: a process matches when its command line or an ANCESTOR's matches. Slurm's step
#   daemon names itself `slurmstepd: [JOBID.STEP]`, so the ranks `srun` starts match, and so do
#   those a `torchrun` or `mpirun` inside the step spawns, and the processes the batch script
#   starts (under /var/spool/slurmd/job0JOBID/slurm_script). ARGUS_SLURM_MATCH in
#   /etc/argus/argus.env replaces the pattern where a site launches otherwise (it may also match
#   another job's processes on a shared node), or is empty (`ARGUS_SLURM_MATCH=`) on nodes given
#   to one job at a time.
# - `--job slurm-$SLURM_JOB_ID`: every rank on every node of the job under one name, the one the
#   agent would derive itself for srun-started ranks (docs/probe.md), also for torchrun ranks.
#
# Redis credentials: the per-host agent's ACL user (docs/security.md, write-only). A per-job user
# (`argus-agent-JOB`, keys of that job only) needs a Redis admin credential to create it; keep that
# off the compute nodes and create it in PrologSlurmctld, on the controller, instead (not provided).
#
# A failing Prolog drains the node: this script never fails the job because of the tracer. It
# says what it did on stderr (slurmd's log) and in /var/log/argus/slurm-JOBID.log (the agent's
# stderr: attach lines, warnings, errors).
set -u

ARGUS=${ARGUS:-/opt/argus/bin/argus}
ARGUS_ENV_FILE=${ARGUS_ENV_FILE:-/etc/argus/argus.env}
ARGUS_STATE_DIR=${ARGUS_STATE_DIR:-/run/argus}
ARGUS_LOG_DIR=${ARGUS_LOG_DIR:-/var/log/argus}

say() { echo "argus-prolog: job ${SLURM_JOB_ID:-?}: $*" >&2; }

if [[ ! ${SLURM_JOB_ID:-} =~ ^[0-9]+$ ]]; then
    say "no SLURM_JOB_ID: not run by slurmd; nothing to do"
    exit 0
fi
if [[ ! -x $ARGUS ]]; then
    say "$ARGUS is missing: no tracing of this job"
    exit 0
fi
if [[ -r $ARGUS_ENV_FILE ]]; then
    set -a # every KEY=value of the file is exported to the agent
    # shellcheck source=/dev/null
    . "$ARGUS_ENV_FILE"
    set +a
fi
if [[ -z ${ARGUS_REDIS_URL:-} ]]; then
    say "ARGUS_REDIS_URL is not set (in $ARGUS_ENV_FILE): no tracing of this job"
    exit 0
fi
export ARGUS_REDIS_USERNAME=${ARGUS_REDIS_USERNAME:-argus-agent}
export ARGUS_REDIS_PASSWORD_FILE=${ARGUS_REDIS_PASSWORD_FILE:-/etc/argus/agent.pw}

# unset: the job's step daemons and batch script; set and empty: every process that maps the libraries
match=${ARGUS_SLURM_MATCH-"^slurmstepd: \[${SLURM_JOB_ID}\.|/job0*${SLURM_JOB_ID}/slurm_script"}

# Extra flags for these agents (argus.env: ARGUS_SLURM_PROBE_ARGS, split at spaces; not the per-host
# service's ARGUS_PROBE_ARGS, whose --match would take the job's place). They come first: the job's
# --job, --redis and --match below win over any repeated there.
read -r -a extra <<<"${ARGUS_SLURM_PROBE_ARGS:-}"
args=(probe --all --wait "${extra[@]}" --job "slurm-$SLURM_JOB_ID" --redis "$ARGUS_REDIS_URL")
if [[ -n $match ]]; then
    args+=(--match "$match")
fi

install -d -m 0700 "$ARGUS_STATE_DIR" "$ARGUS_LOG_DIR"  # 0700 even when they exist already
pidfile=$ARGUS_STATE_DIR/slurm-$SLURM_JOB_ID.pid
log=$ARGUS_LOG_DIR/slurm-$SLURM_JOB_ID.log

# slurmd kills the Prolog's whole process group once the Prolog exits (Slurm's own tests check
# that a background child of the Prolog is gone), so the agent gets a session of its own (setsid).
# Started from a non-interactive shell it is no process group leader, so setsid does not fork and
# $! is the agent's pid. Its stdout (a rank table every interval) is not wanted; stderr is the log.
setsid "$ARGUS" "${args[@]}" </dev/null >/dev/null 2>>"$log" &
pid=$!
echo "$pid" >"$pidfile"
say "started argus probe (pid $pid, job slurm-$SLURM_JOB_ID${match:+, match $match}); log $log"
exit 0
