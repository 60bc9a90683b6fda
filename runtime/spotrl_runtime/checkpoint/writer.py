"""The one cut writer, for periodic and barrier cuts alike.

A cut is written in this order, and exists only once step 5 succeeds:

1. capture: :meth:`Owners.capture` copies every owner under the ownership lock (and the
   trainer's state, through ``state_fn``). This is the only part that holds the lock. The
   trainer's tensors are not copied there: they are lent by reference
   (:class:`~spotrl_runtime.checkpoint.trainer_state.LentTrainerState`), copied in the
   background for a periodic cut or written live for a barrier, and the trainer waits for
   them only at its next optimizer step; the writer ends the loan when its files are written.
2. id and fence: the id is the newest committed cut's + 1. A controller whose attempt is
   older than the newest cut's writer is stale and stops (:class:`CutConflictError`), and so
   is one that a newer attempt has fenced (:class:`~spotrl_runtime.checkpoint.fence.FencedError`,
   checked here and again just before the manifest).
3. files: each owner file and each trainer file goes to a fresh folder
   ``cuts/<id>/<writer>/``; its size and sha256 are computed as it is written (the trainer's
   files side by side, one thread each). A trainer
   group's state (:class:`~spotrl_runtime.checkpoint.trainer_state.ShardedTrainerSnapshot`) is
   written by its ranks, each reporting its files' sizes and digests (format ``dcp/v1``).
4. deadline: a barrier cut that is past its deadline stops here, before committing. Every
   storage call of a barrier cut is bounded by its deadline (a stalled request is abandoned);
   a cut that runs out of time raises :class:`BarrierDeadlineMissedError`.
5. manifest: ``cuts/<id>/manifest.json``, create-only, naming every file with its size and
   digest, the schema version and the group counts. If another writer committed this id
   first, the create-only write refuses and this writer stops (:class:`CutConflictError`).
   If the write fails otherwise, the manifest is read back: our bytes there mean the cut is
   committed; another writer's mean a conflict; none, or an unreadable manifest, mean the
   cut is not (or not known to be) committed, and the files are kept unless the write
   certainly never reached the store: the files of a manifest that landed are never removed.
6. pointer: ``LATEST.json`` names the new cut (only after its manifest exists); files of
   other writers under the same id (a crashed or refused writer) are removed.
7. retention (:func:`kept_chains`): a full cut and the delta cuts that extend it count as
   one kept cut; the newest ``keep`` such chains stay, and so does the full cut the next delta
   would extend. The rest is deleted (manifest first), and so are torn folders older than the
   oldest kept cut.

A **delta cut** (``CutRequest.form == "delta"``, :mod:`spotrl_runtime.core.redo`) writes the
owner files and the redo log since :attr:`CutWriter.base`, the newest full cut, and no trainer
state: its size does not grow with the model. Every full cut this writer commits becomes the
base of the deltas after it.

A crash anywhere before step 5 leaves a torn folder and no cut; the previous committed
cut is untouched, and the next writer reuses the id. A failed cut removes its own files
when they can never be committed (before step 5; past a barrier's deadline it gets
``CLEANUP_GRACE`` seconds for that).
"""

from __future__ import annotations

import contextvars
import datetime as dt
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any, Literal, cast

from spotrl_runtime.api.times import Deadline
from spotrl_runtime.checkpoint.fence import Fence
from spotrl_runtime.checkpoint.layout import (
    POINTER,
    cut_dir,
    cut_id_of,
    list_cut_folders,
    manifest_key,
    read_pointer,
    seq_of,
)
from spotrl_runtime.checkpoint.trainer_state import (
    HashingWriter,
    LentTrainerState,
    ShardedTrainerSnapshot,
    TorchSaveFormat,
    TrainerFile,
    TrainerSnapshot,
    TrainerStateFormat,
)
from spotrl_runtime.core.cut_format import (
    DELTA_FILES,
    OWNER_AND_EPISODE_FILES,
    SCHEMA_VERSION,
    DeltaNotCoveredError,
    Manifest,
    ManifestFile,
    encode_delta_files,
    encode_owner_files,
    snapshot_counts,
)
from spotrl_runtime.core.owners import CutTimeoutError, Owners, OwnersSnapshot
from spotrl_runtime.core.redo import DeltaBase
from spotrl_runtime.core.validation import DCP_FORMAT, DCP_INDEX, INDEX_ROLE, SHARD_ROLE
from spotrl_runtime.storage import (
    ObjectExistsError,
    ObjectNotFoundError,
    Storage,
    StorageDeadlineError,
    StorageError,
    current_deadline,
    deadline_scope,
)

