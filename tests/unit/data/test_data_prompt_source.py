"""The prompt source: built-in and JSONL datasets, the one-row collate, the resumable loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spotrl_runtime.api.rljob import Dataset as DatasetSpec
from spotrl_runtime.data import (
    ArithmeticDataset,
    DatasetError,
    JsonlDataset,
    PromptCollate,
    collate_for,
    open_dataset,
    row_fingerprint,
)
from spotrl_runtime.data.loader import PromptLoader, epoch_order, loader_position


def test_arithmetic_rows_have_the_documented_shape_and_are_deterministic() -> None:
    ds = ArithmeticDataset(size=500, seed=3)
    rows = [ds[i] for i in range(len(ds))]
    assert rows == [ArithmeticDataset(size=500, seed=3)[i] for i in range(500)]
    assert rows != [ArithmeticDataset(size=500, seed=4)[i] for i in range(500)]
    assert {r["task_name"] for r in rows} == {"add", "sub"}
    for i, row in enumerate(rows):
        assert set(row) == {"idx", "task_name", "prompt", "answer"}
        assert row["idx"] == i
        a, op, b = row["prompt"][0], row["prompt"][1], row["prompt"][2]
        assert row["prompt"].endswith("=")
        assert len(row["prompt"]) == 4
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert row["answer"] == str(expected)
        assert expected >= 0
        assert (op == "+") == (row["task_name"] == "add")
    with pytest.raises(IndexError):
        ds[500]
    with pytest.raises(IndexError):
        ds[-1]


def test_open_dataset_builtin_and_jsonl(tmp_path: Path) -> None:
    ds = open_dataset(DatasetSpec(uri="builtin:arithmetic?size=64", seed=2))
    assert len(ds) == 64
    assert ds.uri == "builtin:arithmetic?size=64"
    assert len(open_dataset(DatasetSpec(uri="builtin:arithmetic"))) == 10_000
    with pytest.raises(DatasetError, match="unknown built-in"):
        open_dataset(DatasetSpec(uri="builtin:nope"))
    path = tmp_path / "train.jsonl"
    path.write_text('{"q": "2+2=", "a": 4, "kind": "add"}\n\n{"q": "3-1=", "a": 2}\n')
    spec = DatasetSpec(uri=str(path), promptField="q", answerField="a", taskField="kind")
    jsonl = open_dataset(spec)
    assert len(jsonl) == 2
    assert jsonl[1] == {"q": "3-1=", "a": 2, "idx": 1}
    prompts = [collate_for(spec)(jsonl[i]) for i in range(2)]
    assert [(p.idx, p.task_name, p.text, p.answer) for p in prompts] == [
        (0, "add", "2+2=", "4"),
        (1, "default", "3-1=", "2"),
    ]


def test_jsonl_errors_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="line 2 is not JSON"):
        JsonlDataset.from_bytes(b'{"prompt": "a"}\n{oops\n', "x.jsonl")
    with pytest.raises(DatasetError, match="line 1 has idx 5 but is row 0"):
        JsonlDataset.from_bytes(b'{"prompt": "a", "idx": 5}\n', "x.jsonl")
    with pytest.raises(DatasetError, match="cannot read dataset"):
        JsonlDataset.open(str(tmp_path / "missing.jsonl"))


def test_collate_fingerprint_tracks_content_and_missing_prompt_is_named() -> None:
    collate = PromptCollate()
    row = {"idx": 3, "task_name": "add", "prompt": "1+1=", "answer": "2"}
    p = collate(row)
    assert p.fingerprint == row_fingerprint(row)
    assert len(p.fingerprint) == 64
    assert collate(dict(row, answer="3")).fingerprint != p.fingerprint
    assert collate(dict(row)).fingerprint == p.fingerprint
    with pytest.raises(DatasetError, match="no field 'prompt'"):
        collate({"idx": 1, "text": "x"})


def _idxs(loader: PromptLoader, n: int) -> list[list[int]]:
    return [[p.idx for p in loader.next_batch()] for _ in range(n)]


def test_loader_is_a_seeded_shuffle_with_whole_batches_across_epochs() -> None:
    ds = ArithmeticDataset(size=10)
    loader = PromptLoader(ds, PromptCollate(), batch_size=4, shuffle=True, seed=7)
    batches = _idxs(loader, 5)  # 20 rows: two epochs
    assert all(len(b) == 4 for b in batches)
    flat = [i for b in batches for i in b]
    assert flat[:10] == epoch_order(10, 0, shuffle=True, seed=7)
    assert flat[10:20] == epoch_order(10, 1, shuffle=True, seed=7)
    assert sorted(flat[:10]) == list(range(10))
    assert flat[:10] != flat[10:20], "each epoch is a fresh permutation"
    assert loader.position().epoch == 2
    assert loader.position().offset == 0
    again = PromptLoader(ds, PromptCollate(), batch_size=4, shuffle=True, seed=7)
    assert _idxs(again, 5) == batches
    plain = PromptLoader(ds, PromptCollate(), batch_size=4, shuffle=False)
    assert [i for b in _idxs(plain, 3) for i in b] == [*range(10), 0, 1]


def test_loader_resumes_mid_epoch_from_a_json_state() -> None:
    ds = ArithmeticDataset(size=13)
    reference = PromptLoader(ds, PromptCollate(), batch_size=3, shuffle=True, seed=1)
    expected = _idxs(reference, 12)
    for cut in (0, 1, 4, 5, 9):
        loader = PromptLoader(ds, PromptCollate(), batch_size=3, shuffle=True, seed=1)
        head = _idxs(loader, cut)
        state = json.loads(json.dumps(loader.state_dict()))
        resumed = PromptLoader(ds, PromptCollate(), batch_size=3, shuffle=True, seed=1)
        resumed.load_state_dict(state)
        assert loader_position(state) == resumed.position()
        assert head + _idxs(resumed, 12 - cut) == expected, f"resume after {cut} batches"


def test_loader_refuses_a_state_for_another_dataset_size() -> None:
    loader = PromptLoader(ArithmeticDataset(size=13), PromptCollate(), batch_size=3)
    loader.next_batch()
    state = loader.state_dict()
    other = PromptLoader(ArithmeticDataset(size=12), PromptCollate(), batch_size=3)
    with pytest.raises(ValueError, match="13 rows"):
        other.load_state_dict(state)
