"""The trainer's part of a cut: policy weights, optimizer state and RNG states.

A single-process trainer writes plain ``state_dict``s with ``torch.save`` (format
``torch.save/v2``: the weights in parts ``trainer/weights-00001-of-0000N.pt`` of about
128 MiB each, written side by side, then ``trainer/optimizer.pt``, ``trainer/rng.pt``;
``torch.save/v1``, one ``trainer/weights.pt``, is still read), without the zip's per-record
CRC32: each file's sha256 is in the manifest and checked first. A
trainer group of FSDP2 ranks writes ``dcp/v1`` (:mod:`~spotrl_runtime.checkpoint.sharded`):
every rank its own shards through ``torch.distributed.checkpoint``, listed in the same
manifest (roles ``trainer-shard`` and ``trainer-shard-index``) as a
:class:`ShardedTrainerSnapshot`'s ``write`` returns them. Both formats add
``trainer/meta.json`` (``trainer_step`` ...); the cut writer and the validation chain see
only paths, sizes and digests.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import torch

from spotrl_runtime.core.cut_format import TORCH_SAVE_FORMAT, TORCH_SAVE_V1, weight_part_name
from spotrl_runtime.core.validation import DCP_FORMAT

if TYPE_CHECKING:
    from spotrl_runtime.api.times import Deadline
    from spotrl_runtime.storage import Storage


@dataclass(frozen=True)
class TrainerSnapshot:
    """The trainer's state at one step: CPU copies the trainer no longer mutates."""

    weights: Mapping[str, Any]
    optimizer: Mapping[str, Any] | None = None
    rng: Mapping[str, Any] | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    """Small JSON facts (weight_version, model name ...)."""


@dataclass(frozen=True)
class ShardFile:
    """One file a rank of a trainer group wrote into a cut, as the manifest lists it."""

    name: str
    """Relative to the cut's data folder: ``trainer/dcp/__0_0.distcp``, ``trainer/dcp/.metadata``."""
    role: str
    """``trainer-shard`` or ``trainer-shard-index`` (the ``.metadata`` file)."""
    size: int
    sha256: str


@dataclass(frozen=True)
class ShardedTrainerSnapshot:
    """A trainer group's state at one step, captured on its ranks, written by ``write`` later.

    ``write(storage, folder, deadline)`` has every rank write its shards under ``folder`` (the
    cut's data folder, relative to the store's root) and returns every file written, with size
    and sha256; it must return only once every rank is done (or has failed), and raise if any
    rank failed: the cut writer then removes the folder and commits nothing. Bounded by
    ``deadline`` (a barrier cut's; None for a periodic one): a write that runs out of time
    raises :class:`~spotrl_runtime.storage.StorageDeadlineError` (or anything, once the
    deadline has passed). The cut writer adds ``trainer/meta.json`` (JSON of ``meta``, which
    holds ``trainer_step``)."""

    meta: Mapping[str, Any]
    write: Callable[[Storage, str, Deadline | None], list[ShardFile]]
    format_name: str = DCP_FORMAT


def cpu_copy(obj: Any) -> Any:
    """A deep copy of a (nested) state_dict with every tensor copied to CPU memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cpu_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(cpu_copy(v) for v in obj)
    return obj


def capture_rng() -> dict[str, Any]:
    """The process's RNG states: Python's, torch's CPU generator, and every CUDA device's."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Puts the RNG states of :func:`capture_rng` back."""
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def snapshot_trainer(
    model_state: Mapping[str, Any],
    optimizer_state: Mapping[str, Any] | None = None,
    *,
    step: int,
    meta: Mapping[str, Any] | None = None,
    with_rng: bool = True,
) -> TrainerSnapshot:
    """The usual ``state_fn`` body: CPU copies of the model's and optimizer's state_dicts, plus RNG.

    Call it under the cut's lock (inside the function passed to ``Owners.capture``), so the
    copy matches the trainer step the cut records; the files are written after the lock
    is released. ``step`` is the trainer's own count of optimizer steps; it goes into
    ``trainer/meta.json``, and check ``trainer_state`` compares it with the cut's.
    """
    return TrainerSnapshot(
        weights=cpu_copy(model_state),
        optimizer=cpu_copy(optimizer_state) if optimizer_state is not None else None,
        rng=capture_rng() if with_rng else None,
        meta={**(meta or {}), "trainer_step": step},
    )


