"""The Vagrant lab (vagrant/) cannot rot, though no VM boots here.

- vagrant/provision.sh: `bash -n`, shellcheck (where installed); its dry run for every role, run
  without root (as `nobody` when the tests run as root) with a stand-in for every command that
  changes a machine on PATH, none of which may run: scripts/setup.sh first, the deploy/systemd/ files
  it installs exist, every `argus ...` it would run (the units' ExecStart= with the argus.env it
  writes, the simulated job, argus doctor) is accepted by the real command (tests/test_deploy.py's
  helpers), no password on any line, its ACL users the same as docs/deploy.md's.
- vagrant/Vagrantfile: where Ruby is installed, `ruby -c` and an evaluation with a stand-in for
  Vagrant that records what it asks for (and the passwords it makes); everywhere, by regular
  expressions: the three VMs, their addresses, the box, the provisioner's call of provision.sh (run
  here with --dry-run as the provisioner would run it), the secrets kept out of the checkout's sync.
- vagrant/README.md: every `argus ...` in it accepted, the paths it names exist.

Fast, no root, no network.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Sequence, Tuple

import pytest

from tests.helpers import REPO_ROOT, as_nobody, nobody_skip_reason
from tests.test_deploy import (
    DOC,
    ENV_FILE,
    SECRETISH,
    SYSTEMD,
    argus_invocations,
    check_command,
    code_blocks,
    command_path,
    exec_argv,
    opt,
    read_env_file,
    unit_settings,
)

LAB = REPO_ROOT / "vagrant"
PROVISION = LAB / "provision.sh"
VAGRANTFILE = LAB / "Vagrantfile"
README = LAB / "README.md"
SETUP = REPO_ROOT / "scripts" / "setup.sh"

ROLES = ("redis", "node-0", "node-1")
# the Redis users and the password files each role gets (docs/security.md)
PASSWORDS = {"redis": {"admin", "agent", "aggregator", "viewer"}, "node": {"agent"}}
UNIT_OF = {"redis": "argus-aggregate.service", "node": "argus-probe.service"}
# commands that change a machine: in a dry run, none may run (a stand-in on PATH says if one did)
CHANGERS = (
    "apt-get", "dpkg", "systemctl", "systemd-run", "install", "sed", "redis-cli", "redis-server",
    "mount", "ln", "chmod", "chown", "cp", "mv", "rm", "mkdir", "tee", "touch", "python3", "pip",
    "sha256sum", "tr", "cut", "getent", "mktemp", "cat", "id", "useradd", "sudo", "bash", "sh",
)  # fmt: skip
STAND_IN = '#!/bin/sh\necho "$(basename "$0") $*" >> "$STAND_IN_LOG"\nexit 97\n'
FAKE_PASSWORD = "hunter2-{}-do-not-print"


def kind(role: str) -> str:
    return "redis" if role == "redis" else "node"


# --------------------------------------------------------------------------- the dry run


class Step(NamedTuple):
    line: str  # as printed, without "+ "
    words: List[str]  # shlex-split
    content: List[str]  # for `write FILE`: the file's lines


class DryRun(NamedTuple):
    rc: int
    out: str
    err: str
    steps: List[Step]
    ran: List[str]  # the stand-ins that were called (must stay empty)

    def commands(self) -> List[List[str]]:
        return [s.words for s in self.steps if s.words[:1] != ["write"]]

    def written(self) -> Dict[str, List[str]]:
        return {s.words[1]: s.content for s in self.steps if s.words[:1] == ["write"]}


def parse_steps(out: str) -> List[Step]:
    steps: List[Step] = []
    for line in out.splitlines():
        if line.startswith("+ "):
            words = shlex.split(line[2:])
            steps.append(Step(line[2:], words, []))
        elif line.startswith("    ") and steps and steps[-1].words[:1] == ["write"]:
            steps[-1].content.append(line[4:])
    return steps


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Tuple[Path, Path, Path]]:
    """(bin dir of stand-ins, their log, a secrets dir with fake passwords), readable by nobody
    (pytest's tmp_path is under a root-only directory)."""
    with tempfile.TemporaryDirectory(prefix="argus-vagrant-test-") as d:
        top = Path(d)
        top.chmod(0o755)
        bindir, secrets = top / "bin", top / "secrets"
        bindir.mkdir(mode=0o755)
        secrets.mkdir(mode=0o700)  # root-only where the tests run as root: a dry run reads none
        for name in CHANGERS:
            p = bindir / name
            p.write_text(STAND_IN)
            p.chmod(0o755)
        for user in PASSWORDS["redis"]:
            (secrets / f"{user}.pw").write_text(FAKE_PASSWORD.format(user) + "\n")
        log = top / "ran.log"
        log.write_text("")
        log.chmod(0o666)
        yield bindir, log, secrets


@functools.cache
def _can_be_nobody() -> bool:
    return nobody_skip_reason() is None


def dry_run(sandbox: Tuple[Path, Path, Path], *args: str) -> DryRun:
    bindir, log, secrets = sandbox
    log.write_text("")
    cmd = ["/bin/bash", str(PROVISION), "--dry-run", "--secrets", str(secrets), *args]
    if _can_be_nobody():  # root here: show it needs none
        cmd = as_nobody(cmd)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "LC_ALL": "C", "STAND_IN_LOG": str(log), "HOME": "/nonexistent"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/", timeout=30)
    ran = [ln for ln in log.read_text().splitlines() if ln]
    return DryRun(r.returncode, r.stdout, r.stderr, parse_steps(r.stdout), ran)


@pytest.fixture(scope="module")
def runs(sandbox: Tuple[Path, Path, Path]) -> Dict[str, DryRun]:
    out = {}
    for role in ROLES:
        d = dry_run(sandbox, role)
        assert d.rc == 0, f"provision.sh --dry-run {role}: exit {d.rc}\n{d.err}"
        assert not d.ran, f"provision.sh --dry-run {role} ran {d.ran}"
        assert d.steps, d.out
        out[role] = d
    return out


def argus_runs(steps: Sequence[Step]) -> List[List[str]]:
    """The arguments of every argus a step would run: at a command's position (tests/test_deploy.py's
    scanner), or as the program a wrapper such as systemd-run starts."""
    found: List[List[str]] = []
    for s in steps:
        if s.words[:1] == ["write"]:
            continue
        at = [i for i, w in enumerate(s.words) if w == "argus" or w.endswith("/bin/argus")]
        scanned = argus_invocations(s.line)
        if at and not scanned:
            found.append(s.words[at[0] + 1 :])
        found += scanned
    return found


# --------------------------------------------------------------------------- provision.sh


def test_provision_sh_parses() -> None:
    r = subprocess.run(["bash", "-n", str(PROVISION)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert os.access(PROVISION, os.X_OK), "provision.sh is not executable"


def test_provision_sh_passes_shellcheck() -> None:
    tool = shutil.which("shellcheck")
    if tool is None:
        pytest.skip("shellcheck is not installed (bash -n passed)")
    r = subprocess.run([tool, "-x", str(PROVISION)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("role", ROLES)
def test_the_dry_run_runs_setup_sh_first_and_nothing(runs: Dict[str, DryRun], role: str) -> None:
    d = runs[role]
    cmds = d.commands()
    assert cmds[0] == [str(SETUP)], f"{role}: the first step is not scripts/setup.sh: {cmds[0]}"
    assert SETUP.exists()
    assert "dry run, nothing is run" in d.out and d.out.rstrip().endswith(f"done: {role}")
    # then argus into /opt/argus from this checkout, where the units run it from
    assert ["/opt/argus/bin/python", "-m", "pip", "install", "--disable-pip-version-check", "-q",
            str(REPO_ROOT)] in cmds  # fmt: skip
    unit = SYSTEMD / UNIT_OF[kind(role)]
    assert unit_settings(unit)["ExecStart"][0].split()[0] == "/opt/argus/bin/argus"


@pytest.mark.parametrize("role", ROLES)
def test_the_files_it_installs_are_deploy_s(runs: Dict[str, DryRun], role: str) -> None:
    """The deploy/systemd/ files, not units of its own: each installed where docs/deploy.md puts
    it, and the unit enabled and restarted after the last daemon-reload."""
    cmds = runs[role].commands()
    installs = {c[-2]: c[-1] for c in cmds if c[0] == "install" and "-d" not in c}
    from_deploy = {src: dst for src, dst in installs.items() if src.startswith(str(REPO_ROOT))}
    unit = UNIT_OF[kind(role)]
    assert from_deploy == {
        str(SYSTEMD / "argus.env"): "/etc/argus/argus.env",
        str(SYSTEMD / unit): f"/etc/systemd/system/{unit}",
    }, from_deploy
    for src in from_deploy:
        assert Path(src).is_file(), f"{role}: installs {src}, which does not exist"
    i = cmds.index(["systemctl", "daemon-reload"])
    assert cmds.index(["install", "-m", "0644", str(SYSTEMD / unit), f"/etc/systemd/system/{unit}"]) < i
    assert cmds.index(["systemctl", "enable", unit]) > i and cmds.index(["systemctl", "restart", unit]) > i
    other = set(UNIT_OF.values()) - {unit}
    assert not [c for c in cmds if other & set(c)], f"{role} installs {other}"


@pytest.mark.parametrize("role", ROLES)
def test_every_argus_it_would_run_is_accepted(runs: Dict[str, DryRun], role: str) -> None:
    d = runs[role]
    found = argus_runs(d.steps)
    for args in found:
        check_command(args, f"provision.sh --dry-run {role}")
    paths = sorted(command_path(check_command(a, role)) for a in found)
    assert paths == (["argus doctor", "argus sim run"] if kind(role) == "node" else []), paths
    # the unit, as systemd runs it with the argus.env provision.sh writes
    seds = [c for c in d.commands() if c[:2] == ["sed", "-i"] and c[-1] == "/etc/argus/argus.env"]
    assert len(seds) == 1, seds
    m = re.fullmatch(r"s\|\^ARGUS_REDIS_URL=\.\*\|ARGUS_REDIS_URL=(\S+)\|", seds[0][2])
    assert m, seds[0]
    url = m.group(1)
    assert url == f"redis://{vagrant_vms()['redis']}:6379/0"
    env, _ = read_env_file(ENV_FILE.read_text())
    env = {**env, "ARGUS_REDIS_URL": url}
    s = unit_settings(SYSTEMD / UNIT_OF[kind(role)])
    environment = dict(a.split("=", 1) for line in s.get("Environment", []) for a in shlex.split(line))
    ctx = check_command(exec_argv(s["ExecStart"][0], {**environment, **env})[1:], f"{role}'s unit")
    assert opt(ctx, "--redis") == url


@pytest.mark.parametrize("role", ROLES)
def test_no_password_on_any_line_it_prints(runs: Dict[str, DryRun], role: str) -> None:
    d = runs[role]
    for user in PASSWORDS["redis"]:
        assert FAKE_PASSWORD.format(user) not in d.out + d.err
    for s in d.steps:
        if s.words[:1] == ["write"]:
            continue
        assert not SECRETISH.search(s.line), f"{role}: something like a secret on a command line: {s.line}"
        if "redis-cli" in s.words:  # its password in its environment, from the root-only file
            assert not {"-a", "--pass", "--askpass"} & set(s.words), s.line
            assert re.search(r'REDISCLI_AUTH="\$\(cat /etc/argus/\w+\.pw\)"', s.line), s.line
    # each role gets the passwords it needs, as root-only files, and no other
    cmds = d.commands()
    pw = [c for c in cmds if c[0] == "install" and c[-1].endswith(".pw") and c[-1].startswith("/etc/argus/")]
    assert {Path(c[-1]).stem for c in pw} == PASSWORDS[kind(role)], pw
    for c in pw:
        assert c[1:7] == ["-m", "0600", "-o", "root", "-g", "root"], c
    for other in PASSWORDS["redis"] - PASSWORDS[kind(role)]:
        assert f"{other}.pw" not in d.out, f"{role} is given {other}.pw"


def _acl_users(lines: Sequence[str]) -> Dict[str, Tuple[str, str]]:
    """user -> (on|off, rules) from ACL file lines; the password hash's placeholder names the user's
    own password file (docs: `#$(h agent)`; provision.sh's dry run: `#<sha256 of .../agent.pw>`)."""
    users = {}
    for line in lines:
        m = re.fullmatch(
            r"\s*user (\S+) (on|off)(?: #(?:\$\(h (\w+)\)|<sha256 of /etc/argus/(\w+)\.pw>))?(.*)", line
        )
        if m:
            name, state, pw = m.group(1), m.group(2), m.group(3) or m.group(4)
            assert pw is None or name == f"argus-{pw}", f"{name} gets the hash of {pw}.pw"
            users[name] = (state, m.group(5).strip())
    return users


def test_the_redis_vm_has_docs_deploy_md_s_users_on_its_address(runs: Dict[str, DryRun]) -> None:
    d = runs["redis"]
    acl = d.written()["/etc/redis/users.acl"]
    assert acl, "no /etc/redis/users.acl"
    docs = _acl_users([ln for block in code_blocks(DOC.read_text()) for ln in block.splitlines()])
    assert set(docs) == {"default", "argus-admin", "argus-agent", "argus-aggregator", "argus-viewer"}, docs
    assert _acl_users(acl) == docs, "provision.sh's ACL users differ from docs/deploy.md's"
    assert re.search(r"\+ write /etc/redis/users\.acl \(mode 0640, owner redis:redis\)", d.out)
    ip = vagrant_vms()["redis"]
    cmds = d.commands()
    conf = [c for c in cmds if c[-1] == "/etc/redis/redis.conf"]
    assert conf and f"s/^bind .*/bind 127.0.0.1 -::1 {ip}/" in conf[0], conf
    assert "$a aclfile /etc/redis/users.acl" in conf[0]
    assert cmds.index(["systemctl", "enable", "redis-server"]) < cmds.index(
        ["systemctl", "restart", "redis-server"]
    )
    assert any(f"-h {ip} --user argus-viewer PING" in s.line for s in d.steps), "no check over the address"
    # the viewer for the lab's user: the password root-only to that user, the user from a profile
    assert ["install", "-m", "0600", "-o", "vagrant", "-g", "vagrant", "/etc/argus/viewer.pw",
            "/home/vagrant/.config/argus/viewer.pw"] in cmds  # fmt: skip
    profile = "\n".join(d.written()["/etc/profile.d/argus-lab.sh"])
    assert "ARGUS_REDIS_USERNAME=argus-viewer" in profile and "ARGUS_REDIS_PASSWORD_FILE=" in profile


@pytest.mark.parametrize("role", ["node-0", "node-1"])
def test_each_node_runs_a_job_of_its_own_node_1_s_with_a_straggler(
    runs: Dict[str, DryRun], role: str
) -> None:
    d = runs[role]
    (sim,) = [c for c in d.commands() if c[0] == "systemd-run"]
    assert "--uid=vagrant" in sim, f"the simulated job runs as root: {sim}"
    assert "--unit=argus-lab-sim" in sim
    ctx = check_command(sim[sim.index("/opt/argus/bin/argus") + 1 :], role)
    assert command_path(ctx) == "argus sim run"
    assert opt(ctx, "--ranks") == 4  # one host's worth: the job cannot span VMs (shared memory)
    injects = list(opt(ctx, "--inject"))  # type: ignore[call-overload]
    if role == "node-1":
        assert injects == ["straggler:rank=2,factor=1.5,from_step=300"], injects
    else:
        assert injects == [], injects
    # after the agent is up (it would take the job anyway, but its first steps are seen this way)
    cmds = d.commands()
    assert cmds.index(["systemctl", "restart", "argus-probe.service"]) < cmds.index(sim)


def test_no_sim_and_a_bad_role_or_option(sandbox: Tuple[Path, Path, Path]) -> None:
    d = dry_run(sandbox, "--no-sim", "node-0")
    assert d.rc == 0 and not d.ran, d.err
    assert not [c for c in d.commands() if c[0] == "systemd-run"]
    for args, said in [
        (["node-x"], "unknown ROLE"),
        (["redis", "node-0"], "one ROLE only"),
        ([], "no ROLE"),
        (["--frobnicate", "redis"], "unknown option"),
        (["--redis-ip"], "needs a value"),
        (["--redis-ip", "10.0.0.5; reboot", "redis"], "no IPv4 address"),
        (["--user", "root;x", "node-0"], "no user name"),
    ]:
        d = dry_run(sandbox, *args)
        assert d.rc == 2 and said in d.err and not d.steps and not d.ran, (args, d.rc, d.err, d.out)


# --------------------------------------------------------------------------- the Vagrantfile


def _ruby_constant(text: str, name: str) -> str:
    m = re.search(rf'^{name} = "([^"]*)"', text, flags=re.M)
    assert m, f'Vagrantfile: no {name} = "..."'
    return m.group(1)


def vagrant_vms() -> Dict[str, str]:
    """VMS = { "name" => "address", ... } of the Vagrantfile, in its order."""
    text = VAGRANTFILE.read_text()
    m = re.search(r"^VMS = \{\n(.*?)^\}", text, flags=re.M | re.S)
    assert m, "Vagrantfile: no VMS = { ... }"
    entries = re.findall(r'^\s*"([\w-]+)" => "([\d.]+)",?\s*$', m.group(1), flags=re.M)
    assert len(entries) == len(m.group(1).strip().splitlines()), f"unparsed lines in VMS: {m.group(1)}"
    return dict(entries)


def test_the_vagrantfile_is_ruby() -> None:
    ruby = shutil.which("ruby")
    if ruby is None:
        pytest.skip("ruby is not installed: the Vagrantfile is checked by regular expressions only")
    r = subprocess.run([ruby, "-c", str(VAGRANTFILE)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "Syntax OK" in r.stdout, r.stdout + r.stderr


# A stand-in for Vagrant: Vagrant.configure yields an object that records every call made on it
# (and on what those calls return or yield), printed as JSON lines [path, args, keywords].
STAND_IN_VAGRANT = r"""
require "json"
class Rec
  def initialize(path, log)
    @path = path
    @log = log
  end

  def method_missing(name, *args, **kw, &blk)
    full = "#{@path}.#{name}"
    if name.to_s.end_with?("=")
      @log << [full, args, {}]
      return
    end
    @log << [full, args, kw] unless name == :vm
    blk&.call(Rec.new("#{full}(#{args.first})", @log))
    Rec.new(full, @log)
  end

  def respond_to_missing?(*)
    true
  end
end

module Vagrant
  LOG = []
  def self.configure(_version)
    yield Rec.new("config", LOG)
  end
end

load ARGV[0]
Vagrant::LOG.each { |e| puts JSON.generate(e) }
"""


def test_the_vagrantfile_run_by_ruby_with_a_stand_in_vagrant(tmp_path: Path) -> None:
    """What the Vagrantfile asks of Vagrant, as Ruby evaluates it (in a copy: the passwords it
    makes land in tmp_path)."""
    ruby = shutil.which("ruby")
    if ruby is None:
        pytest.skip("ruby is not installed: the Vagrantfile is checked by regular expressions only")
    (tmp_path / "vagrant").mkdir()
    copy = tmp_path / "vagrant" / "Vagrantfile"
    shutil.copy(VAGRANTFILE, copy)
    (tmp_path / "harness.rb").write_text(STAND_IN_VAGRANT)
    r = subprocess.run([ruby, str(tmp_path / "harness.rb"), str(copy)], capture_output=True, text=True,
                       timeout=30, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    calls = [json.loads(line) for line in r.stdout.splitlines()]
    assert ["config.vm.box=", ["debian/bookworm64"], {}] in calls
    defined = [c[1][0] for c in calls if c[0] == "config.vm.define"]
    assert defined == list(ROLES)
    secrets = tmp_path / "vagrant" / ".secrets"
    for name in ROLES:
        at = f"config.vm.define({name}).vm."
        assert [at + "hostname=", [name], {}] in calls
        assert [at + "network", ["private_network"], {"ip": vagrant_vms()[name]}] in calls
        (prov,) = [c for c in calls if c[0] == at + "provision"]
        assert shlex.split(prov[2]["inline"]) == vagrant_provision_argv(name)
        (folder,) = [c for c in calls if c[0] == at + "synced_folder"]
        assert folder[1] == [str(secrets / kind(name)), "/etc/argus/lab-secrets"], folder
        assert folder[2]["owner"] == "root" and "--chmod=D0700,F0600" in folder[2]["rsync__args"]
    # the passwords it made: 0600 in 0700 directories; the nodes' only the agent's, the same one
    assert sorted(p.name for p in (secrets / "redis").iterdir()) == sorted(
        f"{u}.pw" for u in PASSWORDS["redis"]
    )
    assert [p.name for p in (secrets / "node").iterdir()] == ["agent.pw"]
    for p in [secrets, *secrets.iterdir()]:
        assert p.stat().st_mode & 0o777 == 0o700, p
    for p in secrets.glob("*/*.pw"):
        assert p.stat().st_mode & 0o777 == 0o600 and len(p.read_text().strip()) == 48, p
    assert (secrets / "node" / "agent.pw").read_text() == (secrets / "redis" / "agent.pw").read_text()
    # evaluated again (Vagrant reads it on every command): the same passwords
    before = {p: p.read_text() for p in secrets.glob("*/*.pw")}
    r = subprocess.run([ruby, str(tmp_path / "harness.rb"), str(copy)], capture_output=True, text=True,
                       timeout=30, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0 and before == {p: p.read_text() for p in secrets.glob("*/*.pw")}


def test_the_vagrantfile_s_three_vms() -> None:
    text = VAGRANTFILE.read_text()
    vms = vagrant_vms()
    assert list(vms) == list(ROLES), f"VMs {list(vms)}: redis first (VirtualBox brings them up in order)"
    nets = {ipaddress.ip_interface(f"{ip}/24").network for ip in vms.values()}
    assert len(set(vms.values())) == 3 and len(nets) == 1, vms
    assert all(ipaddress.ip_address(ip).is_private for ip in vms.values()), vms
    assert _ruby_constant(text, "BOX") == "debian/bookworm64"
    assert re.search(r'^REDIS_IP = VMS\.fetch\("redis"\)$', text, flags=re.M)
    assert re.search(r"VMS\.each do \|name, ip\|\n\s*config\.vm\.define name do \|vm\|", text)
    assert re.search(r'vm\.vm\.hostname = name\n\s*vm\.vm\.network "private_network", ip: ip\n', text)


def vagrant_provision_argv(name: str) -> List[str]:
    """The provisioner's command line for VM `name`, with the Vagrantfile's constants filled in."""
    text = VAGRANTFILE.read_text()
    calls = re.findall(r'vm\.vm\.provision "shell",.*?inline: "([^"]*)"', text, flags=re.S)
    assert len(calls) == 1, f"one shell provisioner expected: {calls}"
    values = {
        "SRC": _ruby_constant(text, "SRC"),
        "SECRETS_IN_VM": _ruby_constant(text, "SECRETS_IN_VM"),
        "REDIS_IP": vagrant_vms()["redis"],
        "name": name,
    }
    line = re.sub(r"#\{(\w+)\}", lambda m: values[m.group(1)], calls[0])
    assert "#{" not in line, line
    return shlex.split(line)


@pytest.mark.parametrize("name", ROLES)
def test_each_vm_runs_provision_sh_with_its_name_as_a_role_it_accepts(
    sandbox: Tuple[Path, Path, Path], name: str
) -> None:
    argv = vagrant_provision_argv(name)
    text = VAGRANTFILE.read_text()
    src = _ruby_constant(text, "SRC")
    assert argv[:2] == ["bash", f"{src}/vagrant/provision.sh"], argv
    assert argv[-1] == name and "--dry-run" not in argv
    i = argv.index("--redis-ip")
    assert argv[i + 1] == vagrant_vms()["redis"]
    # what the VM would run, here with --dry-run (and the test's stand-in secrets directory)
    args = argv[2:]
    j = args.index("--secrets")
    assert args[j + 1] == _ruby_constant(text, "SECRETS_IN_VM")
    d = dry_run(sandbox, *args[:j], *args[j + 2 :])
    assert d.rc == 0 and not d.ran, d.err
    assert d.out.rstrip().endswith(f"done: {name}")
    assert f"Redis: redis://{vagrant_vms()['redis']}:6379/0" in d.out


def test_the_vagrantfile_syncs_the_checkout_without_secrets_and_each_vm_only_its_own() -> None:
    text = VAGRANTFILE.read_text()
    src, secrets_in_vm = _ruby_constant(text, "SRC"), _ruby_constant(text, "SECRETS_IN_VM")
    assert 'config.vm.synced_folder ".", "/vagrant", disabled: true' in text, (
        "vagrant/ (with .secrets/) synced"
    )
    m = re.search(
        r'config\.vm\.synced_folder "\.\.", SRC, type: "rsync",\s*rsync__exclude: \[([^\]]*)\]', text
    )
    assert m, "the checkout is not synced to SRC by rsync"
    excluded = set(re.findall(r'"([^"]*)"', m.group(1)))
    assert {".git/", ".venv/", ".secrets/"} <= excluded, excluded
    assert src == "/opt/argus-src"
    # the secrets: the redis VM's directory or the nodes' (only the agent's password), root-only
    m = re.search(
        r'vm\.vm\.synced_folder File\.join\(SECRETS, name == "redis" \? "redis" : "node"\), SECRETS_IN_VM,'
        r"(.*?\])\n",
        text,
        flags=re.S,
    )
    assert m, "the secrets are not synced per role"
    options = " ".join(m.group(1).split())
    for want in ('type: "rsync"', 'owner: "root"', 'group: "root"', '"--chmod=D0700,F0600"'):
        assert want in options, f"the secrets' synced folder: no {want} in {options}"
    assert secrets_in_vm.startswith("/etc/argus/")
    users = re.search(r"^USERS = %w\[([^\]]*)\]", text, flags=re.M)
    assert users and set(users.group(1).split()) == PASSWORDS["redis"], "the Redis users' passwords"
    assert re.search(
        r'FileUtils\.install\(File\.join\(SECRETS, "redis", "agent\.pw"\), File\.join\(SECRETS, "node"\)',
        text,
    )
    assert re.search(r"File::EXCL, 0o600", text) and "SecureRandom.hex(24)" in text
    ignored = (LAB / ".gitignore").read_text().split()
    assert ".secrets/" in ignored and ".vagrant/" in ignored


# --------------------------------------------------------------------------- README


def test_the_readme_s_argus_commands_and_paths() -> None:
    text = README.read_text()
    found = [args for block in code_blocks(text) for args in argus_invocations(block)]
    paths = set()
    for args in found:
        paths.add(command_path(check_command(args, "vagrant/README.md")))
    assert {"argus alerts", "argus top", "argus sim run"} <= paths, paths
    for ref in re.findall(r"(?<![\w/])(?:deploy|scripts|docs|tests)/[\w./-]*[\w/]", text):
        assert (REPO_ROOT / ref).exists(), f"vagrant/README.md names {ref}, which does not exist"
    for name, ip in vagrant_vms().items():
        assert re.search(rf"^\| `{re.escape(name)}` \| {re.escape(ip)} \|", text, flags=re.M), (name, ip)
    assert "nothing here has been booted" in text.lower()
    assert "vagrant/README.md" in DOC.read_text(), "docs/deploy.md does not link the lab"
