#!/usr/bin/env bash
# Provisions one VM of the Argus Vagrant lab (vagrant/README.md). Run as root, from the checkout:
#
#     vagrant/provision.sh [--dry-run] [--redis-ip IP] [--secrets DIR] [--user USER] [--no-sim] ROLE
#
# ROLE  redis   redis-server listening on --redis-ip with one ACL user per role, `argus aggregate`
#               (deploy/systemd/argus-aggregate.service) and the read-only viewer for --user
#       node-N  the agent (deploy/systemd/argus-probe.service) publishing to that Redis, and a
#               simulated job run as --user (node-1's with a straggler; --no-sim: none)
#
# Every role first runs scripts/setup.sh (the setup CI runs), then installs argus into /opt/argus,
# where the units run it from, as docs/deploy.md does. The passwords come from root-only files in
# --secrets (the Vagrantfile makes them on the host and syncs them there) and are copied to the
# root-only files the units name; no password is ever on a command line.
#
# Every step prints what it runs (`+ command`; `+ write FILE` for a file it writes). With --dry-run
# that is all it does: nothing is run, nothing read but this checkout, no root needed
# (tests/test_vagrant.py checks what it prints). Running it again redoes every step: the units are
# restarted and the simulated job started afresh.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SYSTEMD_DIR=$REPO_ROOT/deploy/systemd
ARGUS=/opt/argus/bin/argus
SIM_UNIT=argus-lab-sim
# node-1's job: rank 2 runs every kernel 1.5 times longer from step 300 (~1 minute in); ~0.18 s a
# step otherwise, so 20,000 steps run about an hour
SIM_ARGS=(sim run --ranks 4 --steps 20000)
STRAGGLER=straggler:rank=2,factor=1.5,from_step=300

DRY=0
SIM=1
REDIS_IP=192.168.56.10
SECRETS=/etc/argus/lab-secrets
LAB_USER=vagrant
ROLE=

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

die() {
    echo "ERROR: $1" >&2
    [[ -z ${2:-} ]] || echo "HINT: $2" >&2
    exit "${3:-1}"
}

# --- printing and running ----------------------------------------------------------------------

