"""Sharded trainer state (format ``dcp/v1``): ``torch.distributed.checkpoint`` over our Storage.

A trainer group of FSDP2 ranks writes its part of a cut with DCP, through the same
:class:`~spotrl_runtime.storage.Storage` every other file of a cut goes through:

- :func:`capture_sharded`, on every rank between two steps: a CPU copy of this rank's shards
  (model and optimizer, as ``get_state_dict`` gives them); training may go on afterwards;
- :func:`save_sharded`, on every rank at once: each rank streams its shards straight into
  ``<folder>/trainer/dcp/__<rank>_<n>.distcp`` (size and sha256 computed as the bytes go out,
  no local copy), the coordinator (rank 0 of the group) the index ``trainer/dcp/.metadata``;
  each returns the :class:`ShardFile` s it wrote, for the cut's manifest;
- :func:`load_sharded`, on every rank of the restoring world at once, whatever the number of
  ranks that saved (DCP reshards): every file is checked against the manifest's size and
  sha256 *before* anything reads it (the index is unpickled, so this matters); then
  :func:`apply_sharded` puts the loaded state into the model and optimizer.

Collectives go through ``process_group`` (the default group when None; a single process with
no process group at all works too). Use a gloo group: DCP's collectives exchange pickled
plans, and a group of its own lets a cut's write run beside a training step whose collectives
use another group.
"""

from __future__ import annotations

import copy
import hashlib
import io
import os
import pickle
import shutil
import tempfile
import threading
import warnings
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from spotrl_runtime.api.times import Deadline
from spotrl_runtime.checkpoint.sharded_cut import ShardedCut, ShardError
from spotrl_runtime.checkpoint.trainer_state import HashingWriter, ShardFile
from spotrl_runtime.core.validation import DCP_FORMAT, DCP_INDEX, INDEX_ROLE, SHARD_ROLE
from spotrl_runtime.storage import (
    LocalStorage,
    ObjectNotFoundError,
    Storage,
    StorageDeadlineError,
    StorageError,
    current_deadline,
    deadline_scope,
)

__all__ = [
    "DCP_DIR",
    "DCP_FORMAT",
    "DCP_INDEX",
    "INDEX_ROLE",
    "SHARD_ROLE",
    "ShardError",
    "ShardFile",
    "ShardedCut",
    "apply_sharded",
    "capture_sharded",
    "load_sharded",
    "save_sharded",
    "sharded_state",
]

DCP_DIR = "trainer/dcp"
"""Where a sharded cut's files go inside the cut's data folder."""

_HASH_CHUNK = 8 * 1024 * 1024


# ------------------------------------------------------------------ state dicts


def _options(model: torch.nn.Module) -> StateDictOptions:
    """What a cut holds of ``model``: the parameters it trains. A LoRA policy's frozen base is
    left out (it is the base model's files, identified in the cut by its digest)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards as DCP saves and loads them: ``{"model": ..., "optimizer": ...}`` from
    ``get_state_dict`` (DTensors under FSDP2; plain tensors in one process), no copy, frozen
    parameters left out. An optimizer that has not stepped yet gets its state created (zeros),
    so it can be loaded into."""
    options = _options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    if options.ignore_frozen_params:
        # A tied LM head is the frozen embedding under a second name, which named_parameters()
        # lists once: get_state_dict keeps it, a vocabulary x hidden tensor of the base (233 M values
        # of a 1.5B Qwen's) in every cut. What trains is named once, so that is what stays.
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        model_state = {k: v for k, v in model_state.items() if k in trained}
    return {"model": model_state, "optimizer": optim_state}


def capture_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A copy of this rank's shards in CPU memory (:func:`sharded_state`, every tensor and
    DTensor's local shard cloned), which training may go on mutating afterwards. Call it between
    steps; it issues no collective."""
    return _cpu_clone(sharded_state(model, optimizer))


def apply_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Puts a state :func:`load_sharded` filled into ``model`` and ``optimizer`` (``set_state_dict``)."""
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=_options(model)
    )


