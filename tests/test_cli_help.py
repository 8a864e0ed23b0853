"""Every subcommand answers --help, and --version prints the package version."""

import subprocess
import sys

import pytest
from typer.testing import CliRunner

import zoa_train
from zoa_train.cli import app

COMMANDS = [
    [],
    ["run"],
    ["plan"],
    ["convert-deepspeed"],
    ["report"],
    ["bench"],
    ["bench", "comm"],
    ["bench", "netsim"],
    ["bench", "optim"],
    ["bench", "loader"],
    ["eval"],
    ["eval", "imagenet"],
    ["eval", "wikitext"],
    ["eval", "lambada"],
    ["eval", "glue"],
    ["export"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "zoa-train")
def test_help(command):
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output and "--help" in result.output


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and zoa_train.__version__ in result.output


@pytest.mark.parametrize("args", [["run"], ["bench", "optim", "--no-such-option"]], ids=["missing argument", "unknown option"])
def test_usage_errors_are_one_message_and_exit_code_2(args):
    # through the console entry point, as a user meets it (not CliRunner, which catches by itself)
    result = subprocess.run([sys.executable, "-c", "from zoa_train.cli import run; run()", *args], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "Error:" in result.stderr and "Traceback" not in result.stderr and "─" not in result.stderr


def _commands(command, path=()):
    """(path, click command) of every subcommand."""
    import click

    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))


def test_help_shows_every_default_as_written_once_and_flags_as_flags():
    import re

    import typer

    for path, command in _commands(typer.main.get_command(app)):
        output = " ".join(CliRunner().invoke(app, [*path, "--help"], terminal_width=400).output.split())
        assert "<bool>" not in output, path  # a flag takes no value
        for param in command.params:
            written = re.findall(r"\[default: [^\]]*\]", getattr(param, "help", None) or "")
            for default in written:  # the text of the help string itself, not swallowed as markup
                assert default in output, (path, param.name, default)
                assert not param.show_default, (path, param.name)  # and no second, generated one
