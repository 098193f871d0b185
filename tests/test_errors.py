"""Typed errors: one exit code per class, printed as ERROR:/HINT: by `argus.cli.main`."""

from __future__ import annotations

from typing import Iterator, List, Type

import click
import pytest

from argus import errors
from argus.cli import cli, main
from argus.errors import EXIT_CODES, ArgusError, PreconditionsFailed
from tests.helpers import run_argus


def _all_error_classes() -> List[Type[ArgusError]]:
    found: List[Type[ArgusError]] = [ArgusError]
    for cls in found:  # grows while iterating: a breadth-first walk of the hierarchy
        found.extend(c for c in cls.__subclasses__() if c.__module__ == errors.__name__)
    return found


ERROR_CLASSES = _all_error_classes()


def test_every_error_class_has_a_distinct_exit_code() -> None:
    codes = {cls.__name__: cls.exit_code for cls in ERROR_CLASSES}
    assert len(set(codes.values())) == len(codes), codes
    assert all(0 < code < 126 for code in codes.values()), codes


def test_exit_code_table_lists_every_class() -> None:
    assert EXIT_CODES == {cls.__name__: cls.exit_code for cls in ERROR_CLASSES}


@pytest.fixture
def boom_command() -> Iterator[str]:
    """A throwaway `argus _boom CLASS [HINT]` command that raises the named error."""

    @click.command("_boom")
    @click.argument("name")
    @click.argument("hint", required=False, default="")
    def boom(name: str, hint: str) -> None:
        raise getattr(errors, name)(f"{name} happened", hint)

    cli.add_command(boom)
    try:
        yield "_boom"
    finally:
        cli.commands.pop("_boom", None)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_main_prints_error_and_hint_and_returns_code(
    cls: Type[ArgusError], boom_command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main([boom_command, cls.__name__, "try this instead"])
    out, err = capsys.readouterr()
    assert rc == cls.exit_code
    assert err.splitlines() == [f"ERROR: {cls.__name__} happened", "HINT: try this instead"]
    assert "Traceback" not in out + err


def test_main_omits_empty_hint(boom_command: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([boom_command, "NoSuchProcess"])
    _, err = capsys.readouterr()
    assert rc == errors.NoSuchProcess.exit_code
    assert err.splitlines() == ["ERROR: NoSuchProcess happened"]


def test_click_usage_errors_exit_2_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--no-such-flag"]) == 2
    _, err = capsys.readouterr()
    assert "No such option" in err and "Traceback" not in err


def test_bad_redis_url_is_a_usage_error_in_a_real_process() -> None:
    res = run_argus("doctor", "--redis", "http://127.0.0.1:6379/0", timeout=60)
    assert res.returncode == 2, res.stderr
    assert "redis://" in res.stderr
    assert "Traceback" not in res.stdout + res.stderr


def test_preconditions_failed_code_is_stable() -> None:
    # scripts and docs (and test_doctor's nobody run) rely on it
    assert PreconditionsFailed.exit_code == 12