@torch.no_grad()
def _cpu_clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):  # a DTensor too: its local shard is copied, its placement kept
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: _cpu_clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu_clone(v) for v in obj)
    return copy.deepcopy(obj)


# ------------------------------------------------------------------------ save


class _StorageWriteFS(FileSystemBase):
    """DCP's file system for a save: keys of ``storage``. A file is one streamed object; the
    index goes to a small buffer first and appears at DCP's "rename" (one put)."""

    def __init__(self, storage: Storage, folder: str, deadline: Deadline | None):
        self.storage = storage
        self.folder = folder
        self.deadline = deadline  # DCP's writer threads do not inherit the caller's deadline_scope
        self.written: list[ShardFile] = []
        self._pending: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _name(self, key: str) -> str:
        return key[len(self.folder) + 1 :]

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        key = str(path)
        if mode != "wb":
            raise ValueError(f"a sharded save opens files to write, not {mode!r}")
        if key.endswith(".tmp"):  # the index, before its rename
            buffer = io.BytesIO()
            yield buffer
            with self._lock:
                self._pending[key] = buffer.getvalue()
            return
        with deadline_scope(self.deadline), self.storage.open_write(key) as f:
            stream = HashingWriter(f)
            yield cast(io.IOBase, stream)
        with self._lock:
            self.written.append(ShardFile(self._name(key), SHARD_ROLE, stream.size, stream.sha256.hexdigest()))

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        old, new = str(path), str(new_path)
        with self._lock:
            data = self._pending.pop(old, None)
        with deadline_scope(self.deadline):
            if data is None:  # not ours to hold: a copy and a delete (small objects only)
                data = self.storage.get_bytes(old)
                self.storage.put_bytes(new, data)
                self.storage.delete(old)
            else:
                self.storage.put_bytes(new, data)
        role = INDEX_ROLE if new.endswith("/.metadata") else SHARD_ROLE
        with self._lock:
            self.written.append(ShardFile(self._name(new), role, len(data), hashlib.sha256(data).hexdigest()))

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        pass  # a store has no folders

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # only ever given to DCP as an explicit storage_writer

    def exists(self, path: str | os.PathLike[str]) -> bool:
        key = str(path)
        if key in self._pending:
            return True
        with deadline_scope(self.deadline):
            return self.storage.head(key) is not None

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        key = str(path)
        if self._pending.pop(key, None) is None:
            with deadline_scope(self.deadline):
                self.storage.delete(key)


