"""Folders that Hugging Face ``datasets`` wrote with ``save_to_disk`` (written here by the real
library): the same prompts as the same rows in JSONL, across shards, a ``DatasetDict``'s split
by ``spec.dataset.split``, chat turns in a ``messages`` column, and errors that name the
folder, the file or the split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest

from spotrl_runtime.api.rljob import Dataset as DatasetSpec
from spotrl_runtime.data import DatasetError, collate_for, open_dataset
from spotrl_runtime.data.hf_disk import HFDiskDataset

ROWS = [
    {
        "question": f"Ava has {i} apples and gets {i + 1} more. How many?",
        "answer": str(2 * i + 1),
        "task_name": "add",
        "messages": [{"role": "user", "content": f"What is {i} + {i + 1}?"}],
    }
    for i in range(23)
]


@pytest.fixture(autouse=True)
def _quiet() -> None:
    datasets.disable_progress_bars()


def _spec(uri: str, **kw: Any) -> DatasetSpec:
    return DatasetSpec(uri=uri, promptField="question", answerField="answer", shuffle=False, **kw)


def test_a_sharded_dataset_gives_the_prompts_its_rows_give_as_jsonl(tmp_path: Path) -> None:
    folder = tmp_path / "gsm8k-like"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder), num_shards=3)
    assert len(list(folder.glob("data-*.arrow"))) == 3
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    disk = open_dataset(_spec(str(folder)))
    jsonl = open_dataset(_spec(str(tmp_path / "rows.jsonl")))
    assert isinstance(disk, HFDiskDataset)
    assert len(disk) == len(jsonl) == len(ROWS)
    collate = collate_for(_spec("x"))
    assert [collate(disk[i]) for i in range(len(ROWS))] == [collate(jsonl[i]) for i in range(len(ROWS))]
    assert disk[22]["idx"] == 22
    assert open_dataset(_spec(f"file://{folder}"))[7] == disk[7]
    with pytest.raises(IndexError):
        disk[len(ROWS)]


def test_a_dataset_dicts_split_is_chosen_by_spec_split(tmp_path: Path) -> None:
    folder = tmp_path / "dict"
    train, test = datasets.Dataset.from_list(ROWS[:20]), datasets.Dataset.from_list(ROWS[20:])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(folder))
    assert len(open_dataset(_spec(str(folder)))) == 20
    held_out = open_dataset(_spec(str(folder), split="test"))
    assert [held_out[i]["question"] for i in range(3)] == [r["question"] for r in ROWS[20:]]
    with pytest.raises(
        DatasetError, match=r"holds the splits \['train', 'test'\], not 'validation'.*spec.dataset.split"
    ):
        open_dataset(_spec(str(folder), split="validation"))


def test_a_messages_column_is_chat_turns(tmp_path: Path) -> None:
    folder = tmp_path / "chat"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    spec = DatasetSpec(uri=str(folder), promptField="messages", promptFormat="chat")
    prompt = collate_for(spec)(open_dataset(spec)[3])
    assert prompt.turns
    assert json.loads(prompt.text) == [{"role": "user", "content": "What is 3 + 4?"}]


def test_a_row_whose_own_idx_disagrees_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "idx"
    datasets.Dataset.from_list([{"idx": 5, "question": "q", "answer": "1"}]).save_to_disk(str(folder))
    with pytest.raises(DatasetError, match="row 0 has idx 5"):
        open_dataset(_spec(str(folder)))[0]


def test_damage_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "damaged"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder), num_shards=2)
    second = folder / "data-00001-of-00002.arrow"
    second.write_bytes(second.read_bytes()[:100])
    with pytest.raises(DatasetError, match=r"data-00001-of-00002\.arrow is not an Arrow stream"):
        open_dataset(_spec(str(folder)))
    second.unlink()
    with pytest.raises(DatasetError, match=r"data-00001-of-00002\.arrow, listed in state\.json, is missing"):
        open_dataset(_spec(str(folder)))
    (folder / "state.json").unlink()
    with pytest.raises(DatasetError, match=r"no state\.json; give a folder written by datasets. save_to_disk"):
        HFDiskDataset(folder, str(folder))
