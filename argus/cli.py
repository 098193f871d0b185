"""The `argus` command line: one click group; each command's body lives in its own module.

The command modules are imported at startup (none of them imports bcc at import time: only
running `probe` or `record` does). A module that cannot be imported does not take its commands
away, nor the others with it: each of its commands is replaced by one that fails with an `ERROR:`
line naming the import's error (exit 7), `argus --help` marks it unavailable, and `argus doctor`
lists it. `ARGUS_DEBUG=1` shows the import's traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Dict, Optional, Sequence, Tuple

import click

from argus import __version__, conffile
from argus.errors import ArgusError, EnvironmentProblem

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

#: (module, its attribute, the command's name), in the order they are registered
COMMANDS: Tuple[Tuple[str, str, str], ...] = (
    ("argus.doctor", "doctor_cmd", "doctor"),
    ("argus.sim.commands", "sim_group", "sim"),
    ("argus.tui.top", "top_cmd", "top"),
    ("argus.tui.commands", "report_cmd", "report"),
    ("argus.exporter.command", "export_prometheus_cmd", "export-prometheus"),
    ("argus.demo", "demo_cmd", "demo"),
    ("argus.replay", "replay_cmd", "replay"),
    ("argus.aggregator.commands", "diagnose_cmd", "diagnose"),
    ("argus.aggregator.commands", "aggregate_cmd", "aggregate"),
    ("argus.aggregator.commands", "alerts_cmd", "alerts"),
    ("argus.agent.commands", "probe_cmd", "probe"),
    ("argus.agent.record", "record_cmd", "record"),
)

#: command name -> why it is unavailable (its module's import error), for `argus doctor`
UNAVAILABLE: Dict[str, str] = {}


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="argus")
@click.option(
    "--config",
    "config_path",
    metavar="FILE",
    default=None,
    help=f"TOML file of defaults for every command [default: ${conffile.ENV_CONFIG}, else "
    f"{conffile.DEFAULT_PATH} when present]. Flags and ARGUS_<COMMAND>_<OPTION> variables win over it.",
)
@click.pass_context
def cli(ctx: click.Context, config_path: Optional[str]) -> None:
    """Argus: always-on eBPF tracer and performance doctor for LLM training jobs.

    Attaches to running training processes (no restart, no env var), measures CUDA, NCCL
    and Python activity per rank and per step, and names the slow rank, collective, link
    and phase.

    \b
    Examples:
      sudo argus doctor                       # can probing work on this machine?
      sudo argus demo                         # 8-rank simulated job with a straggler
      sudo argus probe -p 4242                # live per-step summary of one rank
      argus sim run --ranks 8 --steps 50 --inject straggler:rank=3,factor=1.5
      argus --config site.toml top             # flags from [top] and [redis] of a TOML file

    Every option also reads ARGUS_<COMMAND>_<OPTION> (ARGUS_PROBE_INTERVAL=2s); docs/config.md.
    """
    if ctx.resilient_parsing:
        return
    cfg = conffile.load(cli, config_path, os.environ)
    conffile.apply_env(cfg, os.environ)
    ctx.default_map = cfg.default_map
    ctx.meta["argus.config"] = cfg.path


def unavailable_command(name: str, module: str, exc: BaseException) -> click.Command:
    """A stand-in for command `name` whose `module` failed to import with `exc`: listed by
    `argus --help`, and running it (whatever its arguments, `--help` too) is an EnvironmentProblem."""
    why = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]

    def fail(args: Tuple[str, ...]) -> None:
        raise EnvironmentProblem(
            f"argus {name} is unavailable: importing {module} failed: {why}",
            f"a broken or incomplete install: `{sys.executable} -m pip check` names missing "
            "dependencies; reinstall argus-tracer; ARGUS_DEBUG=1 shows the traceback",
        ) from exc

    return click.Command(
        name,
        callback=fail,
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
        add_help_option=False,
        short_help=f"UNAVAILABLE: {why}"[:120],
        help=f"UNAVAILABLE: importing {module} failed: {why}",
    )


def register(group: click.Group, commands: Sequence[Tuple[str, str, str]] = COMMANDS) -> Dict[str, str]:
    """Add `commands` to `group`; return those that could not be imported (name -> why)."""
    broken: Dict[str, str] = {}
    for module, attr, name in commands:
        try:
            cmd = getattr(importlib.import_module(module), attr)
        except Exception as e:  # any error importing it (a missing dependency, a bug): not fatal here
            cmd = unavailable_command(name, module, e)
            broken[name] = f"importing {module} failed: {type(e).__name__}: {e}"
        assert isinstance(cmd, click.Command) and cmd.name == name, (module, attr, name)
        group.add_command(cmd)
    return broken


UNAVAILABLE.update(register(cli))
conffile.name_envvars(cli)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI and translate errors into `ERROR:`/`HINT:` lines and exit codes."""
    try:
        rv = cli.main(args=list(argv) if argv is not None else None, prog_name="argus", standalone_mode=False)
    except ArgusError as e:
        if os.environ.get("ARGUS_DEBUG"):  # for developers: where did it come from?
            traceback.print_exc()
        click.echo(f"ERROR: {e.message}", err=True)
        if e.hint:
            click.echo(f"HINT: {e.hint}", err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
