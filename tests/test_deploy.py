"""The deployment recipes (deploy/, docs/deploy.md) cannot rot: what they run is what argus accepts.

- Every `argus ...` command line in them is parsed by the real click command (`make_context`), so
  an option that is renamed or removed fails here: the systemd units' `ExecStart=` with the values
  of deploy/systemd/argus.env and of each example commented in it, the Kubernetes containers'
  commands, the command line the Slurm prolog really builds (run with a stand-in `argus`), and the
  shell code blocks of docs/deploy.md and deploy/**/*.md, the Containerfile's `argus` lines.
- No password on any command line, and every Redis URL passes argus's own parser (which refuses a
  URL with a password).
- The Kubernetes manifests: the kinds, hostPID, read-only root file systems, the capabilities
  argus/agent/privs.py keeps, the Redis password as a Secret file named by
  ARGUS_REDIS_PASSWORD_FILE; the aggregator non-root.
- systemd-analyze verify on the units (where it runs), the epilog stops the prolog's agent and
  nothing else, agent-init.py waits for the keeper, shellcheck (where installed).

Fast, no root, no network.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import click
import pytest

from argus import cli as argus_cli
from argus import redisconf
from argus.agent import privs
from tests.helpers import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
DOC = REPO_ROOT / "docs" / "deploy.md"
SYSTEMD = DEPLOY / "systemd"
ENV_FILE = SYSTEMD / "argus.env"
K8S = DEPLOY / "k8s"
SLURM = DEPLOY / "slurm"
PROLOG, EPILOG = SLURM / "argus-prolog.sh", SLURM / "argus-epilog.sh"
CONTAINERFILE = DEPLOY / "Containerfile"
AGENT_INIT = K8S / "agent-init.py"

JOB_ID = "4242"
# what a placeholder stands for when a recipe is checked
DUMMY = {"SLURM_JOB_ID": JOB_ID, "ARGUS_REDIS_URL": "redis://10.0.0.5:6379/0", "NODE_NAME": "gpu-node-1"}
SECRETISH = re.compile(r"(?i)(passw(or)?d|secret|token)\s*=|--pass(word)?\b|\bAUTH\b")


# --------------------------------------------------------------------------- the real commands


def _rest(ctx: click.Context) -> List[str]:
    """A group's arguments left after its own options (the subcommand and its arguments)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # click 8.2 deprecates protected_args
        protected = list(getattr(ctx, "protected_args", []))
    return [*protected, *ctx.args]


def parse_argus(args: Sequence[str], where: str) -> Optional[click.Context]:
    """Parse `argus ARGS...` with the real commands: the innermost command's context (None for
    `--help`/`--version`). Fails the test, naming `where`, on an unknown command or option, a
    missing required option or a bad value."""
    shown = shlex.join(["argus", *args])
    cmd: click.Command = argus_cli.cli
    name, rest = "argus", list(args)
    try:
        while True:
            ctx = cmd.make_context(name, rest)
            if not isinstance(cmd, click.Group):
                return ctx
            rest = _rest(ctx)
            if not rest:
                return ctx
            sub_name, sub, rest = cmd.resolve_command(ctx, rest)
            assert sub is not None and sub_name is not None
            # an unimportable module's stand-in accepts any arguments: that would check nothing
            assert sub_name not in argus_cli.UNAVAILABLE, (
                f"{where}: argus {sub_name} is unavailable here: {argus_cli.UNAVAILABLE[sub_name]}"
            )
            cmd, name = sub, f"{name} {sub_name}"
    except click.exceptions.Exit:  # --help, --version
        return None
    except click.ClickException as e:
        pytest.fail(f"{where}: `{shown}` is refused by {name}: {e.format_message()}")


def opt(ctx: Optional[click.Context], flag: str) -> object:
    """The value of option `flag` (as the recipes spell it) in a parsed command line."""
    assert ctx is not None, f"no command parsed for {flag}"
    for p in ctx.command.params:
        if flag in p.opts:
            return ctx.params[p.name]  # type: ignore[index]
    raise KeyError(f"{ctx.command_path} has no option {flag}")


