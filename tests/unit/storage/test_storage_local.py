"""The local folder store: the storage contract, atomic and create-only writes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from spotrl_runtime.storage import (
    LocalStorage,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    open_object,
    open_storage,
    sha256_file,
)


def test_put_get_head_list_delete(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "root")
    assert store.head("a/b.json") is None
    assert store.put_bytes("a/b.json", b"hello").size == 5
    store.put_bytes("a/c/d.bin", b"x" * 10)
    store.put_bytes("z.txt", b"")
    assert store.get_bytes("a/b.json") == b"hello"
    assert store.head("a/c/d.bin").size == 10  # type: ignore[union-attr]
    assert [o.key for o in store.list("a/")] == ["a/b.json", "a/c/d.bin"]
    assert [o.key for o in store.list("")] == ["a/b.json", "a/c/d.bin", "z.txt"]
    assert [o.key for o in store.list("a/c")] == ["a/c/d.bin"]
    assert store.get_range("a/c/d.bin", 3, 4) == b"xxxx"
    store.delete("a/c/d.bin")
    store.delete("a/c/d.bin")  # deleting a missing key is fine
    assert not (tmp_path / "root" / "a" / "c").exists(), "empty folders are removed with their last object"
    with pytest.raises(ObjectNotFoundError, match=r"a/c/d\.bin"):
        store.get_bytes("a/c/d.bin")


def test_plain_put_overwrites_and_create_only_refuses(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    store.put_bytes("k", b"1")
    store.put_bytes("k", b"2")
    assert store.get_bytes("k") == b"2"
    with pytest.raises(ObjectExistsError, match="create-only"):
        store.put_bytes("k", b"3", create_only=True)
    assert store.get_bytes("k") == b"2"
    src = tmp_path / "src.bin"
    src.write_bytes(b"abc")
    with pytest.raises(ObjectExistsError):
        store.put_file("k", src, create_only=True)
    assert store.put_file("new", src, create_only=True).size == 3
    assert store.get_bytes("new") == b"abc"


def test_concurrent_create_only_puts_have_exactly_one_winner(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    results: list[str] = []
    barrier = threading.Barrier(8)

    def write(n: int) -> None:
        barrier.wait()
        try:
            store.put_bytes("cuts/1/manifest.json", f"writer {n}".encode(), create_only=True)
            results.append(f"won {n}")
        except ObjectExistsError:
            results.append("lost")

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r.startswith("won")]
    assert len(winners) == 1
    assert store.get_bytes("cuts/1/manifest.json") == f"writer {winners[0].split()[1]}".encode()
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".tmp-")], "no temporary files are left"


def test_temporary_files_are_never_listed(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    store.put_bytes("a/real", b"1")
    (tmp_path / "a" / ".tmp-real.123").write_bytes(b"half written")
    assert [o.key for o in store.list("a/")] == ["a/real"]


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a"])
def test_bad_keys_are_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(StorageError, match="invalid key"):
        LocalStorage(tmp_path).put_bytes(key, b"x")


def test_download_file_and_digest(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "s")
    store.put_bytes("w.pt", b"weights" * 1000)
    out = tmp_path / "copy"
    assert store.download_file("w.pt", out).size == 7000
    assert sha256_file(out) == sha256_file(store.path_of("w.pt"))


def test_open_storage_and_open_object(tmp_path: Path) -> None:
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert open_storage(tmp_path.as_uri()).uri == tmp_path.as_uri()  # type: ignore[union-attr]
    with pytest.raises(StorageError, match="unsupported"):
        open_storage("gs://bucket/x")
    store, key = open_object(str(tmp_path / "data" / "train.jsonl"))
    assert key == "train.jsonl"
    assert store.uri == (tmp_path / "data").as_uri()


def test_open_write_appears_whole_on_success_and_not_at_all_on_error(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    with store.open_write("w/state.pt") as f:
        f.write(b"part one,")
        assert store.head("w/state.pt") is None, "nothing is visible while it is written"
        f.write(b"part two")
    assert store.get_bytes("w/state.pt") == b"part one,part two"
    with pytest.raises(RuntimeError, match="serialiser failed"):
        write_then_fail(store, "w/broken.pt", b"half")
    assert store.head("w/broken.pt") is None
    assert [o.key for o in store.list("w/")] == ["w/state.pt"]
    with pytest.raises(ObjectExistsError), store.open_write("w/state.pt", create_only=True) as f:
        f.write(b"x")
    assert store.get_bytes("w/state.pt") == b"part one,part two"


def write_then_fail(store: Any, key: str, data: bytes) -> None:
    """Writes part of an object, then fails as a serialiser might."""
    with store.open_write(key) as f:
        f.write(data)
        raise RuntimeError("serialiser failed")
