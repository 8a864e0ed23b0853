"""What the commands print: consoles that never read markup in a message (paths, recipe values and
errors can hold square brackets), and the one-sentence error line."""

from rich.console import Console
from rich.text import Text

out = Console(markup=False, highlight=False, soft_wrap=True)
err = Console(stderr=True, markup=False, highlight=False, soft_wrap=True)


def error(message: str) -> None:
    """`error: <message>` on stderr, the word in bold red, the message as it is."""
    err.print(Text.assemble(("error:", "bold red"), " ", str(message)))