def check_no_secret(args: Sequence[str], ctx: Optional[click.Context], where: str) -> None:
    """No password on the command line: none in an argument, none in a Redis URL (argus's parser
    refuses a URL with a password, as the agent and aggregator would at start)."""
    for a in args:
        assert not SECRETISH.search(a), f"{where}: something like a secret on the command line: {a!r}"
    has_redis = ctx is not None and any("--redis" in p.opts for p in ctx.command.params)
    url = opt(ctx, "--redis") if has_redis else None
    if isinstance(url, str):
        redisconf.parse(url, env={})  # raises UsageError for a password in the URL, a bad scheme


def check_command(args: Sequence[str], where: str) -> Optional[click.Context]:
    ctx = parse_argus(args, where)
    check_no_secret(args, ctx, where)
    return ctx


def command_path(ctx: Optional[click.Context]) -> str:
    return ctx.command_path if ctx is not None else "argus"


# --------------------------------------------------------------------------- shell text


WRAPPERS = {"sudo", "env", "exec", "setsid", "nohup", "time", "command"}
PUNCT = set("();<>|&")


def substitute(text: str, values: Dict[str, str]) -> str:
    """Placeholders to dummy values: ${VAR...}, $VAR, $(VAR) (Kubernetes) and $(command) ("x")."""
    text = re.sub(r"\$\{(\w+)[^}]*\}", lambda m: values.get(m.group(1), "x"), text)
    text = re.sub(r"\$\(([A-Z_][A-Z0-9_]*)\)", lambda m: values.get(m.group(1), "x"), text)
    text = re.sub(r"\$\([^()]*\)", "x", text)
    return re.sub(r"\$([A-Za-z_]\w*)", lambda m: values.get(m.group(1), "x"), text)


def argus_invocations(text: str) -> List[List[str]]:
    """The arguments of every `argus` run in shell text (at a command's position: after `sudo`,
    `env`, assignments, `|`, `&&`, `;`; the executable named argus or .../argus)."""
    text = substitute(text, DUMMY).replace("\\\n", " ")
    text = re.sub(r"(?<=\s)\d+(?=[<>])", "", text)  # `2>file`: the fd is no argument
    found = []
    for line in text.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        try:
            tokens = list(lex)
        except ValueError:  # an unbalanced quote: not a command line (heredoc text)
            continue
        at_command, i = True, 0
        while i < len(tokens):
            t = tokens[i]
            if set(t) <= PUNCT:
                at_command = t[0] not in "<>"
                if not at_command:
                    i += 1  # the redirection's target
                i += 1
                continue
            if at_command and re.fullmatch(r"[A-Za-z_]\w*=.*", t):
                i += 1
                continue
            if at_command and t in WRAPPERS:
                i += 1
                while i < len(tokens) and tokens[i].startswith("-"):
                    i += 1
                continue
            if at_command and (t == "argus" or t.endswith("/bin/argus")):
                j = i + 1
                while j < len(tokens) and not set(tokens[j]) <= PUNCT:
                    j += 1
                found.append(tokens[i + 1 : j])
                i = j
                continue
            at_command = False
            i += 1
    return found


def code_blocks(markdown: str) -> Iterator[str]:
    yield from re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.S | re.M)


def test_the_shell_scanner_finds_argus_where_it_runs() -> None:
    """The extraction itself: argus at a command's position, through sudo/env/assignments, with
    redirections and pipes cut off; not `kubectl -n argus ...` nor `cd argus`."""
    text = (
        "sudo ARGUS_X=1 /opt/argus/bin/argus probe --all --wait --redis redis://h:6379/0 2>>log &\n"
        "kubectl -n argus logs daemonset/argus-agent -f\n"
        "cd argus && argus top --job $SLURM_JOB_ID --once | head  # a comment\n"
        'setsid "$ARGUS" doctor --json > out.json\n'
        "/opt/argus/bin/argus sim run \\\n  --ranks 4\n"
    )
    assert argus_invocations(text) == [
        ["probe", "--all", "--wait", "--redis", "redis://h:6379/0"],
        ["top", "--job", JOB_ID, "--once"],
        ["sim", "run", "--ranks", "4"],
    ]


