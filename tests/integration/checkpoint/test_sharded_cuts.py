"""Sharded cuts (``dcp/v1``): FSDP2 ranks write their shards through torch.distributed.checkpoint
over our Storage (local and S3), any number of ranks loads them back exactly, every file is
checked against the manifest before it is read, and a cut with sharded trainer state commits,
verifies, resumes a single-process trainer, and is refused (by a named check) when forged.

Real gloo process groups on the CPU: the N-rank test spawns one world of 3 processes (2 of them
save; 3, then 2 others, load); the other tests use a 1-process group in this process.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cut_scenarios import DATASET, EXAMPLE_B, JOB, dataset_description, example_b_before_cut, loader_for

from spotrl_runtime.api.times import Deadline
from spotrl_runtime.checkpoint import BarrierDeadlineMissedError, CutRequest, list_cut_folders, restore_cut
from spotrl_runtime.checkpoint.resume import load_trainer, resume_or_start
from spotrl_runtime.checkpoint.sharded import (
    DCP_FORMAT,
    INDEX_ROLE,
    SHARD_ROLE,
    ShardedCut,
    ShardError,
    ShardFile,
    apply_sharded,
    capture_sharded,
    load_sharded,
    save_sharded,
    sharded_state,
)
from spotrl_runtime.checkpoint.trainer_state import ShardedTrainerSnapshot
from spotrl_runtime.cli import main as spotrl
from spotrl_runtime.core.identity import JobIdentity
from spotrl_runtime.core.validation import FileDigestError, OrphanFileError, TrainerStateError
from spotrl_runtime.data import PromptCollate
from spotrl_runtime.storage import LocalStorage, Storage, StorageDeadlineError, deadline_scope

FOLDER = "cuts/0000000001/w0-test"
SHARD = "trainer/dcp/__0_0.distcp"
INDEX = "trainer/dcp/.metadata"
INPUT = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 3, 4, 5]]
"""Fixed token ids for the one optimizer step that gives the optimizer its state."""

# ------------------------------------------------------------------- helpers


def policy(mesh: Any = None) -> Any:
    """The built-in tiny policy (a Llama with tied embeddings), sharded per block then as a
    whole over ``mesh`` when one is given (what a trainer rank does)."""
    from spotrl_runtime.models.loading import load_policy
    from spotrl_runtime.training.fsdp import shard_policy

    model, _ = load_policy("builtin:tiny-arith")
    return model if mesh is None else shard_policy(model, torch.float32, mesh)


def optimizer(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_once(model: Any, opt: torch.optim.Optimizer) -> None:
    ids = torch.tensor(INPUT)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def zero_weights(model: Any) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()


def full_state(model: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole model and optimizer state (gathered on every rank of the model's mesh)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    return {
        "model": dict(get_model_state_dict(model, options=options)),
        "optimizer": dict(get_optimizer_state_dict(model, opt, options=options)),
    }


def single_process_state(trainer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optim = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": dict(trainer.model.state_dict()), "optimizer": dict(optim)}


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Exactly equal, tensors bit for bit (a DTensor left over would fail: full states only)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}"
        assert type(got) is type(want), f"{where}: {type(got).__name__}"
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{where}: {got.dtype}{list(got.shape)}"
        assert torch.equal(got, want), f"{where}: values differ"
    elif isinstance(want, Mapping):
        assert isinstance(got, Mapping), f"{where}: {type(got).__name__}"
        assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)), f"{where}: {got!r} != {want!r}"
        assert len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def listing(files: list[ShardFile]) -> dict[str, tuple[int, str]]:
    return {f.name: (f.size, f.sha256) for f in files}


def digest(data: bytes) -> tuple[int, str]:
    return len(data), hashlib.sha256(data).hexdigest()


def s3_store(bucket: Any, prefix: str = "job") -> Storage:
    return bucket.storage(prefix)


def assert_files_are_the_stored_objects(storage: Storage, folder: str, per_rank: list[list[ShardFile]]) -> None:
    """The files the ranks returned are exactly the objects under the folder, sizes and digests
    right; each rank reported its own files, and the coordinator the index."""
    names = [f.name for files in per_rank for f in files]
    assert len(names) == len(set(names)), f"a file reported by two ranks: {names}"
    stored = {o.key[len(folder) + 1 :]: o.size for o in storage.list(f"{folder}/")}
    assert set(stored) == set(names)
    for files in per_rank:
        for f in files:
            assert (f.size, f.sha256) == digest(storage.get_bytes(f"{folder}/{f.name}")), f.name
            assert f.role == (INDEX_ROLE if f.name == INDEX else SHARD_ROLE)
    assert INDEX in {f.name for f in per_rank[0]}, "the coordinator (rank 0) writes the index"
    for rank, files in enumerate(per_rank):
        shards = [f.name for f in files if f.role == SHARD_ROLE]
        assert shards, f"rank {rank} wrote no shard"
        assert all(n.startswith(f"trainer/dcp/__{rank}_") for n in shards), (rank, shards)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def one_rank() -> Iterator[Any]:
    """A 1-process gloo group (no port: a HashStore) and its CPU mesh; destroyed afterwards."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's and FSDP's notes on a 1-rank world
            yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def saved(one_rank: Any, tmp_path: Path) -> tuple[LocalStorage, dict[str, tuple[int, str]], dict[str, Any]]:
    """One rank's sharded state saved locally: (store, the files as a manifest lists them, the
    state's full form)."""
    model = policy(one_rank)
    opt = optimizer(model)
    train_once(model, opt)
    storage = LocalStorage(tmp_path / "store")
    files = save_sharded(capture_sharded(model, opt), storage, FOLDER)
    assert [f.name for f in files] == [INDEX, SHARD]
    return storage, listing(files), full_state(model, opt)