class LentTrainerState:
    """The trainer's state lent to a cut by reference: its live tensors, not copies.

    Taken under the cut's lock in microseconds (no tensor is copied there). Until
    :meth:`released` the trainer must not change those tensors: :class:`Trainer` waits for
    it just before its next optimizer step (:meth:`wait_released`). Two ways to end the loan:

    - ``copy=True`` (periodic cuts): a background thread copies every tensor to CPU memory
      at once and ends the loan when the copy is done, while the trainer computes the next
      step's gradients (which reads the weights but changes neither them nor the optimizer's
      moments). The cut writer then writes the copy (:meth:`resolve` waits for it).
    - ``copy=False`` (a barrier: the trainer is parked and never steps again): nothing is
      copied; the cut writer serialises the live tensors and ends the loan once its trainer
      files are written, or the cut failed (:meth:`release`).

    ``buffers``: CPU tensors reused across cuts (:class:`BufferPool`), so that a periodic
    cut's copy does not page-fault a fresh gigabyte each time.
    """

    def __init__(self, live: TrainerSnapshot, *, copy: bool, buffers: BufferPool | None = None):
        self._live = live
        self._copy = copy
        self._released = threading.Event()
        self._copied: TrainerSnapshot | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.copy_seconds = 0.0
        self._buffers = buffers
        self._bufs: dict[tuple[str, ...], torch.Tensor] = {}
        if copy:
            threading.Thread(target=self._copy_now, name="trainer-state-copy", daemon=True).start()
        else:
            self._done.set()

    def _copy_now(self) -> None:
        import time

        t0 = time.perf_counter()
        try:
            live = self._live
            bufs = self._buffers.take() if self._buffers is not None else {}
            self._copied = TrainerSnapshot(
                weights=copy_into(live.weights, bufs, ("weights",)),
                optimizer=None if live.optimizer is None else copy_into(live.optimizer, bufs, ("optimizer",)),
                rng=live.rng,
                meta=live.meta,
            )
            self._bufs = bufs
        except BaseException as err:  # the cut fails with it; the trainer goes on
            self._error = err
        finally:
            self.copy_seconds = time.perf_counter() - t0
            self._released.set()
            self._done.set()

    @property
    def meta(self) -> Mapping[str, Any]:
        return self._live.meta

    def resolve(self, timeout: float | None = None) -> TrainerSnapshot:
        """The snapshot to write: the copy (waiting for it), or the live state when lent."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the trainer state's copy was not done within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"copying the trainer state failed: {self._error}") from self._error
        if self._copy:
            if self._copied is None:
                raise RuntimeError("the trainer state's copy was already written and its buffers reused")
            return self._copied
        return self._live

    def release(self) -> None:
        """Ends the loan: the trainer may change its tensors again (the writer is done with them)."""
        self._released.set()

    def finished(self) -> None:
        """The cut writer is done with the copy (written, or failed): ends the loan, and gives
        the copy's buffers back to the pool for the next cut. The snapshot must not be read after."""
        self._released.set()
        if self._copy and self._done.is_set() and self._buffers is not None and self._bufs:
            self._buffers.give(self._bufs)
            self._bufs = {}
            self._copied = None

    def released(self) -> bool:
        return self._released.is_set()

    def wait_released(self, timeout: float | None = None) -> bool:
        return self._released.wait(timeout)