def test_a_wrong_option_or_command_fails_the_check() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"(?i)no such option"):
        parse_argus(["probe", "--all", "--no-such-flag"], "self-test")
    with pytest.raises(pytest.fail.Exception, match="No such command"):
        parse_argus(["agregate", "--redis", "redis://h:6379/0"], "self-test")
    with pytest.raises(pytest.fail.Exception, match="--redis"):
        parse_argus(["aggregate"], "self-test")  # a required option missing
    with pytest.raises(redisconf.UsageError):
        check_command(["top", "--redis", "redis://user:hunter2@h:6379/0"], "self-test")
    assert command_path(parse_argus(["sim", "run", "--ranks", "4"], "self-test")) == "argus sim run"


def _markdown_files() -> List[Path]:
    return [DOC, *sorted(DEPLOY.rglob("*.md"))]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_argus_command_in_the_docs_code_blocks_is_accepted(path: Path) -> None:
    found = [args for block in code_blocks(path.read_text()) for args in argus_invocations(block)]
    for args in found:
        check_command(args, str(path.relative_to(REPO_ROOT)))
    if path == DOC:  # the extraction must not go blind: the page runs these
        paths = {command_path(parse_argus(a, "docs/deploy.md")) for a in found}
        assert {"argus doctor", "argus sim run", "argus top", "argus alerts", "argus probe"} <= paths, paths


def test_the_containerfile_runs_argus_as_it_is() -> None:
    text = CONTAINERFILE.read_text()
    runs = argus_invocations(text)
    cmd = re.search(r"^CMD\s+(\[.*\])\s*$", text, flags=re.M)
    assert cmd, "no CMD in deploy/Containerfile"
    argv = json.loads(cmd.group(1))
    assert Path(argv[0]).name == "argus", argv
    runs.append(argv[1:])
    assert len(runs) >= 2, runs
    for args in runs:
        check_command(args, "deploy/Containerfile")
    # the agent's first process and the venv the manifests and units run from are what it installs
    copy = re.search(r"^COPY\s+deploy/k8s/agent-init\.py\s+(\S+)", text, flags=re.M)
    assert copy and copy.group(1) == "/usr/local/bin/argus-agent-init", "agent-init.py not installed"
    assert re.search(r"venv --system-site-packages /opt/argus\b", text), "no venv at /opt/argus"
    assert "python3-bpfcc" in text and "debian:12" in text


def test_every_deploy_path_the_docs_name_exists_and_every_recipe_is_documented() -> None:
    docs = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")), *_markdown_files()]
    for doc in docs:
        for ref in re.findall(r"(?<![\w/])deploy/[\w./-]*[\w/]", doc.read_text()):
            assert (REPO_ROOT / ref).exists(), (
                f"{doc.relative_to(REPO_ROOT)} names {ref}, which does not exist"
            )
    page, k8s_readme = DOC.read_text(), (K8S / "README.md").read_text()
    for f in [*SYSTEMD.iterdir(), *SLURM.iterdir(), CONTAINERFILE]:
        assert f.name in page, f"docs/deploy.md does not mention deploy/.../{f.name}"
    for f in K8S.iterdir():
        if f.name != "README.md":
            assert f.name in k8s_readme, f"deploy/k8s/README.md does not mention {f.name}"


# --------------------------------------------------------------------------- systemd


def read_env_file(text: str) -> Tuple[Dict[str, str], List[Tuple[str, str]]]:
    """KEY=value lines as systemd (and a shell) read them; and the commented examples `#KEY=value`."""

    def value(v: str) -> str:
        v = v.strip()
        return v[1:-1] if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'" else v

    env: Dict[str, str] = {}
    examples: List[Tuple[str, str]] = []
    for line in text.splitlines():
        if m := re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(.*)", line.strip()):
            env[m.group(1)] = value(m.group(2))
        elif m := re.fullmatch(r"#([A-Z_][A-Z0-9_]*)=(.*)", line.strip()):
            examples.append((m.group(1), value(m.group(2))))
    return env, examples