def load_fresh(
    storage: Storage, files: Mapping[str, tuple[int, str]], mesh: Any, *, into_copy: bool = False, **kw: Any
) -> dict[str, Any]:
    """A fresh (zeroed) model and optimizer, loaded from the files and gathered. ``into_copy``:
    load into a CPU copy (:func:`capture_sharded`), not in place (:func:`sharded_state`)."""
    model = policy(mesh)
    opt = optimizer(model)
    zero_weights(model)
    state = capture_sharded(model, opt) if into_copy else sharded_state(model, opt)
    load_sharded(state, storage, FOLDER, files, **kw)
    apply_sharded(model, opt, state)
    return full_state(model, opt)


# ------------------------------------------------------- N ranks save, M load


def _world(rank: int, world: int, port: int, out: str, bucket: Any) -> None:
    """One rank of a 3-process world: ranks 0-1 train and save (their own group), then all 3
    load, then ranks 1-2 (another group); each rank checks the gathered state it loaded."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        root = Path(out)
        stores = {"local": LocalStorage(root / "local"), "s3": s3_store(bucket)}
        savers = dist.new_group([0, 1])
        pair = dist.new_group([1, 2])
        if rank in (0, 1):
            model = policy(DeviceMesh.from_group(savers, "cpu"))
            opt = optimizer(model)
            train_once(model, opt)
            expected = full_state(model, opt)
            if rank == 0:
                torch.save(expected, root / "expected.pt")
            state = capture_sharded(model, opt)
            train_once(model, opt)  # training goes on: the captured copy must not move
            for name, store in stores.items():
                files = save_sharded(state, store, FOLDER, process_group=savers, thread_count=2 if name == "s3" else 1)
                (root / f"files-{name}-{rank}.json").write_text(json.dumps([f.__dict__ for f in files]))
        dist.barrier()
        expected = torch.load(root / "expected.pt", weights_only=False)
        manifests = {
            name: listing(
                [ShardFile(**f) for r in (0, 1) for f in json.loads((root / f"files-{name}-{r}.json").read_text())]
            )
            for name in stores
        }
        for group, members in ((None, (0, 1, 2)), (pair, (1, 2))):
            if rank in members:
                mesh = init_device_mesh("cpu", (3,)) if group is None else DeviceMesh.from_group(group, "cpu")
                for name, store in stores.items():
                    spool = root / f"spool-{rank}"
                    got = load_fresh(
                        store, manifests[name], mesh, into_copy=name == "s3", process_group=group, spool_dir=spool
                    )
                    assert_same(got, expected, f"{len(members)} ranks loading from {name}")
                    assert not spool.exists() or not any(spool.iterdir()), "downloaded shards are removed"
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.s3
@pytest.mark.slow
def test_two_ranks_save_and_one_two_and_three_ranks_load_it_exactly(s3_bucket: Any, tmp_path: Path) -> None:
    from spotrl_runtime.models.tiny_arith import tiny_arith_dir
    from spotrl_runtime.training.trainer import Trainer, TrainerConfig

    tiny_arith_dir()  # built (once, cached) before the ranks race for it
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.start_processes(_world, args=(3, free_port(), str(tmp_path), s3_bucket), nprocs=3, start_method="spawn")

    expected = torch.load(tmp_path / "expected.pt", weights_only=False)
    stores = {"local": LocalStorage(tmp_path / "local"), "s3": s3_store(s3_bucket)}
    for name, store in stores.items():
        per_rank = [
            [ShardFile(**f) for f in json.loads((tmp_path / f"files-{name}-{r}.json").read_text())] for r in (0, 1)
        ]
        assert_files_are_the_stored_objects(store, FOLDER, per_rank)
        if name == "s3":
            assert len(per_rank[1]) == 2, "two writer threads: two files a rank"
        # One process, no process group: the single-process trainer resumes the 2-rank run.
        trainer = Trainer(policy(), TrainerConfig())
        zero_weights(trainer.model)
        cut = ShardedCut(store.uri, FOLDER, listing([f for fs in per_rank for f in fs]), {"trainer_step": 1})
        trainer.load_sharded(cut, storage=store)
        assert trainer.step == 1
        assert_same(single_process_state(trainer), expected, f"1 process loading from {name}")


# ----------------------------------------------------- every file is checked


def test_a_changed_shard_is_refused_naming_it(saved: Any) -> None:
    storage, files, _ = saved
    path = storage.path_of(f"{FOLDER}/{SHARD}")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"__0_0\.distcp: sha256 is .*, the manifest says") as info:
        load_fresh(storage, files, None, no_dist=True)
    assert info.value.file == SHARD
    path.write_bytes(bytes(data[:-10]))
    with pytest.raises(ShardError, match=rf"__0_0\.distcp: is {len(data) - 10} bytes, the manifest says {len(data)}"):
        load_fresh(storage, files, None, no_dist=True)
    path.unlink()
    with pytest.raises(ShardError, match=r"__0_0\.distcp: listed in the manifest but missing"):
        load_fresh(storage, files, None, no_dist=True)


def test_a_changed_shard_with_its_digest_recomputed_loads_only_if_dcp_accepts_it(saved: Any) -> None:
    """The digests are the only guard against changed tensor bytes: DCP reads a flipped byte in
    a tensor as a different weight; it refuses a file whose records do not parse."""
    storage, files, expected = saved
    path = storage.path_of(f"{FOLDER}/{SHARD}")
    original = path.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0xFF
    path.write_bytes(bytes(flipped))
    got = load_fresh(storage, {**files, SHARD: digest(bytes(flipped))}, None, no_dist=True)
    with pytest.raises(AssertionError, match="values differ"):
        assert_same(got, expected)
    garbage = b"\0" * 64 + original[64:]
    path.write_bytes(garbage)
    with pytest.raises(ShardError, match=r"__0_0\.distcp: matches the manifest but does not load") as info:
        load_fresh(storage, {**files, SHARD: digest(garbage)}, None, no_dist=True)
    assert info.value.file == SHARD


def test_a_file_the_checkpoint_needs_but_the_manifest_does_not_list_is_refused(saved: Any) -> None:
    storage, files, expected = saved
    with pytest.raises(ShardError, match=r"__0_0\.distcp: the checkpoint needs this file but the cut's manifest"):
        load_fresh(storage, {k: v for k, v in files.items() if k != SHARD}, None, no_dist=True)
    with pytest.raises(ShardError, match=r"\.metadata: the checkpoint needs this file") as info:
        load_fresh(storage, {k: v for k, v in files.items() if k != INDEX}, None, no_dist=True)
    assert info.value.file == INDEX
    assert_same(load_fresh(storage, files, None, no_dist=True), expected)  # the files themselves are fine


@pytest.mark.s3
def test_s3_shards_are_downloaded_once_verified_and_removed(
    one_rank: Any, s3_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = s3_store(s3_bucket)
    model = policy(one_rank)
    opt = optimizer(model)
    train_once(model, opt)
    files = listing(save_sharded(capture_sharded(model, opt), storage, FOLDER))
    expected = full_state(model, opt)
    downloads: list[str] = []
    real = type(storage).download_file

    def counted(self: Any, key: str, path: Path) -> Any:
        downloads.append(key)
        return real(self, key, path)

    monkeypatch.setattr(type(storage), "download_file", counted)
    spool = tmp_path / "spool"
    assert_same(load_fresh(storage, files, one_rank, spool_dir=spool), expected)
    assert sorted(downloads) == [f"{FOLDER}/{INDEX}", f"{FOLDER}/{SHARD}"]
    assert list(spool.iterdir()) == []
    storage.put_bytes(f"{FOLDER}/{SHARD}", b"not the shard")
    with pytest.raises(ShardError, match=r"__0_0\.distcp: is 13 bytes, the manifest says"):
        load_fresh(storage, files, one_rank, spool_dir=spool)
    assert list(spool.iterdir()) == []


def test_a_save_past_its_deadline_raises_the_storage_deadline_error(one_rank: Any, tmp_path: Path) -> None:
    model = policy(one_rank)
    state = capture_sharded(model, optimizer(model))
    with deadline_scope(Deadline.after(0.0)), pytest.raises(StorageDeadlineError):
        save_sharded(state, LocalStorage(tmp_path), FOLDER, thread_count=2)


# ------------------------------------------------------------------ whole cuts


def sharded_run(storage: Storage, mesh: Any) -> tuple[Any, dict[str, Any], list[ShardFile]]:
    """Example B's owners with a 1-rank FSDP trainer; one cut with its sharded state."""
    run = example_b_before_cut(storage)
    model = policy(mesh)
    opt = optimizer(model)
    train_once(model, opt)
    written: list[ShardFile] = []

    def state_fn() -> ShardedTrainerSnapshot:
        state = capture_sharded(model, opt)

        def write(store: Storage, folder: str, deadline: Deadline | None) -> list[ShardFile]:
            written.extend(save_sharded(state, store, folder))
            return list(written)

        return ShardedTrainerSnapshot(meta={"trainer_step": run.owners.trainer_step, "world_size": 1}, write=write)

    assert run.writer is not None
    run.writer.write(run.owners, CutRequest.periodic(), state_fn)
    return run, full_state(model, opt), written