log = logging.getLogger(__name__)

CLEANUP_GRACE = 2.0
"""Seconds a failed barrier cut may spend past its deadline removing its own files."""

CutKind = Literal["periodic", "barrier"]
CutForm = Literal["full", "delta"]


class CutError(RuntimeError):
    """A cut that was not committed; the previous committed cut still stands."""


class BarrierDeadlineMissedError(CutError):
    """A barrier cut could not commit before its deadline; nothing was committed."""


class CutConflictError(CutError):
    """Another writer committed this cut id first: two controllers are writing one job's cuts."""


@dataclass(frozen=True)
class CutRequest:
    """What kind of cut to take, why, and (for a barrier) by when it must commit."""

    kind: CutKind = "periodic"
    deadline: Deadline | None = None
    reason: str = ""
    form: CutForm = "full"
    """``delta``: the owners and the redo log since the writer's base, no trainer state."""

    @classmethod
    def periodic(cls, reason: str = "") -> CutRequest:
        """A periodic cut: no deadline."""
        return cls("periodic", None, reason)

    @classmethod
    def barrier(cls, deadline: Deadline, reason: str = "", form: CutForm = "full") -> CutRequest:
        """A barrier cut that must commit before ``deadline``."""
        return cls("barrier", deadline, reason, form)

    def remaining(self) -> float | None:
        """Seconds left before the deadline (None: no deadline)."""
        return None if self.deadline is None else self.deadline.remaining()


@dataclass(frozen=True)
class CommittedCut:
    """A cut that exists: its id, where it is, its manifest, and how long each part took."""

    cut_id: str
    uri: str
    manifest: Manifest
    timings: Mapping[str, float] = field(default_factory=dict)
    """Seconds: capture (lock held), files, manifest, pointer, retention, total."""
    bytes_written: int = 0


def kept_chains(committed: list[str], bases: Mapping[str, str | None], keep: int, next_base: str | None) -> set[str]:
    """The committed cuts retention keeps: the newest ``keep`` full cuts with every delta that
    extends one of them, and ``next_base`` (the full cut the next delta extends) with its deltas.
    ``committed`` is in cut order; ``bases`` maps each cut to the full cut it extends (None: full)."""
    fulls = [c for c in committed if bases.get(c) is None]
    chains = set(fulls[-keep:]) | ({next_base} if next_base is not None else set())
    return {c for c in committed if c in chains or bases.get(c) in chains}