def env_variants() -> List[Dict[str, str]]:
    """argus.env as shipped, then with each commented example set in its place."""
    env, examples = read_env_file(ENV_FILE.read_text())
    assert env.get("ARGUS_REDIS_URL"), "argus.env sets no ARGUS_REDIS_URL"
    return [env, *({**env, k: v} for k, v in examples)]


def unit_settings(path: Path) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for line in path.read_text().splitlines():
        if m := re.fullmatch(r"([A-Za-z]+)=(.*)", line.strip()):
            out.setdefault(m.group(1), []).append(m.group(2))
    return out


def exec_argv(value: str, env: Dict[str, str]) -> List[str]:
    """ExecStart= as systemd expands it: ${VAR} is one word, a lone $VAR is split at whitespace."""
    argv: List[str] = []
    for word in shlex.split(value):
        if m := re.fullmatch(r"\$(\w+)", word):
            argv += env.get(m.group(1), "").split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return argv


UNITS = {"argus-probe.service": "argus probe", "argus-aggregate.service": "argus aggregate"}


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_each_unit_runs_an_accepted_command_with_its_password_from_a_file(unit: str) -> None:
    path = SYSTEMD / unit
    s = unit_settings(path)
    assert len(s.get("ExecStart", [])) == 1, f"{unit}: one ExecStart expected"
    environment = dict(a.split("=", 1) for line in s.get("Environment", []) for a in shlex.split(line))
    assert "ARGUS_REDIS_PASSWORD" not in environment, f"{unit}: a password in the unit"
    assert environment.get("ARGUS_REDIS_PASSWORD_FILE"), f"{unit}: no ARGUS_REDIS_PASSWORD_FILE"
    assert environment.get("ARGUS_REDIS_USERNAME"), f"{unit}: no ACL user"
    assert s.get("EnvironmentFile") == ["/etc/argus/argus.env"]
    for variant in env_variants():
        argv = exec_argv(s["ExecStart"][0], {**environment, **variant})
        assert argv[0] == "/opt/argus/bin/argus", argv
        ctx = check_command(argv[1:], f"{unit} ExecStart with {variant}")
        assert command_path(ctx) == UNITS[unit]
        assert opt(ctx, "--redis") == variant["ARGUS_REDIS_URL"]
        if unit == "argus-probe.service":
            assert opt(ctx, "--all") and opt(ctx, "--wait"), "a per-host agent must wait for ranks"


def test_the_agent_unit_keeps_what_the_agent_needs() -> None:
    s = unit_settings(SYSTEMD / "argus-probe.service")
    bounding = set(s["CapabilityBoundingSet"][0].split())
    kept = {privs.NAMES[c] for c in privs.kept(kernel_stacks=True)}
    assert kept | {"CAP_SETPCAP"} <= bounding, f"the agent keeps {kept} and drops with CAP_SETPCAP"
    assert s.get("User") == ["root"]
    assert int(s["TimeoutStopSec"][0]) >= 60, "the keeper needs time to remove the uprobes"
    # each of these breaks the agent (the unit's comments say how): they must not creep in
    for breaks in ("ProtectKernelModules", "ProtectKernelLogs", "PrivateDevices", "ProtectKernelTunables"):
        assert breaks not in s, f"argus-probe.service: {breaks}= breaks the agent"
    # the rank table every interval would fill the journal
    assert "--quiet" in s["ExecStart"][0].split() or s.get("StandardOutput") == ["null"], s["ExecStart"]


def test_the_aggregator_unit_has_no_privilege() -> None:
    s = unit_settings(SYSTEMD / "argus-aggregate.service")
    assert s.get("DynamicUser") == ["yes"] or s.get("User", ["root"]) != ["root"]
    assert s.get("CapabilityBoundingSet") == [""]
    assert s.get("NoNewPrivileges") == ["yes"]