class BufferPool:
    """CPU tensors reused from one periodic cut's copy to the next, by path and shape.

    :meth:`take` hands a set of buffers to one copy; :meth:`give` takes them back once the
    cut that wrote them is done with them (:meth:`LentTrainerState.finished`), so two live
    snapshots never share a buffer. A copy that finds the pool empty allocates fresh ones.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[dict[tuple[str, ...], torch.Tensor]] = []

    def take(self) -> dict[tuple[str, ...], torch.Tensor]:
        with self._lock:
            return self._free.pop() if self._free else {}

    def give(self, buffers: dict[tuple[str, ...], torch.Tensor]) -> None:
        with self._lock:
            self._free = [buffers]  # one spare set is enough: cuts are written one at a time


def copy_into(obj: Any, buffers: dict[tuple[str, ...], torch.Tensor], path: tuple[str, ...] = ()) -> Any:
    """Like :func:`cpu_copy`, but into ``buffers`` (by path) where one of the right shape and
    dtype is there; the buffers used end up in ``buffers`` (the others are dropped)."""
    if isinstance(obj, torch.Tensor):
        src = obj.detach()
        buf = buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or buf.device.type != "cpu":
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu")
            buffers[path] = buf
        buf.copy_(src)
        return buf
    if isinstance(obj, Mapping):
        return {k: copy_into(v, buffers, (*path, str(k))) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_into(v, buffers, (*path, str(i))) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(copy_into(v, buffers, (*path, str(i))) for i, v in enumerate(obj))
    return obj


@dataclass(frozen=True)
class TrainerFile:
    """One file a trainer format writes: path inside the cut's data folder, role, and a writer."""

    name: str
    role: str
    write: Callable[[IO[bytes]], None]


class TrainerStateFormat(Protocol):
    """How a trainer snapshot becomes files of a cut, and back."""

    name: str
    """The format it writes (the manifest's ``trainer_format``)."""
    reads: tuple[str, ...]
    """The formats it loads."""

    def files(self, snapshot: TrainerSnapshot) -> list[TrainerFile]: ...

    def load(self, paths: Mapping[str, Sequence[Path]]) -> TrainerSnapshot:
        """Reads a snapshot back from local files: role -> the role's files, in path order."""
        ...


WEIGHT_PART_BYTES = 128 << 20
MAX_WEIGHT_PARTS = 8


