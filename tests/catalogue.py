"""docs/bad-input.md's catalogue read back, so that the tests hold it to the code: a row's Test column
names cases of the test tables (`bad_input`, `commands`, `resume`: tests/test_bad_input.py;
`BAD_RECIPES`: tests/test_run.py), and the n-th message of its "What zoa-train says" column is what the
n-th case it names must say, word for word but where the message writes `…` (anything) or R or C
(the recipe's or the DeepSpeed config's path)."""

import re
from pathlib import Path

CATALOGUE = Path(__file__).resolve().parents[1] / "docs" / "bad-input.md"
KINDS = ("bad_input", "commands", "resume", "BAD_RECIPES")


def rows() -> list[tuple[list[str], list[tuple[str, str]]]]:
    """(documented messages, (kind, case) named) of each catalogue row that names a case."""
    found = []
    for line in CATALOGUE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) != 5 or not line.startswith("| "):
            continue
        says, tests = cells[2], cells[4]
        messages = [m for m in re.findall(r"`([^`]+)`", says) if m.endswith((".", "?"))]
        cases = [(kind, name) for kind, names in re.findall(rf"({'|'.join(KINDS)})((?:,?\s*`[^`]+`)+)", tests) for name in re.findall(r"`([^`]+)`", names)]
        if cases:
            found.append((messages, cases))
    return found


def pattern(message: str) -> str:
    """A documented message as a regular expression for the whole sentence zoa-train prints."""
    parts = re.split(r"(…|\bR\b|\bC\b)", message)
    return "".join(".*?" if part == "…" else ".+?" if part in ("R", "C") else re.escape(part) for part in parts)


def documented(kind: str, case: str) -> str | None:
    """The regular expression the catalogue gives for what `case` says, or None where it gives none."""
    for messages, cases in rows():
        if (kind, case) in cases and cases.index((kind, case)) < len(messages):
            return pattern(messages[cases.index((kind, case))])
    return None


def check_documented(kind: str, case: str, stderr: str) -> None:
    """The catalogue's message for `case` (if it gives one) is the sentence zoa-train printed."""
    expected = documented(kind, case)
    if expected is None:
        return
    said = next(line.removeprefix("error: ") for line in stderr.splitlines() if line.startswith("error: "))
    assert re.fullmatch(expected, said), f"docs/bad-input.md documents for {kind} `{case}`:\n  {expected}\nzoa-train says:\n  {said}"