class CutWriter:
    """Writes cuts of one job into ``storage`` (the job's root). One cut at a time.

    ``dataset`` describes the prompt source (at least ``uri`` and ``size``); restore
    compares it with the dataset it is given. ``progress`` is called with each phase name
    ("captured", "files_written", "committed", "retention") and the cut's trainer step, for
    telemetry and failpoints.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        job: str,
        dataset: Mapping[str, Any],
        keep: int = 3,
        trainer_format: TrainerStateFormat | None = None,
        progress: Callable[[str, int], None] | None = None,
        fence: Fence | None = None,
    ):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.storage = storage
        self.job = job
        self.dataset = dict(dataset)
        self.keep = keep
        self.trainer_format = trainer_format or TorchSaveFormat()
        self.progress = progress
        self.fence = fence
        self.parallel_files = True
        """Write the trainer's files (weights, optimizer ...) side by side, one thread each."""
        self.base: DeltaBase | None = None
        """The full cut a delta cut extends: the newest this writer committed, or the one the run
        was restored from (the restore sets it; a delta's base when it resumed from a delta)."""
        self._base_ids: dict[str, str | None] = {}
        """Committed cut id -> the full cut it extends (None: it is full), for retention."""
        self._lock = threading.Lock()

    def write(
        self,
        owners: Owners,
        request: CutRequest,
        state_fn: Callable[[], TrainerSnapshot | None] | None = None,
    ) -> CommittedCut:
        """Captures the owners (and ``state_fn()``'s trainer state) and commits them as a new cut.

        Blocking: run it in a background thread (periodic cuts then write their big files
        asynchronously while training goes on; only the capture pauses ownership moves).
        Raises :class:`BarrierDeadlineMissedError` when the deadline passes first (also while
        waiting for a running optimizer step), :class:`CutConflictError` when another
        controller owns the job's cuts; the previous committed cut stands either way.
        """
        t0 = time.perf_counter()
        with self._lock:
            try:
                snapshot = owners.capture(state_fn, timeout=request.remaining())
            except CutTimeoutError as err:
                raise BarrierDeadlineMissedError(f"{request.kind} cut not taken: {err}") from None
            try:
                self._phase("captured", snapshot.trainer_step)
            except BaseException:
                if isinstance(snapshot.extra, LentTrainerState):
                    snapshot.extra.finished()
                raise
            return self._commit(snapshot, request, t0)

    def write_snapshot(self, snapshot: OwnersSnapshot, request: CutRequest) -> CommittedCut:
        """Commits a snapshot that was captured already (``snapshot.extra`` is the trainer state)."""
        with self._lock:
            return self._commit(snapshot, request, time.perf_counter())

    def _phase(self, name: str, step: int) -> None:
        if self.progress is not None:
            self.progress(name, step)

    def _commit(self, snapshot: OwnersSnapshot, request: CutRequest, t0: float) -> CommittedCut:
        # A barrier cut's every storage call is bounded by its deadline (deadline_scope).
        try:
            with deadline_scope(request.deadline):
                try:
                    return self._commit_bounded(snapshot, request, t0)
                except StorageDeadlineError as err:
                    # Before a cut id was chosen (listing the cuts): nothing was written.
                    raise BarrierDeadlineMissedError(
                        f"{request.kind} cut not committed: {err}; nothing was written (the last committed cut stands)"
                    ) from None
        finally:
            if isinstance(snapshot.extra, LentTrainerState):
                snapshot.extra.finished()  # the trainer may change its tensors again

    def _commit_bounded(self, snapshot: OwnersSnapshot, request: CutRequest, t0: float) -> CommittedCut:
        timings: dict[str, float] = {"capture": snapshot.capture_seconds}
        committed = [f for f in list_cut_folders(self.storage) if f.committed]
        self._fence(committed, snapshot.attempt)
        # The id follows the newest *committed* cut: a torn folder's id is reused (its files
        # sit in another writer's folder, which the manifest does not name), and two writers
        # racing for the next cut pick the same id, so the create-only manifest stops one.
        seq = max((seq_of(f.cut_id) or 0 for f in committed), default=0) + 1
        cut_id = cut_id_of(seq)
        writer = f"w{snapshot.attempt}-{uuid.uuid4().hex[:8]}"
        base = cut_dir(cut_id)
        folder = f"{base}/{writer}/"
        t = time.perf_counter()
        try:
            files = self._write_files(snapshot, request, cut_id, f"{base}/{writer}", writer)
            timings["files"] = time.perf_counter() - t
            self._phase("files_written", snapshot.trainer_step)
            self._check_deadline(request, cut_id)
            manifest = self._manifest(snapshot, request, cut_id, writer, files)
            if self.fence is not None:
                self.fence.check()  # a newer controller claimed the job while the files were written
        except BaseException as err:
            self._remove_folder(folder)
            if isinstance(err, StorageDeadlineError):
                raise BarrierDeadlineMissedError(
                    f"{request.kind} cut {cut_id} missed its deadline while its files were written: {err}; "
                    "it was not committed (the last committed cut stands)"
                ) from None
            raise
        t = time.perf_counter()
        manifest_bytes = manifest.to_bytes()
        try:
            self.storage.put_bytes(manifest_key(cut_id), manifest_bytes, create_only=True)
        except ObjectExistsError:
            self._remove_folder(folder)
            raise CutConflictError(
                f"cut {cut_id} in {self.storage.uri} was committed by another writer first; two controllers "
                "are writing this job's cuts: stop this one"
            ) from None
        except Exception as err:
            self._settle_manifest(cut_id, manifest_bytes, folder, err)
        timings["manifest"] = time.perf_counter() - t
        self._phase("committed", snapshot.trainer_step)
        if not manifest.is_delta and snapshot.extra is not None:
            self.base = DeltaBase(cut_id, hashlib.sha256(manifest_bytes).hexdigest(), snapshot.trainer_step)
        # Files of writers that lost this id (crashed, or raced and were refused) can never
        # be committed now: remove them.
        self._remove_other_writers(base, writer)
        t = time.perf_counter()
        self._update_pointer(cut_id, manifest, hashlib.sha256(manifest_bytes).hexdigest())
        timings["pointer"] = time.perf_counter() - t
        t = time.perf_counter()
        self._phase("retention", snapshot.trainer_step)
        self._apply_retention()
        timings["retention"] = time.perf_counter() - t
        timings["total"] = time.perf_counter() - t0
        written = sum(f.size for f in files) + len(manifest_bytes)
        log.info(
            "cut %s committed (%s %s, step %d, %d bytes; %s)",
            cut_id,
            request.kind,
            request.form,
            snapshot.trainer_step,
            written,
            ", ".join(f"{k} {v:.3f} s" for k, v in timings.items()),
        )
        return CommittedCut(cut_id, f"{self.storage.uri}/{base}", manifest, timings, written)

    def _settle_manifest(self, cut_id: str, ours: bytes, folder: str, err: Exception) -> None:
        """The manifest write failed, but it may have landed: reads the manifest back and
        returns if it holds our bytes (the cut is committed). Otherwise raises, and removes
        this writer's files only when the manifest can no longer appear: another writer's
        manifest is there, or the write definitely never reached the server. The files of a
        manifest that landed, or may still land, are never removed."""
        deadline = isinstance(err, StorageDeadlineError)
        missed = BarrierDeadlineMissedError if deadline else CutError
        what = "missed its deadline" if deadline else "was not committed"
        key = f"{self.storage.uri}/{manifest_key(cut_id)}"
        try:
            held: bytes | None = self.storage.get_bytes(manifest_key(cut_id))
        except ObjectNotFoundError:
            held = None
        except Exception as read_err:
            raise missed(
                f"cut {cut_id} {what}: writing its manifest failed ({err}) and reading it back failed too "
                f"({read_err}). Whether the cut is committed is unknown: its files are kept under "
                f"{self.storage.uri}/{folder}, so if the manifest landed the cut is whole (restore validates it)"
            ) from None
        if held == ours:
            log.warning("cut %s: writing %s reported %s, but it holds our manifest: committed", cut_id, key, err)
            return
        if held is not None:
            self._remove_folder(folder)
            raise CutConflictError(
                f"cut {cut_id} in {self.storage.uri} was committed by another writer first (found after our "
                f"manifest write failed: {err}); two controllers are writing this job's cuts: stop this one"
            ) from None
        if getattr(err, "in_doubt", True):
            raise missed(
                f"cut {cut_id} {what}: writing its manifest failed ({err}) and the write may still land; its files "
                f"are kept under {self.storage.uri}/{folder} so that, if it does, the cut is whole "
                "(the last committed cut stands until then)"
            ) from None
        self._remove_folder(folder)
        raise missed(
            f"cut {cut_id} {what}: writing its manifest failed: {err} (the last committed cut stands)"
        ) from None

    def _write_files(
        self, snapshot: OwnersSnapshot, request: CutRequest, cut_id: str, folder: str, writer: str
    ) -> list[ManifestFile]:
        """The owners' files and the trainer's (a delta: the redo log's), each with its size and
        sha256, into ``folder``."""
        blobs = encode_owner_files(snapshot)
        names = dict(OWNER_AND_EPISODE_FILES)
        if request.form == "delta":
            if self.base is None:
                raise CutError(f"delta cut {cut_id} not taken: no full cut to extend (take a full cut first)")
            try:
                blobs |= encode_delta_files(snapshot, self.base)
            except DeltaNotCoveredError as err:
                raise CutError(f"delta cut {cut_id} not taken: {err}") from None
            names |= DELTA_FILES
        files: list[ManifestFile] = []
        for role, blob in blobs.items():
            path = f"{writer}/{names[role]}"
            self.storage.put_bytes(f"{folder}/{names[role]}", blob)
            files.append(ManifestFile(path, role, len(blob), hashlib.sha256(blob).hexdigest()))
            self._check_deadline(request, cut_id)
        trainer = snapshot.extra
        if request.form == "delta" and trainer is not None:
            raise CutError(f"delta cut {cut_id}: the capture took the trainer's state, which a delta does not hold")
        if isinstance(trainer, ShardedTrainerSnapshot):
            files += self._write_sharded(trainer, request, cut_id, folder, writer)
        elif trainer is not None:
            if isinstance(trainer, LentTrainerState):
                try:
                    trainer = trainer.resolve(timeout=request.remaining())
                except TimeoutError as err:
                    raise BarrierDeadlineMissedError(f"barrier cut {cut_id} missed its deadline: {err}") from None
            if not isinstance(trainer, TrainerSnapshot):
                raise CutError(
                    f"state_fn returned {type(trainer).__name__}, not a TrainerSnapshot or ShardedTrainerSnapshot"
                )
            tfs = self.trainer_format.files(trainer)
            if self.parallel_files and len(tfs) > 1:
                # One thread per file (weights, optimizer ...): serialising, hashing and writing
                # release the GIL, so the big files go out side by side. Each thread runs in a
                # copy of this context: the barrier's deadline bounds its storage calls too.
                with ThreadPoolExecutor(len(tfs), thread_name_prefix="cut-file") as pool:
                    futures = [
                        pool.submit(contextvars.copy_context().run, self._put_streamed, f"{folder}/{tf.name}", tf)
                        for tf in tfs
                    ]
                    results = [f.result() for f in futures]
            else:
                results = []
                for tf in tfs:
                    results.append(self._put_streamed(f"{folder}/{tf.name}", tf))
                    self._check_deadline(request, cut_id)
            for tf, (size, digest) in zip(tfs, results, strict=True):
                files.append(ManifestFile(f"{writer}/{tf.name}", tf.role, size, digest))
            self._check_deadline(request, cut_id)
        return files

    def _write_sharded(
        self, trainer: ShardedTrainerSnapshot, request: CutRequest, cut_id: str, folder: str, writer: str
    ) -> list[ManifestFile]:
        """A trainer group's files: every rank writes its shards (``trainer.write``), then
        ``trainer/meta.json``. Every file a rank reports is listed with its size and digest."""
        try:
            written = trainer.write(self.storage, folder, request.deadline)
        except (StorageDeadlineError, BarrierDeadlineMissedError):
            raise
        except Exception as err:
            left = request.remaining()
            if left is not None and left <= 0:
                raise BarrierDeadlineMissedError(
                    f"barrier cut {cut_id} missed its deadline while the trainer's ranks wrote their shards "
                    f"({type(err).__name__}: {err}); it was not committed (the last committed cut stands)"
                ) from None
            raise
        files: list[ManifestFile] = []
        seen: set[str] = set()
        for f in written:
            if not f.name.startswith("trainer/") or f.name == "trainer/meta.json" or f.name in seen:
                raise CutError(
                    f"cut {cut_id}: the trainer's ranks reported the file {f.name!r} twice, or outside trainer/ "
                    "(a bug in the trainer group's write); the cut was not committed"
                )
            seen.add(f.name)
            files.append(ManifestFile(f"{writer}/{f.name}", f.role, f.size, f.sha256))
        if trainer.format_name == DCP_FORMAT:
            index = [f.name for f in written if f.role == INDEX_ROLE]
            if index != [DCP_INDEX] or not any(f.role == SHARD_ROLE for f in written):
                raise CutError(
                    f"cut {cut_id}: the trainer's ranks reported {len(written)} files, which are not one index "
                    f"({DCP_INDEX}) and at least one shard; the cut was not committed"
                )
        self._check_deadline(request, cut_id)
        meta = json.dumps(dict(trainer.meta), sort_keys=True).encode("utf-8")
        self.storage.put_bytes(f"{folder}/trainer/meta.json", meta)
        files.append(
            ManifestFile(f"{writer}/trainer/meta.json", "trainer_meta", len(meta), hashlib.sha256(meta).hexdigest())
        )
        self._check_deadline(request, cut_id)
        return files

    def _manifest(
        self, snapshot: OwnersSnapshot, request: CutRequest, cut_id: str, writer: str, files: list[ManifestFile]
    ) -> Manifest:
        return Manifest(
            schema_version=SCHEMA_VERSION,
            cut_id=cut_id,
            kind=request.kind,
            job=self.job,
            attempt=snapshot.attempt,
            writer=writer,
            data_dir=writer,
            created_at=dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
            trainer_step=snapshot.trainer_step,
            dispatch_index=snapshot.dispatch_index,
            group_counts=snapshot_counts(snapshot),
            dataset=self.dataset,
            config=snapshot.config.to_json(),
            files=tuple(files),
            trainer_format=self._trainer_format_name(snapshot.extra),
            capture_seconds=snapshot.capture_seconds,
            extra={"reason": request.reason} if request.reason else {},
            form=request.form,
            base=self.base if request.form == "delta" else None,
        )

    def _trainer_format_name(self, trainer: Any) -> str | None:
        if isinstance(trainer, ShardedTrainerSnapshot):
            return trainer.format_name
        return self.trainer_format.name if trainer is not None else None

    def _fence(self, committed: list[Any], attempt: int) -> None:
        """Refuses to cut for a fenced controller, or one older than the writer of the newest cut."""
        if self.fence is not None:
            self.fence.check()
        if not committed:
            return
        newest = committed[-1].cut_id
        try:
            newest_attempt = json.loads(self.storage.get_bytes(manifest_key(newest))).get("attempt", 0)
        except (StorageError, ValueError):
            return  # an unreadable manifest is restore's business (it names the check)
        if isinstance(newest_attempt, int) and newest_attempt > attempt:
            raise CutConflictError(
                f"cut {newest} in {self.storage.uri} was written by controller attempt {newest_attempt}, "
                f"this one is attempt {attempt}: a newer controller owns this job; stop this one"
            )

    def _remove_other_writers(self, base: str, writer: str) -> None:
        try:
            for info in list(self.storage.list(f"{base}/")):
                rest = info.key[len(base) + 1 :]
                if "/" in rest and not rest.startswith(f"{writer}/"):
                    self.storage.delete(info.key)
        except StorageError as err:
            log.warning("could not remove stale writer files under %s: %s", base, err)

    def _check_deadline(self, request: CutRequest, cut_id: str) -> None:
        left = request.remaining()
        if left is not None and left <= 0:
            raise BarrierDeadlineMissedError(
                f"barrier cut {cut_id} missed its deadline by {-left:.1f} s; it was not committed "
                f"(the last committed cut stands)"
            )

    def _put_streamed(self, key: str, tf: TrainerFile) -> tuple[int, str]:
        """Serialises one trainer file straight into storage, hashing as it goes: serialising,
        hashing and uploading overlap, and no local copy is made."""
        with self.storage.open_write(key) as f:
            hashing = HashingWriter(f)
            tf.write(cast(IO[bytes], hashing))
            hashing.flush()
        return hashing.size, hashing.sha256.hexdigest()

    def _update_pointer(self, cut_id: str, manifest: Manifest, digest: str) -> None:
        try:
            current = read_pointer(self.storage)
        except StorageError as err:
            log.warning("cut %s committed but %s was not updated (reading it failed): %s", cut_id, POINTER, err)
            return
        current_seq = seq_of(str(current.get("cut_id", ""))) if current else None
        if current_seq is not None and current_seq > (seq_of(cut_id) or 0):
            return  # never move the pointer back
        pointer = {
            "cut_id": cut_id,
            "kind": manifest.kind,
            "trainer_step": manifest.trainer_step,
            "manifest_sha256": digest,
            "committed_at": manifest.created_at,
        }
        try:
            self.storage.put_bytes(POINTER, json.dumps(pointer, indent=1).encode("utf-8"))
        except StorageError as err:
            # The cut is committed; the pointer is only a hint (restore lists manifests).
            log.warning("cut %s committed but %s was not updated: %s", cut_id, POINTER, err)

    def _apply_retention(self) -> None:
        try:
            folders = list_cut_folders(self.storage)
        except StorageError as err:
            log.warning("retention skipped: listing the cuts failed: %s", err)
            return
        committed = [f for f in folders if f.committed]
        bases = self._bases_of(committed)
        if bases is None:
            return  # a manifest did not read: delete nothing that might be a base
        kept = kept_chains([f.cut_id for f in committed], bases, self.keep, self.base.cut_id if self.base else None)
        if not kept:
            return
        oldest_kept = min(seq_of(c) or 0 for c in kept)
        for folder in folders:
            torn_and_new = not folder.committed and (seq_of(folder.cut_id) or 0) >= oldest_kept
            if folder.cut_id in kept or torn_and_new:
                continue
            try:
                # Manifest first: from that instant the cut no longer exists, even if the
                # rest of the deletes are interrupted.
                if folder.committed:
                    self.storage.delete(manifest_key(folder.cut_id))
                for key in folder.keys:
                    self.storage.delete(key)
            except StorageError as err:
                log.warning("could not delete old cut %s: %s", folder.cut_id, err)

    def _bases_of(self, committed: list[Any]) -> dict[str, str | None] | None:
        """Each committed cut's base (None: a full cut), from its manifest, read once (a
        committed manifest never changes). None when a manifest did not read."""
        for folder in committed:
            if folder.cut_id in self._base_ids:
                continue
            try:
                base = (json.loads(self.storage.get_bytes(manifest_key(folder.cut_id))) or {}).get("base")
            except (StorageError, ValueError) as err:
                log.warning("retention skipped: the manifest of cut %s did not read: %s", folder.cut_id, err)
                return None
            self._base_ids[folder.cut_id] = base.get("cut_id") if isinstance(base, dict) else None
        return {f.cut_id: self._base_ids[f.cut_id] for f in committed}

    def _remove_folder(self, prefix: str) -> None:
        """Removes a cut's files after it failed. Best effort (a torn folder is harmless, and
        retention reaps it); past a barrier's deadline it gets ``CLEANUP_GRACE`` seconds more."""
        deadline = current_deadline()
        if deadline is not None:
            deadline = Deadline(max(deadline.at, time.monotonic() + CLEANUP_GRACE))
        try:
            with deadline_scope(deadline, replace=True):
                for info in list(self.storage.list(prefix)):
                    self.storage.delete(info.key)
        except StorageError as err:
            log.warning("could not clean up %s after a failed cut: %s", prefix, err)
