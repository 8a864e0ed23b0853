"""Errors caused by the user's input: the CLI prints their one-sentence message and exits with code 2."""


class UserError(Exception):
    """Bad input (a recipe, a flag, a file): the message is one sentence saying what is expected."""