def _argus_for_units() -> str:
    here = Path(sys.executable).with_name("argus")
    return str(here) if here.exists() else shutil.which("argus") or "/bin/true"


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    # verify also checks that ExecStart's program exists: point it at this venv's argus
    copy = tmp_path / unit
    copy.write_text((SYSTEMD / unit).read_text().replace("/opt/argus/bin/argus", _argus_for_units()))
    try:
        r = subprocess.run(
            [tool, "verify", "--man=no", "--generators=no", str(copy)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"systemd-analyze verify unusable here: {e}")
    said = (r.stdout + r.stderr).strip()
    about_unit = [ln for ln in said.splitlines() if unit in ln or "Unknown" in ln or "nvalid" in ln]
    assert not about_unit, f"systemd-analyze verify {unit}:\n" + "\n".join(about_unit)
    if r.returncode != 0:
        pytest.skip(f"systemd-analyze verify unusable here (exit {r.returncode}): {said[:300]}")


# --------------------------------------------------------------------------- Kubernetes


def _manifests() -> Dict[str, dict]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: the manifests are not checked")
    docs: Dict[str, dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[f"{doc['kind']}/{doc['metadata']['name']}" if "metadata" in doc else doc["kind"]] = doc
    return docs


def _container_env(container: dict, config: Dict[str, str]) -> Dict[str, str]:
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            env[e["name"]] = config[e["valueFrom"]["configMapKeyRef"]["key"]]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = DUMMY.get(e["name"], "x")
        else:
            env[e["name"]] = "<from " + ",".join(e.get("valueFrom", {})) + ">"
    return env


def _argv(container: dict, env: Dict[str, str]) -> List[str]:
    """command + args with $(VAR) expanded as the kubelet does; from the argus executable on."""
    words = [*container.get("command", []), *container.get("args", [])]
    words = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(w)) for w in words]
    at = [i for i, w in enumerate(words) if Path(w).name == "argus"]
    assert at, f"no argus in {words}"
    return words[at[0] + 1 :]


def _secret_file(spec: dict, container: dict, env: Dict[str, str], where: str) -> dict:
    """The Secret volume ARGUS_REDIS_PASSWORD_FILE points into; fails unless there is one."""
    path = env.get("ARGUS_REDIS_PASSWORD_FILE")
    assert path, f"{where}: no ARGUS_REDIS_PASSWORD_FILE"
    assert "ARGUS_REDIS_PASSWORD" not in env, f"{where}: the password in the environment, not a file"
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        vol = volumes[m["name"]]
        if "secret" in vol and path.startswith(m["mountPath"].rstrip("/") + "/"):
            name = path[len(m["mountPath"].rstrip("/")) + 1 :]
            items = vol["secret"].get("items")
            assert items is None or name in [i["path"] for i in items], f"{where}: {path} is no item"
            assert m.get("readOnly"), f"{where}: the Secret is mounted writable"
            return vol
    pytest.fail(f"{where}: ARGUS_REDIS_PASSWORD_FILE={path} is not in a mounted Secret")


