"""The `argus` command line: one click group; each command's body lives in its own module.

Command modules are imported lazily so that `argus --help` and the unprivileged commands
never import bcc.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Optional, Sequence

import click

from argus import __version__
from argus.errors import ArgusError

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="argus")
def cli() -> None:
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
    """


def _register() -> None:
    from argus.doctor import doctor_cmd
    from argus.sim.cli import sim_group

    cli.add_command(doctor_cmd)
    cli.add_command(sim_group)
    from argus.tui.commands import export_prometheus_cmd, report_cmd
    from argus.tui.top import top_cmd

    cli.add_command(top_cmd)
    cli.add_command(report_cmd)
    cli.add_command(export_prometheus_cmd)
    from argus.demo import demo_cmd

    cli.add_command(demo_cmd)
    from argus.replay import replay_cmd

    cli.add_command(replay_cmd)
    from argus.aggregator.cli import aggregate_cmd, alerts_cmd, diagnose_cmd

    cli.add_command(diagnose_cmd)
    cli.add_command(aggregate_cmd)
    cli.add_command(alerts_cmd)
    from argus.agent.cli import probe_cmd

    cli.add_command(probe_cmd)
    from argus.agent.record import record_cmd

    cli.add_command(record_cmd)


_register()


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
