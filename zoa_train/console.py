"""What the commands print: consoles that never read markup in a message (paths, recipe values and
errors can hold square brackets), and the one-sentence error line."""

import os

from rich.console import Console
from rich.text import Text

# Not on a terminal (a pipe, a file, a Slurm log) rich would lay tables out in 80 columns, cutting names
# and numbers short: there they are printed whole, as wide as their contents (COLUMNS still decides).
WHOLE = 100_000


def _console(**kwargs) -> Console:
    console = Console(markup=False, highlight=False, soft_wrap=True, **kwargs)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = WHOLE
    return console


out = _console()
err = _console(stderr=True)


def error(message: str) -> None:
    """`error: <message>` on stderr, the word in bold red, the message as it is."""
    err.print(Text.assemble(("error:", "bold red"), " ", str(message)))