def resume(root: Path) -> Any:
    from spotrl_runtime.training.trainer import Trainer, TrainerConfig

    trainer = Trainer(policy(), TrainerConfig())
    zero_weights(trainer.model)
    start = resume_or_start(
        LocalStorage(root),
        job=JobIdentity(JOB),
        config=EXAMPLE_B,
        dataset=DATASET,
        collate=PromptCollate(),
        loader=loader_for(EXAMPLE_B, DATASET),
        trainer=trainer,
        resume="auto",
        attempt=None,
        latest_audited_attempt=lambda: None,
        dataset_description=dataset_description(DATASET),
    )
    return start, trainer


def only_cut(root: Path) -> tuple[Path, dict[str, Any]]:
    (cut,) = sorted((root / "cuts").iterdir())
    return cut, json.loads((cut / "manifest.json").read_text())


def test_a_sharded_cut_commits_verifies_and_resumes_a_single_process_trainer(
    one_rank: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "job"
    storage = LocalStorage(root)
    _, expected, written = sharded_run(storage, one_rank)
    cut, m = only_cut(root)
    assert m["trainer_format"] == DCP_FORMAT
    data_dir = m["data_dir"]
    listed = {f["path"]: (f["role"], f["size"], f["sha256"]) for f in m["files"]}
    for f in written:
        assert listed[f"{data_dir}/{f.name}"] == (f.role, f.size, f.sha256)
        assert digest((cut / data_dir / f.name).read_bytes()) == (f.size, f.sha256)
    meta = json.loads((cut / data_dir / "trainer" / "meta.json").read_bytes())
    assert meta == {"trainer_step": 0, "world_size": 1}
    assert listed[f"{data_dir}/trainer/meta.json"][0] == "trainer_meta"

    assert spotrl(["ckpt", "verify", str(root)]) == 0
    capsys.readouterr()
    assert spotrl(["ckpt", "inspect", str(root), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    shards = [f for f in written if f.role == SHARD_ROLE]
    assert d["trainer_format"] == DCP_FORMAT
    assert d["trainer_files"]["shards"] == len(shards) == 1
    assert d["trainer_files"]["shard_bytes"] == sum(f.size for f in shards)
    assert d["trainer_files"]["index"] == f"{data_dir}/{INDEX}"
    assert spotrl(["ckpt", "inspect", str(root)]) == 0
    assert f"trainer        {DCP_FORMAT}" in capsys.readouterr().out

    restored = restore_cut(storage, dataset=DATASET, collate=PromptCollate(), source=loader_for(EXAMPLE_B, DATASET))
    assert isinstance(restored.trainer, ShardedCut)
    assert restored.trainer.folder == f"cuts/{restored.cut_id}/{data_dir}"
    assert set(restored.trainer.files) == {f.name for f in written} | {"trainer/meta.json"}
    start, trainer = resume(root)
    assert start.restored is not None
    assert start.restored.cut_id == restored.cut_id
    assert trainer.step == 0
    assert_same(single_process_state(trainer), expected)


def test_shard_digests_are_checked_by_the_chain(one_rank: Any, tmp_path: Path) -> None:
    from spotrl_runtime.checkpoint import validate_stored_cut

    root = tmp_path / "job"
    sharded_run(LocalStorage(root), one_rank)
    cut, m = only_cut(root)
    shard = cut / m["data_dir"] / SHARD
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(FileDigestError, match=r"__0_0\.distcp: sha256 is") as info:
        validate_stored_cut(LocalStorage(root), cut.name, None)
    assert info.value.path == f"{m['data_dir']}/{SHARD}"


def test_a_forged_shard_is_refused_at_restore_with_check_trainer_state(one_rank: Any, tmp_path: Path) -> None:
    """Bytes changed and the manifest's size and digest recomputed (LATEST.json's manifest digest
    is a hint the chain does not check): every per-file check passes, the load does not."""
    root = tmp_path / "job"
    sharded_run(LocalStorage(root), one_rank)
    cut, m = only_cut(root)
    path = f"{m['data_dir']}/{SHARD}"
    forged = b"\0" * 64 + (cut / path).read_bytes()[64:]
    (cut / path).write_bytes(forged)
    for f in m["files"]:
        if f["path"] == path:
            f["size"], f["sha256"] = digest(forged)
    (cut / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TrainerStateError, match="does not load") as info:
        resume(root)
    assert info.value.check == "trainer_state"
    assert info.value.path == path


def test_a_manifest_without_its_index_or_shards_is_refused_by_a_named_check(one_rank: Any, tmp_path: Path) -> None:
    root = tmp_path / "job"
    sharded_run(LocalStorage(root), one_rank)
    cut, m = only_cut(root)
    data_dir = m["data_dir"]

    def drop(role: str, *, with_file: bool) -> None:
        for f in [f for f in m["files"] if f["role"] == role]:
            m["files"].remove(f)
            if with_file:
                (cut / f["path"]).unlink()
        (cut / "manifest.json").write_text(json.dumps(m))

    manifest, index = (cut / "manifest.json").read_bytes(), (cut / data_dir / INDEX).read_bytes()
    drop(INDEX_ROLE, with_file=False)  # the file is still there: the manifest does not own it
    with pytest.raises(OrphanFileError) as orphan:
        resume(root)
    assert orphan.value.path == f"{data_dir}/{INDEX}"
    (cut / data_dir / INDEX).unlink()
    with pytest.raises(TrainerStateError, match=r"needs exactly one trainer-shard-index file") as info:
        resume(root)
    assert info.value.path == f"{data_dir}/{INDEX}"
    (cut / data_dir / INDEX).write_bytes(index)
    (cut / "manifest.json").write_bytes(manifest)
    m = json.loads(manifest)
    drop(SHARD_ROLE, with_file=True)
    with pytest.raises(TrainerStateError, match=r"needs at least one trainer-shard file"):
        resume(root)


def test_a_failed_or_late_rank_write_commits_nothing(tmp_path: Path) -> None:
    """A rank that fails (or a write past a barrier's deadline) leaves no cut: the folder is
    removed and the last committed cut stands."""
    storage = LocalStorage(tmp_path)
    run = example_b_before_cut(storage)
    assert run.writer is not None
    first = run.cut()

    def snapshot(error: BaseException) -> ShardedTrainerSnapshot:
        def write(store: Storage, folder: str, deadline: Deadline | None) -> list[ShardFile]:
            store.put_bytes(f"{folder}/{SHARD}", b"rank 0 was done")
            while isinstance(error, TimeoutError) and deadline is not None and deadline.remaining() > 0:
                time.sleep(0.02)  # rank 1 is slow: the driver gives up after the deadline
            raise error

        return ShardedTrainerSnapshot(meta={"trainer_step": run.owners.trainer_step}, write=write)

    with pytest.raises(RuntimeError, match="rank 1 died"):
        run.writer.write(run.owners, CutRequest.periodic(), lambda: snapshot(RuntimeError("rank 1 died")))
    late = StorageDeadlineError("put not started: the deadline passed")
    with pytest.raises(BarrierDeadlineMissedError, match="missed its deadline"):
        run.writer.write(run.owners, CutRequest.barrier(Deadline.after(30)), lambda: snapshot(late))
    with pytest.raises(BarrierDeadlineMissedError, match="while the trainer's ranks wrote their shards"):
        run.writer.write(run.owners, CutRequest.barrier(Deadline.after(0.5)), lambda: snapshot(TimeoutError("ray")))
    assert [(f.cut_id, f.committed) for f in list_cut_folders(storage)] == [(first.cut_id, True)], (
        "no cut, and no torn folder: the failed writers removed their files"
    )


def test_restored_sharded_cut_goes_to_the_trainers_load_sharded(tmp_path: Path) -> None:
    """``load_trainer`` hands a ShardedCut to ``trainer.load_sharded`` (a trainer group's, here a
    stand-in) and names the file a ShardError names, also behind a wrapping error (Ray's)."""

    class Group:
        step = 0
        error: BaseException | None = None

        def load_sharded(self, cut: ShardedCut) -> None:
            if self.error is not None:
                raise self.error

    cut = ShardedCut("file:///x", "cuts/0000000004/w1-abc", {}, {"trainer_step": 7})
    group = Group()
    load_trainer(group, cut, "0000000004", "file:///x")
    assert group.step == 7
    try:
        raise ShardError(f"{SHARD}: sha256 is 00…", SHARD)
    except ShardError as err:
        wrapped = RuntimeError("rank 2 failed")
        wrapped.__cause__ = err
    group.error = wrapped
    with pytest.raises(TrainerStateError) as info:
        load_trainer(group, cut, "0000000004", "file:///x")
    assert info.value.path == f"w1-abc/{SHARD}"
    assert "sha256 is 00" in str(info.value)
    group.error = MemoryError("out of host memory")
    with pytest.raises(TrainerStateError, match="MemoryError: out of host memory") as info:
        load_trainer(group, cut, "0000000004", "file:///x")
    assert info.value.path == "w1-abc/trainer/"


def test_ckpt_export_gathers_a_sharded_cut_into_a_hugging_face_folder(
    one_rank: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`spotrl ckpt export` of a ``dcp/v1`` cut: the folder loads with transformers' own
    classes and holds the FSDP rank's trained weights exactly; a cut whose shard was changed
    is not exported, and nothing is left where the folder would have been."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path / "job"
    _, expected, written = sharded_run(LocalStorage(root), one_rank)
    out = tmp_path / "exported"
    assert spotrl(["ckpt", "export", str(root), "--base", "builtin:tiny-arith", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trainer_step"] == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert_same({"model": dict(model.state_dict())}, {"model": expected["model"]})
    assert AutoTokenizer.from_pretrained(out)("3+4=")["input_ids"]
    export = json.loads((out / "spotrl-export.json").read_text())
    cut, _ = only_cut(root)
    assert export["cut_id"] == cut.name
    assert export["manifest_sha256"] == hashlib.sha256((cut / "manifest.json").read_bytes()).hexdigest()

    shard = next(f for f in written if f.role == SHARD_ROLE)
    path = cut / json.loads((cut / "manifest.json").read_text())["data_dir"] / shard.name
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    again = tmp_path / "again"
    assert spotrl(["ckpt", "export", str(root), "--base", "builtin:tiny-arith", "--out", str(again)]) == 1
    assert "fails check file_digest" in capsys.readouterr().err
    assert not again.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".again")] == []
