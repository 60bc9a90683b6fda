"""A cut's trainer files skip the zip CRC32 of ``torch.save`` (their sha256 covers them), and
torch's process-wide switch is what it was afterwards, however the writes end or overlap."""

from __future__ import annotations

import io
import threading
import zipfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from spotrl_runtime.checkpoint.trainer_state import TorchSaveFormat, TrainerSnapshot


@pytest.fixture(autouse=True)
def crc32_restored() -> Iterator[None]:
    before = torch.serialization.get_crc32_options()
    yield
    torch.serialization.set_crc32_options(before)


def snapshot() -> TrainerSnapshot:
    torch.manual_seed(0)
    weights = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    opt = {"state": {0: {"exp_avg": torch.randn(64, 64)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    return TrainerSnapshot(weights=weights, optimizer=opt, meta={"trainer_step": 3})


def written(snap: TrainerSnapshot) -> dict[str, bytes]:
    out = {}
    for tf in TorchSaveFormat().files(snap):
        buf = io.BytesIO()
        tf.write(buf)
        out[tf.name] = buf.getvalue()
    return out


def crcs(blob: bytes) -> list[int]:
    return [info.CRC for info in zipfile.ZipFile(io.BytesIO(blob)).infolist()]


def test_cut_files_have_no_zip_crc32_and_load_the_same() -> None:
    snap = snapshot()
    files = written(snap)
    plain = io.BytesIO()
    torch.save(dict(snap.weights), plain)
    assert any(crcs(plain.getvalue())), "a plain torch.save writes CRC32s (the switch is back on)"
    pt = {name: blob for name, blob in files.items() if name.endswith(".pt")}
    assert len(pt) == 2  # one weights part and the optimizer
    for name, blob in pt.items():
        assert not any(crcs(blob)), f"{name} carries zip CRC32s"
    weights = torch.load(io.BytesIO(pt["trainer/weights-00001-of-00001.pt"]), weights_only=True)
    assert weights.keys() == snap.weights.keys()
    assert all(torch.equal(weights[k], snap.weights[k]) for k in weights)
    opt = torch.load(io.BytesIO(pt["trainer/optimizer.pt"]), weights_only=True)
    assert torch.equal(opt["state"][0]["exp_avg"], snap.optimizer["state"][0]["exp_avg"])  # type: ignore[index]


@pytest.mark.parametrize("before", [True, False])
def test_the_switch_is_restored_after_a_write_and_after_a_failed_one(before: bool) -> None:
    torch.serialization.set_crc32_options(before)
    written(snapshot())
    assert torch.serialization.get_crc32_options() is before

    class Broken(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            raise OSError("disk gone")

    weights = TorchSaveFormat().files(snapshot())[0]
    with pytest.raises(Exception, match="disk gone"):
        weights.write(Broken())
    assert torch.serialization.get_crc32_options() is before


def test_overlapping_writes_all_skip_the_crc_and_the_last_one_out_restores_it() -> None:
    """Two files written side by side (as the cut writer does): the first to finish must not
    turn the CRC back on under the other."""
    torch.serialization.set_crc32_options(True)
    first_in, release = threading.Event(), threading.Event()

    class Held(io.BytesIO):
        def write(self, data: Any) -> int:
            first_in.set()
            assert release.wait(30)
            return super().write(data)

    files = TorchSaveFormat().files(snapshot())
    held = Held()
    t = threading.Thread(target=files[0].write, args=(held,))
    t.start()
    try:
        assert first_in.wait(30)
        other = io.BytesIO()
        files[1].write(other)  # starts and ends while the first is inside torch.save
        assert torch.serialization.get_crc32_options() is False, "still off: the first write is not done"
    finally:
        release.set()
        t.join(30)
    assert not any(crcs(held.getvalue()))
    assert not any(crcs(other.getvalue()))
    assert torch.serialization.get_crc32_options() is True
