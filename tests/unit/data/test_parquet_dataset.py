"""Parquet datasets: the same prompts as the same rows in JSONL, one row group in memory
however large the file, and errors that name the file and the row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spotrl_runtime.api.rljob import Dataset as DatasetSpec
from spotrl_runtime.data import DatasetError, collate_for, open_dataset, reopen_dataset
from spotrl_runtime.data.parquet import ROW_GROUPS_KEPT, ParquetDataset

ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?", "answer": "72"},
    {"question": "Weng earns $12 an hour. How much for 50 minutes?", "answer": "10"},
    {"question": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}", "level": 2, "tags": ["fractions", "easy"]},
]


SCHEMA = pa.schema(
    [("question", pa.string()), ("answer", pa.string()), ("level", pa.int64()), ("tags", pa.list_(pa.string()))]
)


def _spec(uri: str) -> DatasetSpec:
    return DatasetSpec(uri=uri, promptField="question", answerField="answer", shuffle=False)


def test_the_same_rows_as_parquet_and_as_jsonl_give_the_same_prompts(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist(ROWS, schema=SCHEMA), tmp_path / "train.parquet")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    parquet = open_dataset(_spec(str(tmp_path / "train.parquet")))
    jsonl = open_dataset(_spec(str(tmp_path / "train.jsonl")))
    assert isinstance(parquet, ParquetDataset)
    assert len(parquet) == len(jsonl) == 3
    collate = collate_for(_spec("x.parquet"))
    # Parquet gives every row every column (missing ones as None), so compare the prompts' texts and
    # answers, and each file's fingerprints against themselves on a second read.
    for i in range(3):
        assert collate(parquet[i]).text == collate(jsonl[i]).text
        assert collate(parquet[i]).answer == collate(jsonl[i]).answer
        assert collate(parquet[i]) == collate(open_dataset(_spec(f"file://{tmp_path}/train.parquet"))[i])
    assert parquet[2]["tags"] == ["fractions", "easy"]
    assert parquet[0]["level"] is None
    # A cut's manifest reopens it by its description, as restore and `ckpt verify` do.
    again, _ = reopen_dataset({"uri": str(tmp_path / "train.parquet"), "prompt_field": "question"})
    assert [again[i] for i in range(3)] == [parquet[i] for i in range(3)]


@pytest.mark.slow
def test_a_million_rows_are_served_one_row_group_at_a_time(tmp_path: Path) -> None:
    n, group = 1_000_000, 50_000
    table = pa.table({"question": [f"q{i}" for i in range(n)], "answer": pa.array(range(n)).cast(pa.string())})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=group)
    whole = table.nbytes
    del table
    before = pa.total_allocated_bytes()
    ds = open_dataset(_spec(str(tmp_path / "big.parquet")))
    assert len(ds) == n
    assert ds[987_654] == {"question": "q987654", "answer": "987654", "idx": 987_654}
    assert ds[0]["question"] == "q0"
    assert ds[n - 1]["answer"] == str(n - 1)
    held = pa.total_allocated_bytes() - before
    assert held < whole / 5, f"{held} bytes held for 3 rows of a {whole}-byte table"
    for g in range(ROW_GROUPS_KEPT + 3):  # visiting more groups than it keeps evicts the oldest
        assert ds[g * group + 1]["idx"] == g * group + 1
    assert len(ds._groups) == ROW_GROUPS_KEPT  # type: ignore[attr-defined]


def test_errors_name_the_file_and_the_row(tmp_path: Path) -> None:
    pq.write_table(
        pa.Table.from_pylist([{"idx": 0, "question": "a"}, {"idx": 5, "question": "b"}]), tmp_path / "x.parquet"
    )
    ds = open_dataset(_spec(str(tmp_path / "x.parquet")))
    assert ds[0]["question"] == "a"
    with pytest.raises(DatasetError, match=r"x\.parquet: row 1 has idx 5; idx must be the row's position"):
        ds[1]
    with pytest.raises(IndexError, match="outside dataset"):
        ds[2]
    (tmp_path / "not.parquet").write_text('{"question": "a"}\n')
    with pytest.raises(DatasetError, match=r"not\.parquet: not a Parquet file"):
        open_dataset(_spec(str(tmp_path / "not.parquet")))
    pq.write_table(pa.table({"question": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(DatasetError, match=r"empty\.parquet: the file has no rows"):
        open_dataset(_spec(str(tmp_path / "empty.parquet")))
    with pytest.raises(DatasetError, match="no such file"):
        open_dataset(_spec(str(tmp_path / "missing.parquet")))
