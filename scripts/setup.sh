#!/usr/bin/env bash
# One-shot, idempotent setup of a Debian 12 machine for Argus development. Run once, as root:
#
#     sudo scripts/setup.sh
#
# Prints one line per step: "ok: ..." when nothing had to be done, otherwise what it did
# ("installed: ...", "linked: ...", "mounted: ...", "created: ...", "stopped: ...", "changed: ...").
# A second run prints only "ok:" lines and takes about a second.
set -euo pipefail

if [[ $(id -u) -ne 0 ]]; then
    echo "ERROR: scripts/setup.sh must run as root (it installs packages, links kernel headers and" \
        "mounts tracefs)" >&2
    echo "HINT: sudo scripts/setup.sh" >&2
    exit 1
fi

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"

ARCH=$(dpkg --print-architecture)
PACKAGES=(bpfcc-tools python3-bpfcc "linux-headers-$ARCH" redis-server gcc make bpftrace python3-venv
    binutils curl shellcheck)

pkg_installed() {
    [[ $(dpkg-query -W -f='${Status}' "$1" 2>/dev/null || true) == "install ok installed" ]]
}

# --- 1. Debian packages ---------------------------------------------------------------------
install_packages() {
    local missing=() pkg log
    for pkg in "${PACKAGES[@]}"; do
        pkg_installed "$pkg" || missing+=("$pkg")
    done
    if ((${#missing[@]} == 0)); then
        echo "ok: packages present (${PACKAGES[*]})"
        return
    fi
    local redis_was_missing=0
    pkg_installed redis-server || redis_was_missing=1
    log=$(mktemp /tmp/argus-setup-apt.XXXXXX.log)
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update && apt-get install -y "${missing[@]}"; } >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        echo "ERROR: apt-get install ${missing[*]} failed (full log: $log)" >&2
        exit 1
    fi
    rm -f "$log"
    echo "installed: ${missing[*]}"
    if ((redis_was_missing)); then
        stop_system_redis
    fi
}

# Chromium renders `argus report`'s page in a test (headless); without its recommends (~110 MB
# instead of ~300)
install_browser() {
    if pkg_installed chromium; then
        echo "ok: chromium present"
        return
    fi
    local log
    log=$(mktemp /tmp/argus-setup-apt.XXXXXX.log)
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update && apt-get install -y --no-install-recommends chromium; } >"$log" 2>&1; then
        tail -n 5 "$log" >&2
        echo "warning: could not install chromium (the report page test will skip; full log: $log)" >&2
        return
    fi
    rm -f "$log"
    echo "installed: chromium (headless, for the report page test)"
}

# apt may start Debian's redis-server service on port 6379; the tests start their own private
# servers and `argus demo` starts one when needed, so don't leave the system one running.
stop_system_redis() {
    if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
        if systemctl disable --now redis-server >/dev/null 2>&1; then
            echo "stopped: system redis-server service (disabled; tests start their own)"
        else
            echo "warn: could not stop the system redis-server service; left running on port 6379"
        fi
        return
    fi
    local pidfile=/run/redis/redis-server.pid
    if [[ -f $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        if /etc/init.d/redis-server stop >/dev/null 2>&1 || kill "$(cat "$pidfile")" 2>/dev/null; then
            echo "stopped: system redis-server started by apt (tests start their own)"
        else
            echo "warn: could not stop the system redis-server (pid $(cat "$pidfile")); left running"
        fi
    else
        echo "ok: apt did not start a system redis-server"
    fi
}

# --- 2. kernel headers for bcc ----------------------------------------------------------------
link_headers() {
    local krel moddir hdr common
    krel=$(uname -r)
    moddir=/lib/modules/$krel
    if [[ -e $moddir/build ]]; then
        echo "ok: kernel headers at $moddir/build -> $(readlink -f "$moddir/build")"
        return
    fi
    hdr=$(find /usr/src -maxdepth 1 -name "linux-headers-*-$ARCH" -print 2>/dev/null | sort -V | tail -n 1)
    if [[ -z $hdr ]]; then
        echo "ERROR: no /usr/src/linux-headers-*-$ARCH to link (is linux-headers-$ARCH installed?)" >&2
        exit 1
    fi
    common=${hdr%-"$ARCH"}-common
    if [[ ! -d $common ]]; then
        common=$(find /usr/src -maxdepth 1 -name 'linux-headers-*-common' -print | sort -V | tail -n 1)
    fi
    mkdir -p "$moddir"
    ln -sfn "$hdr" "$moddir/build"
    echo "linked: $moddir/build -> $hdr (Debian has no headers for kernel $krel;" \
        "fine for uprobe programs, which read no kernel structs)"
    if [[ -n $common ]]; then
        ln -sfn "$common" "$moddir/source"
        echo "linked: $moddir/source -> $common"
    fi
}

# --- 3. pseudo file systems -------------------------------------------------------------------
ensure_mount() {
    local fstype=$1 path=$2
    if awk -v p="$path" -v t="$fstype" '$2 == p && $3 == t { f = 1 } END { exit !f }' /proc/self/mounts; then
        echo "ok: $fstype mounted at $path"
        return
    fi
    if ! mount -t "$fstype" "$fstype" "$path"; then
        echo "ERROR: mount -t $fstype $fstype $path failed (in a container: run it privileged)" >&2
        exit 1
    fi
    echo "mounted: $fstype at $path"
}

# --- 4. Python virtual environment --------------------------------------------------------------
# bcc comes from Debian's python3-bpfcc, importable only from /usr/bin/python3 or a venv made from it
# with --system-site-packages (the PyPI "bcc" is an unrelated project).
setup_venv() {
    local venv=$REPO_ROOT/.venv
    local stamp=$venv/.argus-installed
    if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c 'import bcc' >/dev/null 2>&1; then
        echo "ok: .venv (from /usr/bin/python3, imports bcc)"
    else
        if [[ -e $venv ]]; then
            rm -rf -- "$venv"
            echo "removed: .venv (could not import bcc)"
        fi
        /usr/bin/python3 -m venv --system-site-packages "$venv"
        echo "created: .venv from /usr/bin/python3 with --system-site-packages"
    fi
    if [[ -f $stamp && ! pyproject.toml -nt $stamp ]]; then
        echo "ok: argus-tracer[dev] installed in .venv (pyproject.toml unchanged)"
        return
    fi
    local log
    log=$(mktemp /tmp/argus-setup-pip.XXXXXX.log)
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check -e '.[dev]' >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        echo "ERROR: pip install -e '.[dev]' into .venv failed (full log: $log)" >&2
        exit 1
    fi
    rm -f "$log"
    touch "$stamp"
    echo "installed: argus-tracer[dev] (editable) into .venv"
}

# --- 5. PyTorch (optional) ----------------------------------------------------------------------
# For the slow-tier real-PyTorch test and `make bench`. Only the CPU wheel that lies on this
# kind of machine (pip's find-links) is taken: a plain PyPI torch is a multi-GB CUDA build.
# ARGUS_TORCH=auto (default: only when the local wheel exists) | yes | no.
TORCH_PIN=torch==2.13.0
setup_torch() {
    local venv=$REPO_ROOT/.venv mode=${ARGUS_TORCH:-auto}
    if [[ $mode == no ]]; then
        echo "skipped: $TORCH_PIN (ARGUS_TORCH=no)"
        return
    fi
    if "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
        echo "ok: torch in .venv"
        return
    fi
    if [[ $mode == auto ]] && ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-index \
        --no-deps --dry-run "$TORCH_PIN" >/dev/null 2>&1; then
        echo "skipped: $TORCH_PIN (no local wheel; the real-PyTorch test and benchmark will skip; ARGUS_TORCH=yes downloads it)"
        return
    fi
    if "$venv/bin/python" -m pip install --disable-pip-version-check -q "$TORCH_PIN" py-spy >/dev/null 2>&1; then
        echo "installed: $TORCH_PIN and py-spy into .venv"
    else
        echo "warning: could not install $TORCH_PIN (the real-PyTorch test and benchmark will skip)" >&2
    fi
}

# Catapult's trace viewer (chrome://tracing's engine, from the pinned xprof wheel on PyPI): a test
# opens `argus record`'s trace in it, offline, in headless Chromium (tests/traceview.py)
setup_trace_viewer() {
    local out
    if out=$("$REPO_ROOT/.venv/bin/python" -m tests.traceview --fetch 2>&1); then
        echo "$out"
    else
        echo "warning: $out (the trace viewer test will skip)" >&2
    fi
}

# --- 7. the BPF code root loads ------------------------------------------------------------------
# The agent refuses to load BPF C that a user other than root (or the checkout's owner) could change
# (argus/agent/privs.py): a checkout made under umask 002 has it group-writable.
protect_bpf_code() {
    local dir=$REPO_ROOT/argus/bpf
    if [[ -z $(find "$dir" -perm /022 -print -quit) ]]; then
        echo "ok: $dir writable by its owner only"
        return
    fi
    chmod -R go-w "$dir"
    echo "changed: chmod -R go-w $dir (the agent refuses BPF code others could change)"
}

main() {
    install_packages
    install_browser
    link_headers
    ensure_mount tracefs /sys/kernel/tracing
    ensure_mount debugfs /sys/kernel/debug
    ensure_mount bpf /sys/fs/bpf
    setup_venv
    setup_torch
    setup_trace_viewer
    protect_bpf_code
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then # not when sourced (to test one step)
    main "$@"
fi
