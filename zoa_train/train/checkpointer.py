"""Checkpoints written in the background, and the sharded parts of a checkpoint (torch.distributed.checkpoint).

A checkpoint's state is copied to host memory on the training thread (`host_copy`: the only part of a
save the step waits for), then written, agreed on and published by `BackgroundWrite`, a thread of its
own, while training continues (train/rundir.py: RunDirectory.save_in_background; docs/faults.md,
"Checkpoints"). The thread's collectives run on a process group of their own, never the training's.

A sharded run's model and its optimizer state per parameter are written by every rank, its own shards
only, through torch.distributed.checkpoint (DCP): `write_shards` / `read_shards` on many ranks,
`read_whole` on one process without a process group (export, eval). DCP keeps its index in a pickled
`.metadata` file: it is read here by an unpickler that admits DCP's own metadata classes and nothing
that could run code, as every other checkpoint file is read (rundir.read_checkpoint_file).
"""

import copy
import pickle
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from zoa_train.errors import UserError

_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def host_copy(obj, storages: dict | None = None):
    """`obj` (nested dicts, lists and tuples of tensors and plain values) with every tensor copied to host
    memory, so that training may go on changing the originals. A storage that several tensors view is
    copied once and they view the copy as they viewed it (tied weights, views of a flat buffer): torch.save
    writes the same file as it would have of `obj`. A DTensor keeps its placement, its local shard copied."""
    storages = {} if storages is None else storages
    if isinstance(obj, DTensor):
        return obj.detach().to("cpu") if obj.device.type != "cpu" else obj.detach().clone()
    if isinstance(obj, torch.Tensor):
        return _tensor_copy(obj.detach(), storages)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # the same mapping type (OrderedDict, defaultdict)
        for key, value in obj.items():
            out[key] = host_copy(value, storages)
        return out
    if isinstance(obj, list):
        return [host_copy(value, storages) for value in obj]
    if isinstance(obj, _IMMUTABLE):
        return obj
    if isinstance(obj, tuple):
        items = [host_copy(value, storages) for value in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


def _tensor_copy(tensor: torch.Tensor, storages: dict) -> torch.Tensor:
    storage = tensor.untyped_storage()
    key = (storage.data_ptr(), storage.device, storage.nbytes())
    if storage.data_ptr() == 0:  # an empty tensor: nothing to share
        return tensor.to("cpu", copy=True)
    copied = storages.get(key)
    if copied is None:
        copied = storages[key] = storage.cpu() if storage.device.type != "cpu" else storage.clone()
    return torch.empty(0, dtype=tensor.dtype).set_(copied, tensor.storage_offset(), tensor.size(), tensor.stride())


class BackgroundWrite:
    """One checkpoint write on a thread of its own. `write()` returns the published checkpoint or raises
    a UserError (a failed write, agreed by every rank); `on_failure()` is called on the thread as soon as
    a write has failed. The thread is a daemon: a rank that dies mid-write leaves a staged, invisible
    checkpoint, never a published half of one."""

    def __init__(self, name: str, write: Callable[[], Path], on_failure: Callable[[], None] | None = None):
        self.name = name
        self._write, self._on_failure = write, on_failure
        self._published: Path | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"zoa-checkpoint-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._published = self._write()
        except BaseException as e:  # kept for wait(): the training thread raises it
            self.error = e
            if self._on_failure is not None:
                self._on_failure()

    def wait(self) -> Path:
        """Wait for the write: the published checkpoint, or its error raised."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self._published

    def settle(self) -> None:
        """Wait for the write without raising its error (wait() still raises it)."""
        self._thread.join()


# ---- torch.distributed.checkpoint ------------------------------------------------------------------


def write_shards(state: dict, directory: Path, group=None) -> list[Path]:
    """Collective over `group` (None: the default group; no group at all on one process): write `state`'s
    tensors, DTensors as their shards, into `directory`; returns the files this rank wrote (fsynced).
    A failure on any rank raises on every rank (DCP's CheckpointException)."""
    no_dist = not dist.is_initialized() or dist.get_world_size(group) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process", overwriting
        dcp.save(state, checkpoint_id=directory, process_group=None if no_dist else group, no_dist=no_dist)
    rank = 0 if no_dist else dist.get_rank(group)
    mine = sorted(directory.glob(f"__{rank}_*"))  # FileSystemWriter names each rank's files __RANK_N.distcp
    return [*mine, directory / ".metadata"] if rank == 0 else mine


def failure_of(e: BaseException) -> BaseException:
    """The exception that made a DCP call fail on some rank (the first), or `e` itself."""
    if isinstance(e, CheckpointException) and e.failures:
        first, _ = next(iter(e.failures.values()))
        return first
    return e


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata holds dataclasses of torch.distributed.checkpoint.metadata, dtypes and sizes: only those load."""

    _ALLOWED = {
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        *(("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),  # the path it was written to
    }

    def find_class(self, module: str, name: str):
        found = getattr(dcp.metadata, name, None) if module == "torch.distributed.checkpoint.metadata" else None
        if isinstance(found, type) and found.__module__ == module:  # its own dataclasses and enums, not what it imports
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


class _CheckedReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is read by _MetadataUnpickler (tensors are raw bytes already)."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def shard_shapes(directory: Path) -> dict[str, dict[str, tuple[int, ...]]]:
    """{top-level key: {name: whole shape}} of the tensors a DCP checkpoint holds (read from its metadata
    alone), e.g. {"model": {"transformer.wte.weight": (4096, 128), ...}}."""
    metadata = _read_metadata(directory)
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            top, name = _split(metadata, fqn)
            shapes.setdefault(top, {})[name] = tuple(entry.size)
    return shapes


def read_shards(state: dict, directory: Path) -> None:
    """Collective of every rank (one process: none): fill `state`'s tensors in place from a DCP checkpoint,
    each rank reading what its tensors hold (its shards of a DTensor, all of a plain tensor), whatever the
    layout that wrote them."""
    no_dist = not dist.is_initialized()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=_CheckedReader(directory), no_dist=no_dist)
    except CheckpointException as e:
        raise _readable(failure_of(e), directory) from None


def read_whole(directory: Path, keys: set[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """On one process, without a process group: the whole tensors of a DCP checkpoint, {top-level key:
    {name: tensor}} (only the top-level `keys`, when given), gathered from every rank's shards."""
    metadata = _read_metadata(directory)
    flat, names = {}, {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            top, name = _split(metadata, fqn)
            if keys is None or top in keys:
                flat[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
                names[fqn] = (top, name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(flat, storage_reader=_CheckedReader(directory), no_dist=True)
    except CheckpointException as e:
        raise _readable(failure_of(e), directory) from None
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, tensor in flat.items():
        top, name = names[fqn]
        whole.setdefault(top, {})[name] = tensor
    return whole


def _split(metadata, fqn: str) -> tuple[str, str]:
    """(top-level key, name below it) of a flattened DCP key: "model" and "transformer.wte.weight"."""
    path = (metadata.planner_data or {}).get(fqn)
    if path and len(path) == 2:
        return str(path[0]), str(path[1])
    top, _, name = fqn.partition(".")
    return top, name


def _read_metadata(directory: Path):
    try:
        return _CheckedReader(directory).read_metadata()
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as e:
        raise UserError(
            f"{directory / '.metadata'} holds {str(e) or 'a pickled object'} beside DCP's own metadata; zoa-train reads no code from a checkpoint, "
            "so it refuses the file (checkpoints it writes never hold one)."
        ) from None
    except (OSError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise UserError(f"{directory / '.metadata'} is not a readable torch.distributed.checkpoint index ({type(e).__name__}).") from None


def _readable(e: BaseException, directory: Path) -> BaseException:
    """What to raise for a failed read: a file that went away as it is (a rotating run's reader retries), else one sentence."""
    if isinstance(e, (FileNotFoundError, UserError)):
        return e
    return UserError(f"the sharded checkpoint {directory} is not readable ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}).")
