"""What the test files share: the CLI run as a user runs it (zoa, or zoa_here in this process), the
cache-directory fixture, and the check of a refusal (refused, one_sentence).

Imported as `from conftest import ...` (pytest puts tests/ on sys.path, as for tests/catalogue.py)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ZOA = (sys.executable, "-m", "zoa_train.cli")
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "zoa_train.cli")


def zoa(*args: str, cwd: Path = ROOT, env: dict | None = None, timeout: float = 600, command=ZOA) -> subprocess.CompletedProcess:
    """`zoa-train ARGS` in a fresh process (or under `command`, e.g. TORCHRUN); env, when given, is the
    whole environment, as for subprocess.run."""
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def env_with_tests_on_path() -> dict:
    """This environment with tests/ on PYTHONPATH: a fresh process can import the plugins kept there
    (tests/model_plugin.py, tests/sgd_plugin.py), as a user's PYTHONPATH would."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}


def zoa_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """`zoa-train ARGS` through the console entry point in this process: for what is refused or done
    before any rank starts, without paying a Python and torch start-up each."""
    from zoa_train import cli

    capsys.readouterr()
    argv = sys.argv
    sys.argv = ["zoa-train", *args]
    try:
        cli.run()
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """The data.cache_dir of every run the tests start: each tokenizer and token file is built once and
    reused (ranks and runs may share it at the same time: zoa_train/data/cache.py)."""
    return tmp_path_factory.mktemp("zoa-cache")


def one_sentence(text: str, *fragments: str, end: str = ".") -> None:
    """One line, one sentence (ending with `end`, a question mark for the few that ask, and no full stop
    inside but an abbreviation's), holding each fragment."""
    assert "\n" not in text.strip() and text.strip().endswith(end), text
    inside = re.sub(r"\b(e\.g|i\.e)\.", "", text)
    assert ". " not in inside and not re.search(r"[.!?]\s+[A-Z]", inside), text
    for fragment in fragments:
        assert fragment in text, (fragment, text)


def refused(done: subprocess.CompletedProcess, *fragments: str, alone: bool = True, end: str = ".") -> str:
    """Exit code 2, no traceback, one line `error: <one sentence>` on stderr holding each fragment; and,
    if alone, nothing else on stderr (alone=False where ranks started and logged before the refusal).
    Returns the error line."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    if alone:
        assert done.stderr.strip() == errors[0].strip(), done.stderr[-3000:]
    one_sentence(errors[0].removeprefix("error:"), *fragments, end=end)
    return errors[0]