class _StorageWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (one file per rank and writer thread, torch.save records)
    over :class:`_StorageWriteFS`; no fsync (the store makes an object durable when it appears)."""

    def __init__(self, storage: Storage, folder: str, *, thread_count: int):
        super().__init__(
            f"{folder}/{DCP_DIR}",
            single_file_per_rank=True,
            sync_files=False,
            thread_count=thread_count,
            # The state is in CPU memory already (capture_sharded): the overlapping loader would
            # only synchronise the CUDA stream a training step is using.
            per_thread_copy_ahead=0,
            overwrite=False,
        )
        self.files = _StorageWriteFS(storage, folder, current_deadline())
        self.fs = cast(Any, self.files)
        self.path = f"{folder}/{DCP_DIR}"


def save_sharded(
    state: dict[str, Any],
    storage: Storage,
    folder: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int = 1,
    no_dist: bool = False,
) -> list[ShardFile]:
    """Writes ``state`` (:func:`capture_sharded`'s) under ``<folder>/trainer/dcp/`` of ``storage``;
    every rank of ``process_group`` calls it at once. Returns the files this rank wrote (the
    coordinator's include the index), each with its size and sha256.

    Every storage call is bounded by the :func:`~spotrl_runtime.storage.deadline_scope` in
    force when it is called (the writer threads included). A rank that fails fails every rank:
    :class:`~spotrl_runtime.storage.StorageDeadlineError` when a deadline was missed, the
    failing rank's :class:`~spotrl_runtime.storage.StorageError` or :class:`ShardError`, else a
    RuntimeError naming the ranks and their errors. Files already written stay (the cut writer
    removes its folder). ``no_dist``: this process saves alone, even inside a process group.
    """
    writer = _StorageWriter(storage, folder, thread_count=thread_count)
    single = _no_dist(no_dist)
    try:
        with _quiet(single):
            dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=single)
    except CheckpointException as err:
        raise _unwrap(err, f"saving the shards to {storage.uri}/{folder}/{DCP_DIR}") from None
    return sorted(writer.files.written, key=lambda f: f.name)


# ------------------------------------------------------------------------ load


class _VerifiedFiles(FileSystemBase):
    """DCP's file system for a load: a file opens only once it matches the manifest's size and
    sha256. A local store's file is read in place (hashed through the same handle that reads
    it); another store's is downloaded once into a spool folder, then checked."""

    def __init__(
        self, storage: Storage, folder: str, files: Mapping[str, tuple[int, str]], spool_dir: Path | None
    ) -> None:
        self.storage = storage
        self.folder = folder
        self.files = files
        self.spool_parent = spool_dir
        self.deadline = current_deadline()
        self._spool: Path | None = None
        self._spooled: dict[str, Path] = {}

    def close(self) -> None:
        """Removes the downloaded copies."""
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
            self._spool = None
            self._spooled.clear()

    def _where(self, name: str) -> str:
        return f"{self.storage.uri}/{self.folder}/{name}"

    def open_verified(self, name: str) -> BinaryIO:
        """``name`` (relative to the cut's data folder), opened for reading, once it is checked."""
        if name not in self.files:
            raise ShardError(
                f"{name}: the checkpoint needs this file but the cut's manifest does not list it "
                "(a shard written after the manifest, or an index that names foreign files)",
                name,
            )
        key = f"{self.folder}/{name}"
        if isinstance(self.storage, LocalStorage):
            try:
                f = open(self.storage.path_of(key), "rb")  # noqa: SIM115 - returned to the caller
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise ShardError(f"{name}: listed in the manifest but missing from {self._where(name)}", name) from None
            try:
                self._check(name, f)
            except BaseException:
                f.close()
                raise
            f.seek(0)
            return f
        if name not in self._spooled:
            if self._spool is None:
                if self.spool_parent is not None:
                    self.spool_parent.mkdir(parents=True, exist_ok=True)
                self._spool = Path(tempfile.mkdtemp(prefix="spotrl-shards-", dir=self.spool_parent))
            target = self._spool / name.replace("/", "__")
            try:
                with deadline_scope(self.deadline):
                    self.storage.download_file(key, target)
            except ObjectNotFoundError:
                raise ShardError(f"{name}: listed in the manifest but missing from {self._where(name)}", name) from None
            with open(target, "rb") as f:
                self._check(name, f)
            self._spooled[name] = target
        return open(self._spooled[name], "rb")

    def _check(self, name: str, f: BinaryIO) -> None:
        size, digest = self.files[name]
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            raise ShardError(f"{name}: is {actual} bytes, the manifest says {size} (truncated, torn or replaced)", name)
        h = hashlib.sha256()
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
        if h.hexdigest() != digest:
            raise ShardError(
                f"{name}: sha256 is {h.hexdigest()[:16]}…, the manifest says {digest[:16]}… (changed after the cut)",
                name,
            )

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise ValueError(f"a sharded load opens files to read, not {mode!r}")
        name = str(path)
        with self.open_verified(name) as f:
            try:
                yield cast(io.IOBase, f)
            except (ShardError, StorageError):
                raise
            except Exception as err:
                raise ShardError(
                    f"{name}: matches the manifest but does not load into this state ({type(err).__name__}: "
                    f"{str(err)[:300]})",
                    name,
                ) from err

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return str(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        raise NotImplementedError("a sharded load writes nothing")

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        raise NotImplementedError("a sharded load writes nothing")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return str(path) in self.files

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        raise NotImplementedError("a sharded load writes nothing")


class _StorageReader(FileSystemReader):
    """DCP's ``FileSystemReader`` over :class:`_VerifiedFiles`, with the index read (and checked)
    beforehand: DCP swallows a failure to read the index and would report another one."""

    def __init__(self, files: _VerifiedFiles, metadata: Metadata):
        super().__init__(DCP_DIR)
        self.fs = cast(Any, files)
        self.path = DCP_DIR
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        assert self._metadata.storage_meta is not None
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def _read_index(files: _VerifiedFiles) -> Metadata:
    with files.open_verified(DCP_INDEX) as f:
        try:
            metadata = pickle.load(f)  # its bytes matched the manifest's sha256: as trusted as the manifest
        except Exception as err:
            raise ShardError(
                f"{DCP_INDEX}: matches the manifest but is not a DCP index ({type(err).__name__}: {err})", DCP_INDEX
            ) from None
    if not isinstance(metadata, Metadata):
        raise ShardError(f"{DCP_INDEX}: holds a {type(metadata).__name__}, not a DCP index", DCP_INDEX)
    return metadata


def load_sharded(
    state: dict[str, Any],
    storage: Storage,
    folder: str,
    files: Mapping[str, tuple[int, str]],
    *,
    process_group: dist.ProcessGroup | None = None,
    spool_dir: Path | None = None,
    no_dist: bool = False,
) -> None:
    """Loads the shards under ``<folder>/trainer/dcp/`` into ``state`` in place; every rank of
    ``process_group`` calls it at once, each with :func:`sharded_state` (or
    :func:`capture_sharded`) of its own model and optimizer: DCP reshards, so any number of
    ranks loads what any number saved. Then :func:`apply_sharded`.

    ``files`` is the manifest's: name (relative to ``folder``, as :attr:`ShardFile.name`) ->
    (size, sha256). A file DCP needs that is not listed, is missing, or whose bytes differ
    raises :class:`ShardError` naming it, on every rank, before anything reads it; one that
    matches and still does not load raises :class:`ShardError` naming it too. A remote store's
    files are downloaded once into ``spool_dir`` (default: the system's temporary folder) and
    removed afterwards. ``no_dist``: this process loads alone, even inside a process group.
    """
    single = _no_dist(no_dist)
    verified = _VerifiedFiles(storage, folder, files, spool_dir)
    try:
        failure: tuple[str, str | None, bool] | None = None
        metadata: Metadata | None = None
        try:
            metadata = _read_index(verified)
        except (ShardError, StorageError) as err:
            failure = (str(err), getattr(err, "file", None), isinstance(err, ShardError))
        if not single:
            # Every rank reads the index; all of them stop if one cannot (none waits in DCP for it).
            failures: list[tuple[str, str | None, bool] | None] = [None] * dist.get_world_size(process_group)
            dist.all_gather_object(failures, failure, group=process_group)
            failure = next((f for f in failures if f is not None), None)
        if failure is not None:
            message, file, is_shard = failure
            raise ShardError(message, file) if is_shard else RuntimeError(message)
        assert metadata is not None
        try:
            with _quiet(single):
                dcp.load(
                    state,
                    storage_reader=_StorageReader(verified, metadata),
                    process_group=process_group,
                    no_dist=single,
                )
        except CheckpointException as err:
            raise _unwrap(err, f"loading the shards from {storage.uri}/{folder}/{DCP_DIR}") from None
    finally:
        verified.close()


# ---------------------------------------------------------------------- shared


def _no_dist(no_dist: bool) -> bool:
    return no_dist or not (dist.is_available() and dist.is_initialized())


@contextmanager
def _quiet(single: bool) -> Iterator[None]:
    """Without DCP's warning that it assumes one process: here that is asked for. (Only then:
    the warning filters are the process's, and a rank's save runs beside its training thread.)"""
    if not single:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _unwrap(err: CheckpointException, what: str) -> BaseException:
    """The error to raise for a DCP failure (a BaseException that gathers every rank's): a
    missed deadline first, then a file's error, then a store's, else a RuntimeError naming all."""
    failures = [(rank, exc) for rank, (exc, _) in sorted(err.failures.items())]
    for kind in (StorageDeadlineError, ShardError, StorageError):
        for _, exc in failures:
            if isinstance(exc, kind):
                return exc
    detail = "; ".join(f"rank {rank}: {type(exc).__name__}: {str(exc)[:300]}" for rank, exc in failures)
    return RuntimeError(f"{what} failed ({detail})")