# One shell line: each word as it is when safe, else in single quotes (what is printed parses back).
shown() {
    local out=() w q="'"
    for w in "$@"; do
        if [[ $w =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
            out+=("$w")
        else
            out+=("$q${w//$q/$q\\$q$q}$q")
        fi
    done
    printf '+ %s\n' "${out[*]}"
}

run() {
    shown "$@"
    ((DRY)) || "$@"
}

# Shell text (a pipe, a condition, a password read from a file into an environment variable)
run_sh() {
    printf '+ %s\n' "$1"
    ((DRY)) || bash -euo pipefail -c "$1"
}

# A check whose failure is reported, not fatal
run_may_fail() {
    shown "$@"
    ((DRY)) && return 0
    local rc=0
    "$@" || rc=$?
    ((rc == 0)) || echo "  (exit $rc: see above; provisioning goes on)"
}

# write_file PATH MODE OWNER:GROUP, the content on stdin
write_file() {
    local path=$1 mode=$2 owner=$3 line tmp
    printf '+ write %s (mode %s, owner %s):\n' "$path" "$mode" "$owner"
    if ((DRY)); then
        while IFS= read -r line || [[ -n $line ]]; do
            printf '    %s\n' "$line"
        done
        return 0
    fi
    tmp=$(mktemp)
    cat >"$tmp"
    install -m "$mode" -o "${owner%%:*}" -g "${owner#*:}" "$tmp" "$path"
    rm -f -- "$tmp"
}

step() {
    printf '\n== %s\n' "$*"
}

# --- the steps -----------------------------------------------------------------------------------

setup_machine() {
    step "scripts/setup.sh: packages, kernel headers, tracefs, the checkout's .venv (the setup CI runs)"
    run "$REPO_ROOT/scripts/setup.sh"
}

install_argus() {
    step "argus into /opt/argus, where the units run it from (docs/deploy.md, step 1)"
    # bcc is Debian's python3-bpfcc (setup.sh installed it): a venv of the system Python that sees it
    run /usr/bin/python3 -m venv --system-site-packages /opt/argus
    run /opt/argus/bin/python -m pip install --disable-pip-version-check -q "$REPO_ROOT"
}

# install_passwords ROLE...: $SECRETS/ROLE.pw -> /etc/argus/ROLE.pw, root, 0600
install_passwords() {
    step "passwords ($*): root-only copies in /etc/argus, where the units read them"
    run install -d -m 0755 /etc/argus
    local r
    for r in "$@"; do
        if ((!DRY)) && [[ ! -s $SECRETS/$r.pw ]]; then
            die "no $SECRETS/$r.pw" \
                "the Vagrantfile makes vagrant/.secrets/ on the host and syncs it to $SECRETS at vagrant up"
        fi
        run install -m 0600 -o root -g root "$SECRETS/$r.pw" "/etc/argus/$r.pw"
    done
}

# The SHA-256 Redis keeps of the password in /etc/argus/$1.pw (docs/deploy.md, step 2)
pw_hash() {
    if ((DRY)); then
        printf '<sha256 of /etc/argus/%s.pw>' "$1"
        return 0
    fi
    tr -d '\n' <"/etc/argus/$1.pw" | sha256sum | cut -d' ' -f1
}

setup_redis() {
    step "Redis on $REDIS_IP, one ACL user per role (docs/deploy.md, step 2)"
    local admin agent aggregator viewer
    admin=$(pw_hash admin)
    agent=$(pw_hash agent)
    aggregator=$(pw_hash aggregator)
    viewer=$(pw_hash viewer)
    # the users of docs/security.md; tests/test_vagrant.py keeps them the same as docs/deploy.md's
    write_file /etc/redis/users.acl 0640 redis:redis <<EOF
user default off
user argus-admin on #$admin ~* &* +@all
user argus-agent on #$agent resetkeys %W~argus:* %R~argus:*:names resetchannels -@all +ping +hello +xadd +hsetnx +hget +hset +set +sadd
user argus-aggregator on #$aggregator resetkeys ~argus:* resetchannels &argus:* -@all +ping +hello +@read +xreadgroup +xack +xautoclaim +xgroup|create +xadd +hset +publish +set +eval +pexpire
user argus-viewer on #$viewer resetkeys ~argus:* resetchannels -@all +ping +hello +@read
EOF
    # listen on the private network too; load the users: one aclfile line, last, however often this
    # runs (`$a` before `d`: GNU sed still appends after the last line when it deletes that line)
    run sed -i -e "s/^bind .*/bind 127.0.0.1 -::1 $REDIS_IP/" -e '$a aclfile /etc/redis/users.acl' \
        -e '/^aclfile /d' /etc/redis/redis.conf
    # setup.sh disables the service it installs (the tests start their own servers)
    run systemctl enable redis-server
    run systemctl restart redis-server
    # the whole path a client takes: the private address, a user, its password from its file
    run_sh "test \"\$(REDISCLI_AUTH=\"\$(cat /etc/argus/viewer.pw)\" redis-cli -h $REDIS_IP --user argus-viewer PING)\" = PONG"
    run_sh "REDISCLI_AUTH=\"\$(cat /etc/argus/admin.pw)\" redis-cli --user argus-admin ACL LIST | cut -d' ' -f1-3"
}

install_env() {
    run install -m 0644 "$SYSTEMD_DIR/argus.env" /etc/argus/argus.env
    run sed -i "s|^ARGUS_REDIS_URL=.*|ARGUS_REDIS_URL=$REDIS_URL|" /etc/argus/argus.env
}

install_unit() {
    run install -m 0644 "$SYSTEMD_DIR/$1" "/etc/systemd/system/$1"
    run systemctl daemon-reload
    run systemctl enable "$1"
    run systemctl restart "$1"
}

setup_aggregator() {
    step "the aggregator: deploy/systemd/argus-aggregate.service (docs/deploy.md, step 3)"
    install_env
    install_unit argus-aggregate.service
}

user_home() {
    if ((DRY)); then
        echo "/home/$LAB_USER"
        return 0
    fi
    local home
    home=$(getent passwd "$LAB_USER" | cut -d: -f6) || die "no user $LAB_USER" "pass --user USER"
    echo "$home"
}

setup_viewer() {
    step "the read-only viewer user for $LAB_USER: argus top, argus alerts (docs/deploy.md, step 5)"
    local home
    home=$(user_home)
    run install -d -m 0755 -o "$LAB_USER" -g "$LAB_USER" "$home/.config"
    run install -d -m 0700 -o "$LAB_USER" -g "$LAB_USER" "$home/.config/argus"
    run install -m 0600 -o "$LAB_USER" -g "$LAB_USER" /etc/argus/viewer.pw "$home/.config/argus/viewer.pw"
    write_file /etc/profile.d/argus-lab.sh 0644 root:root <<'EOF'
# Argus Vagrant lab (vagrant/provision.sh): the viewer's Redis user, for whoever has its password
if [ -r "$HOME/.config/argus/viewer.pw" ]; then
    export ARGUS_REDIS_USERNAME=argus-viewer ARGUS_REDIS_PASSWORD_FILE="$HOME/.config/argus/viewer.pw"
fi
EOF
}

setup_agent() {
    install_passwords agent
    step "the agent: deploy/systemd/argus-probe.service, publishing to $REDIS_URL (docs/deploy.md, step 4)"
    install_env
    install_unit argus-probe.service
    step "argus doctor: can probing work on this VM? (its Redis row is only a warning)"
    run_may_fail "$ARGUS" doctor
}

start_sim() {
    # its ranks report this VM's name (the role), not the simulator's node-0
    local args=("${SIM_ARGS[@]}" --hosts "$ROLE") what="no fault"
    if [[ $ROLE == node-1 ]]; then
        args+=(--inject "$STRAGGLER")
        what="a straggler: $STRAGGLER"
    fi
    step "a simulated job of its own ($what), as $LAB_USER, in the transient unit $SIM_UNIT"
    local home
    home=$(user_home)
    # one from an earlier provisioning goes first (its ranks with it: they are in its cgroup)
    run_sh "if systemctl is-active --quiet $SIM_UNIT; then systemctl stop $SIM_UNIT; fi"
    # HOME: the simulated libraries are built into ~/.cache/argus
    run systemd-run --unit="$SIM_UNIT" --collect --uid="$LAB_USER" --setenv=HOME="$home" \
        --description="Argus lab: simulated training job" "$ARGUS" "${args[@]}"
}

# --- main ----------------------------------------------------------------------------------------

main() {
    while (($#)); do
        case $1 in
        --dry-run) DRY=1 ;;
        --no-sim) SIM=0 ;;
        --redis-ip | --secrets | --user)
            (($# >= 2)) || die "$1 needs a value" "vagrant/provision.sh --help" 2
            case $1 in
            --redis-ip) REDIS_IP=$2 ;;
            --secrets) SECRETS=$2 ;;
            --user) LAB_USER=$2 ;;
            esac
            shift
            ;;
        -h | --help)
            usage
            exit 0
            ;;
        -*) die "unknown option $1" "vagrant/provision.sh --help" 2 ;;
        *)
            [[ -z $ROLE ]] || die "one ROLE only (got $ROLE and $1)" "vagrant/provision.sh --help" 2
            ROLE=$1
            ;;
        esac
        shift
    done
    [[ -n $ROLE ]] || die "no ROLE" "vagrant/provision.sh redis, or node-0, node-1, ..." 2
    [[ $ROLE == redis || $ROLE =~ ^node-[0-9]+$ ]] ||
        die "unknown ROLE $ROLE" "redis, or node-N (node-0, node-1, ...)" 2
    [[ $REDIS_IP =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ ]] || die "--redis-ip $REDIS_IP is no IPv4 address" "" 2
    [[ $LAB_USER =~ ^[a-z_][a-z0-9_-]*$ ]] || die "--user $LAB_USER is no user name" "" 2
    if ((!DRY)) && [[ $(id -u) -ne 0 ]]; then
        die "vagrant/provision.sh must run as root (or with --dry-run)" "sudo vagrant/provision.sh $ROLE"
    fi
    REDIS_URL=redis://$REDIS_IP:6379/0

    if ((DRY)); then
        echo "vagrant/provision.sh $ROLE: dry run, nothing is run (Redis: $REDIS_URL)"
    else
        echo "vagrant/provision.sh $ROLE (Redis: $REDIS_URL)"
    fi
    setup_machine
    install_argus
    case $ROLE in
    redis)
        install_passwords admin agent aggregator viewer
        setup_redis
        setup_aggregator
        setup_viewer
        ;;
    node-*)
        setup_agent
        if ((SIM)); then
            start_sim
        fi
        ;;
    esac
    echo
    echo "done: $ROLE"
}

main "$@"