def weight_parts(
    weights: Mapping[str, Any], part_bytes: int | None = None, max_parts: int | None = None
) -> list[dict[str, Any]]:
    """Splits a state_dict into parts of about ``part_bytes`` (at most ``max_parts``), so that
    they are serialised, hashed and written side by side: one file's sha256 runs on one core.
    Entries that share a storage (tied weights) stay in one part, so that ``torch.save`` keeps
    them one storage; every part keeps the state_dict's key order; the split depends only on
    the keys and sizes. No part is empty. Defaults: :data:`WEIGHT_PART_BYTES`,
    :data:`MAX_WEIGHT_PARTS`."""
    part_bytes = part_bytes or WEIGHT_PART_BYTES
    max_parts = max_parts or MAX_WEIGHT_PARTS
    groups: dict[Any, list[str]] = {}
    sizes: dict[Any, int] = {}
    for key, value in weights.items():
        if isinstance(value, torch.Tensor) and value.numel():
            storage = value.untyped_storage()
            ident: Any = (value.device.type, storage.data_ptr())
            sizes[ident] = storage.nbytes()
        else:
            ident, sizes[key] = key, 0
        groups.setdefault(ident, []).append(key)
    total = sum(sizes.values())
    n = max(1, min(max_parts, len(groups), -(-total // part_bytes)))
    loads = [0] * n
    part_of: dict[str, int] = {}
    # Largest first, each to the lightest part (ties: the lowest index): balanced and stable.
    for ident in sorted(groups, key=lambda i: -sizes[i]):
        target = min(range(n), key=lambda p: (loads[p], p))
        loads[target] += sizes[ident]
        for key in groups[ident]:
            part_of[key] = target
    parts: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, value in weights.items():
        parts[part_of[key]][key] = value
    return [p for p in parts if p]


class TorchSaveFormat:
    """``torch.save/v2``: the weights in parts (:func:`weight_parts`), the optimizer and the RNG
    in a file each, every file loaded with ``weights_only=True``. Reads ``torch.save/v1`` too
    (the weights in one ``trainer/weights.pt``)."""

    name = TORCH_SAVE_FORMAT
    reads = (TORCH_SAVE_V1, TORCH_SAVE_FORMAT)

    def files(self, snapshot: TrainerSnapshot) -> list[TrainerFile]:
        parts = weight_parts(snapshot.weights)
        out = [TrainerFile(weight_part_name(i, len(parts)), "weights", _saver(part)) for i, part in enumerate(parts, 1)]
        if snapshot.optimizer is not None:
            out.append(TrainerFile("trainer/optimizer.pt", "optimizer", _saver(dict(snapshot.optimizer))))
        if snapshot.rng is not None:
            out.append(TrainerFile("trainer/rng.pt", "rng", _saver(dict(snapshot.rng))))
        meta = json.dumps(dict(snapshot.meta), sort_keys=True).encode("utf-8")

        def write_meta(f: IO[bytes]) -> None:
            f.write(meta)

        out.append(TrainerFile("trainer/meta.json", "trainer_meta", write_meta))
        return out

    def load(self, paths: Mapping[str, Sequence[Path]]) -> TrainerSnapshot:
        def load(role: str) -> Any:
            found = paths.get(role, ())
            if len(found) > 1:
                raise ValueError(f"{len(found)} files have the role {role}; one is written")
            return torch.load(found[0], map_location="cpu", weights_only=True) if found else None

        weights: dict[str, Any] = {}
        for path in paths.get("weights", ()):
            part = torch.load(path, map_location="cpu", weights_only=True)
            twice = sorted(weights.keys() & part.keys())
            if twice:
                raise ValueError(f"{path.name} holds {twice[0]!r}, which an earlier weights file holds too")
            weights.update(part)
        meta = json.loads(paths["trainer_meta"][0].read_bytes()) if paths.get("trainer_meta") else {}
        return TrainerSnapshot(weights=weights, optimizer=load("optimizer"), rng=load("rng"), meta=meta)


def _saver(obj: Any) -> Callable[[IO[bytes]], None]:
    def write(f: IO[bytes]) -> None:
        with _without_zip_crc32():
            torch.save(obj, f)

    return write


_CRC32_LOCK = threading.Lock()
_CRC32_USERS = 0
_CRC32_BEFORE = True


@contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """``torch.save`` without the zip CRC32 of each record, while any cut file is being written.

    A cut file's bytes are covered by its sha256 in the manifest, which the validation chain
    checks before anything loads it, so the zip's own CRC32 adds nothing but a second pass
    over every byte, a sizeable share of ``torch.save`` + fsync (``bench/bench_barrier.py``;
    docs/benchmarks.md). ``torch.load`` does not check it. The switch is torch's one
    process-wide flag; it is off while at least one cut file is written (the trainer's files go
    side by side) and restored to what it was after the last."""
    global _CRC32_USERS, _CRC32_BEFORE
    with _CRC32_LOCK:
        if _CRC32_USERS == 0:
            _CRC32_BEFORE = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _CRC32_USERS += 1
    try:
        yield
    finally:
        with _CRC32_LOCK:
            _CRC32_USERS -= 1
            if _CRC32_USERS == 0:
                torch.serialization.set_crc32_options(_CRC32_BEFORE)


_HASHERS: ThreadPoolExecutor | None = None
_HASHERS_LOCK = threading.Lock()
OVERLAP_BYTES = 1 << 20
"""A write at least this big is hashed on a helper thread while it is written: sha256 and a
file's write both release the GIL, so a tensor's bytes cost the slower of the two, not both
(bench/bench_cut_weights.py)."""


def _hashers() -> ThreadPoolExecutor:
    global _HASHERS
    with _HASHERS_LOCK:
        if _HASHERS is None:
            _HASHERS = ThreadPoolExecutor(4, thread_name_prefix="cut-sha256")
        return _HASHERS


class HashingWriter(io.RawIOBase):
    """A write-only file that hashes and counts what passes through to ``inner``: a trainer
    file of a cut, or one file DCP writes a rank's shards into (``tell`` is the count). Closing
    it leaves ``inner`` open: the store commits the object when its own ``open_write`` ends."""

    def __init__(self, inner: IO[bytes]):
        super().__init__()
        self.inner = inner
        self.sha256 = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= OVERLAP_BYTES:
            # In order: the previous write's hash is done (each waits for its own), and the
            # caller may reuse ``data`` once this returns, so this one's is done too.
            hashed = _hashers().submit(self.sha256.update, view)
            try:
                self.inner.write(view)
            finally:
                hashed.result()
        else:
            self.sha256.update(view)
            self.inner.write(view)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        if not self.closed:
            self.inner.flush()
