"""Every subcommand answers --help, and --version prints the package version."""

import pytest
from conftest import zoa
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
    result = zoa(*args)
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


def test_tables_are_printed_whole_where_stdout_is_not_a_terminal(monkeypatch):
    """A pipe, a file or a Slurm log gets every table whole, not cut to 80 columns ("Power...", "0.00...")."""
    import io
    from pathlib import Path

    from zoa_train import console
    from zoa_train.optim import LRSchedule
    from zoa_train.plan.model import plan
    from zoa_train.plan.table import format_plan

    monkeypatch.delenv("COLUMNS", raising=False)
    printed = io.StringIO()
    planned = plan(1200, LRSchedule("constant", lr=1e-3), 2, 10**6, bandwidth_bytes_per_s=1e9, latency_s=0.0)
    console._console(file=printed).print(format_plan(planned))
    lines = printed.getvalue().splitlines()
    assert max(len(line) for line in lines) > 80  # wider than a terminal's default: nothing was cut to fit one
    assert any("|T_v| (variance updates)" in line and "PowerSGD" not in line for line in lines)  # a row name on one line
    assert any("1-bit Adam" in line and "PowerSGD" in line and "DiLoCo" in line for line in lines)  # the whole header
    # Every command prints through these consoles: a module that made its own would lay tables out in 80 columns.
    package = Path(zoa_train.__file__).parent
    own = [str(p.relative_to(package)) for p in package.rglob("*.py") if "Console(" in p.read_text() and p.name != "console.py"]
    assert not own


def test_json_output_is_json_even_for_infinite_values():
    """A value that is infinite or NaN (a perplexity that overflowed) is null in --json output: Python's
    Infinity and NaN are not JSON. Every command prints its JSON through files.dumps_json."""
    import ast
    import json
    import math
    from pathlib import Path

    from zoa_train.files import dumps_json

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    text = dumps_json({"token_perplexity": math.inf, "pearson": [math.nan, -math.inf], "loss": 1.5}, indent=2)
    assert json.loads(text, parse_constant=refuse) == {"token_perplexity": None, "pearson": [None, None], "loss": 1.5}
    package = Path(zoa_train.__file__).parent
    own = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                dumped = any(isinstance(a, ast.Call) and getattr(a.func, "attr", None) == "dumps" for a in node.args)
                if (name == "print" and dumped) or name == "print_json":
                    own.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not own, own