def test_kubernetes_manifests_parse_and_have_the_kinds() -> None:
    docs = _manifests()
    kinds = sorted(d["kind"] for d in docs.values())
    assert kinds == ["ConfigMap", "DaemonSet", "Deployment", "Kustomization", "Namespace"], kinds
    kust = docs["Kustomization"]
    assert sorted(kust["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
    )
    images = {
        c["image"].split(":")[0]
        for d in docs.values()
        if d["kind"] in ("DaemonSet", "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert images == {i["name"] for i in kust["images"]}, images


def test_the_agent_daemonset() -> None:
    docs = _manifests()
    config = docs["ConfigMap/argus-config"]["data"]
    ds = docs["DaemonSet/argus-agent"]
    spec = ds["spec"]["template"]["spec"]
    assert spec.get("hostPID") is True, "the agent must see the training processes' host pids"
    assert spec.get("terminationGracePeriodSeconds", 30) >= 60, "the keeper needs time to remove uprobes"
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc.get("readOnlyRootFilesystem") is True
    env = _container_env(c, config)
    argv = _argv(c, env)
    ctx = check_command(argv, "agent DaemonSet")
    assert command_path(ctx) == "argus probe"
    assert opt(ctx, "--all") and opt(ctx, "--wait") and opt(ctx, "--redis") == config["ARGUS_REDIS_URL"]
    assert opt(ctx, "--host") == DUMMY["NODE_NAME"], "in a pod the host name is the pod's: pass the node's"
    # its first process waits for the keeper (agent-init.py), installed there by the Containerfile
    assert c["command"][0] == "/usr/local/bin/argus-agent-init"
    vol = _secret_file(spec, c, env, "agent DaemonSet")
    assert vol["secret"].get("defaultMode") == 0o400, "the agent's password file: root-only"
    if not sc.get("privileged"):
        added = {f"CAP_{n}" for n in sc["capabilities"]["add"]}
        kept = {privs.NAMES[c] for c in privs.kept(kernel_stacks=True)}
        assert kept | {"CAP_SETPCAP"} <= added, f"missing {sorted(kept | {'CAP_SETPCAP'} - added)}"
        assert sc["capabilities"].get("drop") == ["ALL"]
        assert sc.get("allowPrivilegeEscalation") is not False, "Kubernetes refuses it with SYS_ADMIN"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]], "the agent writes temporary files"
    host = {p: volumes[m["name"]].get("hostPath", {}).get("path") for p, m in mounts.items()}
    assert host.get("/sys/kernel/tracing") == "/sys/kernel/tracing" or host.get("/sys/kernel/debug")
    assert host.get("/lib/modules") == "/lib/modules" and host.get("/usr/src") == "/usr/src"


def test_the_aggregator_deployment() -> None:
    docs = _manifests()
    config = docs["ConfigMap/argus-config"]["data"]
    spec = docs["Deployment/argus-aggregator"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert spec["securityContext"].get("runAsNonRoot") is True
    assert spec["securityContext"].get("runAsUser", 0) != 0
    sc = c["securityContext"]
    assert sc.get("readOnlyRootFilesystem") is True and sc.get("allowPrivilegeEscalation") is False
    assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
    env = _container_env(c, config)
    ctx = check_command(_argv(c, env), "aggregator Deployment")
    assert command_path(ctx) == "argus aggregate"
    _secret_file(spec, c, env, "aggregator Deployment")


def test_no_manifest_carries_a_password() -> None:
    for path in K8S.glob("*.yaml"):
        text = path.read_text()
        assert not re.search(r"(?im)^\s*(stringData|data):\s*\n\s+password", text), path
        assert not re.search(r"(?i)redis://[^/\s]*:[^@/\s]*@", text), f"{path}: a password in a URL"


# --------------------------------------------------------------------------- agent-init.py


def _init(args: List[str], **kw: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(AGENT_INIT), *args], **kw)  # type: ignore[call-overload]


def test_agent_init_waits_for_what_the_agent_leaves_and_returns_its_status(tmp_path: Path) -> None:
    """The keeper is the agent's child, still removing probes when the agent has exited."""
    done = tmp_path / "keeper-done"
    p = _init(["bash", "-c", f"(sleep 0.5; touch {done}) & exit 3"])
    assert p.wait(timeout=20) == 3
    assert done.exists(), "agent-init.py returned before the agent's orphaned child ended"


def test_agent_init_forwards_sigterm_and_drops_stdout_unless_asked(tmp_path: Path) -> None:
    child = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
        "print('ready', flush=True)\n"
        "time.sleep(20)\n"
    )
    quiet = _init([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the child has its handler by now (nothing on stdout to wait for)
    quiet.send_signal(signal.SIGTERM)
    assert quiet.wait(timeout=20) == 7
    assert quiet.stdout is not None and quiet.stdout.read() == "", "the agent's stdout is dropped by default"
    loud = _init(
        [sys.executable, "-c", child],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "ARGUS_KEEP_STDOUT": "1"},
    )
    assert loud.stdout is not None and loud.stdout.readline() == "ready\n"
    loud.send_signal(signal.SIGTERM)
    assert loud.wait(timeout=20) == 7


# --------------------------------------------------------------------------- Slurm


STUB = """#!/bin/bash
# stands in for argus: records its arguments and environment, then runs until SIGTERM (30 s at most)
printf '%s\\0' "$@" > "$ARGV_OUT.tmp"
env -0 > "$ARGV_OUT.env"
mv "$ARGV_OUT.tmp" "$ARGV_OUT"
trap 'exit 0' TERM
for _ in $(seq 300); do sleep 0.1; done
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Prolog:
    """Runs deploy/slurm/argus-prolog.sh as slurmd would, with a stand-in argus, in tmp_path."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.stub = tmp / "argus"
        self.stub.write_text(STUB)
        self.stub.chmod(0o755)
        self.started: List[int] = []

    def env(self, env_file: Path, job: Optional[str] = JOB_ID, **extra: str) -> Dict[str, str]:
        e = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "ARGUS": str(self.stub),
            "ARGUS_ENV_FILE": str(env_file),
            "ARGUS_STATE_DIR": str(self.tmp / "run"),
            "ARGUS_LOG_DIR": str(self.tmp / "log"),
            "ARGV_OUT": str(self.tmp / "argv"),
            **extra,
        }
        if job is not None:
            e["SLURM_JOB_ID"] = job
        return e

    def run(
        self, env_file: Path, job: Optional[str] = JOB_ID, **kw: str
    ) -> Tuple[subprocess.CompletedProcess, Optional[List[str]]]:
        """The prolog's result and the stand-in agent's arguments (None: it started none)."""
        out = self.tmp / "argv"
        out.unlink(missing_ok=True)
        env = self.env(env_file, job, **kw)
        r = subprocess.run(["bash", str(PROLOG)], env=env, capture_output=True, text=True, timeout=30)
        pidfile = self.tmp / "run" / f"slurm-{job}.pid"
        if job is None or not pidfile.exists():
            return r, None
        self.started.append(int(pidfile.read_text()))
        deadline = time.monotonic() + 10
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.exists(), f"the prolog's agent did not start: {r.stderr}"
        return r, out.read_bytes().decode().split("\0")[:-1]

    def child_env(self) -> Dict[str, str]:
        raw = (self.tmp / "argv.env").read_bytes().decode().split("\0")
        return dict(kv.split("=", 1) for kv in raw if "=" in kv)

    def epilog(self, job: str = JOB_ID) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(EPILOG)],
            env={
                "PATH": os.environ.get("PATH", ""),
                "SLURM_JOB_ID": job,
                "ARGUS_STATE_DIR": str(self.tmp / "run"),
            },
            capture_output=True,
            text=True,
            timeout=60,
        )

    def cleanup(self) -> None:
        for pid in self.started:  # only the stand-ins this test started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def prolog(tmp_path: Path) -> Iterator[Prolog]:
    if shutil.which("setsid") is None:
        pytest.skip("no setsid (util-linux): the prolog cannot run here")
    p = Prolog(tmp_path)
    yield p
    p.cleanup()


