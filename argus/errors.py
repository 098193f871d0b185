"""Typed errors shared by every command.

Each class carries a one-line message and a hint; `argus.cli.main` prints them as
``ERROR: ...`` / ``HINT: ...`` and exits with the class's distinct code. User mistakes
never surface as tracebacks.
"""

from __future__ import annotations


class ArgusError(Exception):
    """Base class: a problem the user can act on."""

    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(ArgusError):
    """Bad flag values or combinations (click's own usage errors also exit 2)."""

    exit_code = 2


class PermissionDenied(ArgusError):
    """Not root and lacking CAP_BPF + CAP_PERFMON."""

    exit_code = 3


class NoSuchProcess(ArgusError):
    exit_code = 4


class NotATarget(ArgusError):
    """The process maps none of the libraries a probe needs."""

    exit_code = 5


class SymbolMissing(ArgusError):
    """A required symbol is absent from a mapped library (older/newer version)."""

    exit_code = 6


class EnvironmentProblem(ArgusError):
    """bcc missing, kernel headers missing, tracefs unmounted, BPF compile failure."""

    exit_code = 7


class RedisUnavailable(ArgusError):
    exit_code = 8


class BadData(ArgusError):
    """Malformed or hostile data read from Redis or a file."""

    exit_code = 9


class Unsupported(ArgusError):
    """A runtime version outside the supported window (e.g. CPython)."""

    exit_code = 10


class SimulationFailed(ArgusError):
    """The simulated training job failed (a rank crashed or timed out)."""

    exit_code = 11


class PreconditionsFailed(ArgusError):
    """`argus doctor` found a FAIL: probing cannot work here."""

    exit_code = 12


class ConfigError(ArgusError):
    """The TOML config file (argus --config, $ARGUS_CONFIG, /etc/argus/argus.toml) is unreadable or
    names a key or value no command takes."""

    exit_code = 13


EXIT_CODES: dict[str, int] = {
    cls.__name__: cls.exit_code
    for cls in (
        ArgusError,
        UsageError,
        PermissionDenied,
        NoSuchProcess,
        NotATarget,
        SymbolMissing,
        EnvironmentProblem,
        RedisUnavailable,
        BadData,
        Unsupported,
        SimulationFailed,
        PreconditionsFailed,
        ConfigError,
    )
}
