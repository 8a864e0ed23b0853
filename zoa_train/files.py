"""The user's files: YAML and JSON read strictly (a key given twice is refused, as DeepSpeed refuses it in
its configs), JSON written as JSON (no Infinity or NaN), and the directories and result files a command
writes, checked before the work starts. Every problem is a UserError of one sentence."""

import json
import math
import os
from pathlib import Path

import yaml

from zoa_train.errors import UserError


class _DuplicateKey(Exception):
    def __init__(self, key, first: int | None, second: int | None):
        self.key, self.first, self.second = key, first, second


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, which keeps the last of two equal keys silently; this one refuses them."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise _DuplicateKey(key, seen[key], key_node.start_mark.line + 1)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load_yaml(text: str, origin: str):
    """`text` as YAML; yaml.YAMLError for malformed text, a UserError for a key given twice in one mapping."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass
    except _DuplicateKey as e:
        raise UserError(f"{origin} gives the key {e.key} twice in one mapping (lines {e.first} and {e.second}); keep one.") from None


def load_json(text: str, origin: str):
    """`text` as JSON; json.JSONDecodeError for malformed text, a UserError for a key given twice in one object."""

    def refuse_duplicates(pairs: list) -> dict:
        keys = [key for key, _ in pairs]
        twice = next((key for key in keys if keys.count(key) > 1), None)
        if twice is not None:
            raise UserError(f"{origin} gives the key {twice} twice in one object; keep one.")
        return dict(pairs)

    return json.loads(text, object_pairs_hook=refuse_duplicates)


def finite(value):
    """`value` with every NaN or infinite float replaced by None: JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps_json(value, **kwargs) -> str:
    """json.dumps that writes a NaN or infinite float as null (json.dumps would write NaN or Infinity,
    which JSON readers refuse)."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_directory(path: Path, what: str) -> None:
    """Refuse, without creating anything, a directory that cannot be created or written: `what` names it."""
    path = Path(path)
    found = _nearest_existing(path)
    if found == path.absolute():
        problem = None if found.is_dir() else "is not a directory"
        problem = problem or (None if os.access(found, os.W_OK | os.X_OK) else "is not writable")
        if problem:
            raise UserError(f"{what} {path} {problem}.")
    elif not found.is_dir():
        raise UserError(f"cannot create {what} {path}: {found} is not a directory.")
    elif not os.access(found, os.W_OK | os.X_OK):
        raise UserError(f"cannot create {what} {path}: {found} is not writable.")


def make_directory(path: Path, what: str) -> None:
    """mkdir -p, or one sentence naming `what` and why it cannot be created."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {what} {path}: {e.strerror or e}.") from None


def check_output_file(path: Path, option: str) -> None:
    """Refuse, before the work that fills it, a result file that could not be written."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{option} {path} is a directory; name the file to write.")
    found = _nearest_existing(path)
    if found == path.absolute():
        problem = None if os.access(found, os.W_OK) else "it is not writable"
    else:
        problem = None if found.is_dir() else f"{found} is not a directory"
        problem = problem or (None if os.access(found, os.W_OK | os.X_OK) else f"{found} is not writable")
    if problem:
        raise UserError(f"cannot write {option} {path}: {problem}.")


def write_json_file(path: Path, value, option: str) -> None:
    """Write `value` as indented JSON to `path` (its directory created), one sentence if that fails."""
    make_directory(Path(path).parent, f"the directory of {option}")
    try:
        Path(path).write_text(dumps_json(value, indent=2) + "\n")
    except OSError as e:
        raise UserError(f"cannot write {option} {path}: {e.strerror or e}.") from None
