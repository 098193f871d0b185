#!/usr/bin/env bash
# Argus on a real GPU, in one short script (< 8 minutes): which real libcuda/libnccl symbols
# attach, what is captured, and the overhead on a one-GPU PyTorch loop with an NCCL communicator of
# one rank. Without a GPU it says SKIP (with the reason) for the GPU parts, runs the CPU-side checks,
# and exits 0.
#
#   sudo benchmarks/gpu_check.sh [OUTDIR]        # OUTDIR defaults to $OUT, else a new temp dir
#
# Environment: PYTHON (the agent's interpreter; default .venv/bin/python, which can import bcc),
# TORCH_PYTHON (an interpreter with a CUDA build of torch; default: the first of PYTHON, python3
# that has one), GPU_STEPS (timed steps per run, default 200).
# Everything printed also goes to OUTDIR/gpu_check.log; per-run files stay in OUTDIR.
set -u

cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-$(mktemp -d /tmp/argus-gpu-check.XXXXXX)}}"
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
exec > >(tee "$LOG") 2>&1
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
START=$(date +%s)
say() { printf '%s\n' "$*"; }
section() { printf '\n== %s (t=%ss)\n' "$*" "$(($(date +%s) - START))"; }

section "machine"
say "date: $(date -u '+%Y-%m-%d %H:%M UTC')  host: $(uname -n)  kernel: $(uname -r)  cpus: $(nproc)"
say "agent python: $PY ($("$PY" --version 2>&1))"
if [ "$(id -u)" -ne 0 ]; then
    say "SKIP: everything that loads BPF: not root (run: sudo $0)"
    ROOT=0
else
    ROOT=1
fi

section "argus doctor"
timeout 60 "$PY" -m argus doctor
say "argus doctor exit: $? (12 = a check failed; NVML fails without a driver)"

section "CPU-side: the simulated job under argus probe (--quick)"
if [ "$ROOT" -eq 1 ]; then
    timeout 240 "$PY" -m benchmarks.footprint --quick
    say "footprint --quick exit: $?"
else
    say "SKIP: not root"
fi

section "GPU"
GPU_REASON=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
    GPU_REASON="no nvidia-smi (no NVIDIA driver)"
elif ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    GPU_REASON="nvidia-smi -L lists no GPU"
elif [ "$ROOT" -eq 0 ]; then
    GPU_REASON="not root"
fi
if [ -z "$GPU_REASON" ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    TPY="${TORCH_PYTHON:-}"
    if [ -z "$TPY" ]; then
        for c in "$PY" "$(command -v python3)"; do
            if [ -n "$c" ] && "$c" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
                TPY="$c"
                break
            fi
        done
    fi
    if [ -z "$TPY" ]; then
        GPU_REASON="no Python with a CUDA build of torch (set TORCH_PYTHON, or pip install torch in $PY's environment)"
    fi
fi
if [ -n "$GPU_REASON" ]; then
    say "SKIP: GPU training loop, real libcuda/libnccl attach and GPU overhead: $GPU_REASON"
else
    say "torch python: $TPY"
    timeout 420 "$PY" -m benchmarks.gpu_torch "$OUTDIR/runs" --python "$TPY" --steps "${GPU_STEPS:-200}"
    say "gpu_torch exit: $?"
fi

section "done"
say "output: $OUTDIR (log: $LOG), took $(($(date +%s) - START)) s"
exit 0