def _env_file_variants(tmp: Path) -> List[Tuple[Path, Dict[str, str]]]:
    """argus.env as shipped (the prolog reads it with a shell), then with each commented example."""
    base, examples = read_env_file(ENV_FILE.read_text())
    files = [(ENV_FILE, base)]
    for i, (k, v) in enumerate(examples):
        f = tmp / f"argus-{i}.env"
        f.write_text(ENV_FILE.read_text() + f'\n{k}="{v}"\n')
        files.append((f, {**base, k: v}))
    return files


def test_the_prolog_starts_an_accepted_agent_for_the_job_and_the_epilog_stops_it(prolog: Prolog) -> None:
    for env_file, variant in _env_file_variants(prolog.tmp):
        r, argv = prolog.run(env_file)
        assert r.returncode == 0 and argv is not None, r.stderr
        where = f"argus-prolog.sh with {env_file.name}"
        ctx = check_command(argv, where)
        assert ctx is not None and command_path(ctx) == "argus probe"
        assert opt(ctx, "--all") and opt(ctx, "--wait") and opt(ctx, "--job") == f"slurm-{JOB_ID}"
        assert opt(ctx, "--redis") == read_env_file(ENV_FILE.read_text())[0]["ARGUS_REDIS_URL"]
        child = prolog.child_env()  # the password by file, never an argument
        assert child["ARGUS_REDIS_PASSWORD_FILE"] == "/etc/argus/agent.pw"
        assert child["ARGUS_REDIS_USERNAME"] == "argus-agent"
        assert "ARGUS_REDIS_PASSWORD" not in child
        match = opt(ctx, "--match")
        if "ARGUS_SLURM_MATCH" in variant:  # the site's own, or none
            assert match == (variant["ARGUS_SLURM_MATCH"] or None), (variant, argv)
        else:  # this job's step daemons and batch script, and no other job's
            rx = re.compile(str(match))
            mine = (
                f"slurmstepd: [{JOB_ID}.0]",
                f"slurmstepd: [{JOB_ID}.batch]",
                f"/bin/bash /var/spool/slurmd/job0{JOB_ID}/slurm_script",
            )
            for cmdline in mine:
                assert rx.search(cmdline), (match, cmdline)
            others = (
                f"slurmstepd: [1{JOB_ID}.0]",
                f"slurmstepd: [{JOB_ID}0.0]",
                f"/bin/bash /var/spool/slurmd/job{JOB_ID}0/slurm_script",
                "python train.py",
            )
            for cmdline in others:
                assert not rx.search(cmdline), (match, cmdline)
        pid = prolog.started[-1]
        assert _alive(pid)
        e = prolog.epilog()
        assert e.returncode == 0, e.stderr
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"the epilog left the agent running: {e.stderr}"
        assert not (prolog.tmp / "run" / f"slurm-{JOB_ID}.pid").exists()


