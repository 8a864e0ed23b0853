"""What a recipe's name of a pretrained thing means (model.init_from, model.hf_config, data.tokenizer):
a local path or a Hugging Face hub name, told apart by one rule, so that a directory that is not there
is reported as missing rather than as a malformed hub name.

The rule: a name is a local path when something exists there (after `~` is expanded) or when it cannot
be a hub name, that is when it starts with `.`, `/` or `~`, or is not `name` or `owner/name` made of
letters, digits, `_`, `-` and `.`. Any other name (`gpt2`, `Qwen/Qwen2-0.5B`) is a hub name, which needs
the internet unless the hub's cache already holds it.
"""

import re
from pathlib import Path

from zoa_train.errors import UserError

_HUB_NAME = re.compile(r"\w[\w.-]*(/\w[\w.-]*)?")


def local_path(name: str) -> Path | None:
    """The local path `name` means (`~` expanded), or None when it is a hub name."""
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or not _HUB_NAME.fullmatch(name):
        return path
    return None


def existing(name: str, key: str, holds: str) -> str:
    """`name` as from_pretrained takes it: a local directory (`~` expanded) or a hub name; a local path
    where no directory is, refused in one sentence naming `key` and what the directory `holds`."""
    path = local_path(name)
    if path is None:
        return name
    if path.is_file():
        raise UserError(f"{key} {name} is a file; give the directory that holds {holds}.")
    if not path.is_dir():
        raise UserError(f"{key} {name} does not exist: it names a local directory (a hub name is name or owner/name); give the directory that holds {holds}.")
    return str(path)
