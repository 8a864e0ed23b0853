"""Every subcommand answers --help, and --version prints the package version."""

import pytest
from typer.testing import CliRunner

import zoa_train
from zoa_train.cli import app

COMMANDS = [[], ["run"], ["plan"], ["bench"], ["bench", "comm"], ["bench", "netsim"], ["bench", "optim"], ["bench", "loader"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "zoa-train")
def test_help(command):
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output and "--help" in result.output


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and zoa_train.__version__ in result.output