def test_the_prolog_match_is_what_the_deploy_page_shows(prolog: Prolog) -> None:
    _, argv = prolog.run(ENV_FILE)
    assert argv is not None
    ctx = parse_argus(argv, "argus-prolog.sh")
    assert ctx is not None
    shown = [
        parse_argus(a, "docs/deploy.md")
        for block in code_blocks(DOC.read_text())
        for a in argus_invocations(block)
        if "--job" in a
    ]
    assert shown and shown[0] is not None
    assert opt(shown[0], "--match") == opt(ctx, "--match"), "docs/deploy.md shows another --match"
    assert opt(shown[0], "--job") == opt(ctx, "--job")
    prolog.epilog()


def test_the_prolog_without_a_match_and_without_what_it_needs(prolog: Prolog) -> None:
    _, argv = prolog.run(ENV_FILE, ARGUS_SLURM_MATCH="")
    assert argv is not None and "--match" not in argv, argv
    check_command(argv, "argus-prolog.sh with ARGUS_SLURM_MATCH=")
    prolog.epilog()
    # never a failure (a failing prolog drains the node), never an agent
    r, argv = prolog.run(ENV_FILE, job=None)
    assert r.returncode == 0 and argv is None and "no SLURM_JOB_ID" in r.stderr
    empty = prolog.tmp / "empty.env"
    empty.write_text("")
    r, argv = prolog.run(empty)
    assert r.returncode == 0 and argv is None and "ARGUS_REDIS_URL is not set" in r.stderr


def test_the_epilog_leaves_a_process_that_is_not_its_agent_alone(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    other = subprocess.Popen(["sleep", "30"])  # as if the agent's pid had been reused
    try:
        (run / f"slurm-{JOB_ID}.pid").write_text(f"{other.pid}\n")
        r = subprocess.run(
            ["bash", str(EPILOG)],
            env={"PATH": os.environ.get("PATH", ""), "SLURM_JOB_ID": JOB_ID, "ARGUS_STATE_DIR": str(run)},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0 and "already gone" in r.stderr, r.stderr
        assert other.poll() is None, "the epilog signalled a process that is not its agent"
        assert not (run / f"slurm-{JOB_ID}.pid").exists()
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("script", [PROLOG, EPILOG], ids=lambda p: p.name)
def test_slurm_scripts_parse_and_pass_shellcheck(script: Path) -> None:
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    tool = shutil.which("shellcheck")
    if tool is None:
        pytest.skip("shellcheck is not installed (bash -n passed)")
    r = subprocess.run([tool, "-x", str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
