"""The chat demo's GSM8K-format word problems: the shipped Parquet files are exactly what the
generator makes, every row's answer is right and in GSM8K's form, and the test split is held
out from the train split and from the demo policy's pre-training corpus."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spotrl_runtime.api.rljob import Dataset as DatasetSpec
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.data import collate_for, open_dataset
from spotrl_runtime.data.parquet import ParquetDataset
from spotrl_runtime.data.word_problems import SPLITS, held_out, main, split_rows, word_problem
from spotrl_runtime.models.tiny_chat import DEFAULT_RECIPE
from spotrl_runtime.rewards.builtin import gsm8k, gsm8k_gold

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "examples" / "data" / "word-problems"
OPS = {"add": (r"(\d+) \+ (\d+)", lambda a, b: a + b), "sub": (r"(\d+) - (\d+)", lambda a, b: a - b)}
OPS["mul"] = (r"(\d+) \* (\d+)", lambda a, b: a * b)


SETS = [(split, digits) for split in sorted(SPLITS) for digits in (1, 2)]
FOLDERS = {1: SHIPPED, 2: ROOT / "examples" / "data" / "calculator-problems"}


@pytest.mark.parametrize(("split", "digits"), SETS)
def test_the_shipped_files_are_what_the_generator_makes(split: str, digits: int, tmp_path: Path) -> None:
    shipped_file = FOLDERS[digits] / f"{split}.parquet"
    shipped = ParquetDataset.open(str(shipped_file))
    assert [shipped[i] for i in range(len(shipped))] == split_rows(split, digits)
    assert main([str(tmp_path), *(["--digits=2"] if digits == 2 else [])]) == 0
    assert (tmp_path / f"{split}.parquet").read_bytes() == shipped_file.read_bytes(), (
        "the writer is deterministic: regenerate with python -m spotrl_runtime.data.word_problems "
        f"{FOLDERS[digits].relative_to(ROOT)}{' --digits=2' if digits == 2 else ''} after changing it"
    )


def test_the_calculator_problems_have_two_digit_operands() -> None:
    rows = split_rows("train", 2)
    operands = [int(n) for r in rows for n in re.findall(r"\d+", r["solution"].split("=")[0])]
    assert min(operands) >= 3
    assert sum(n >= 10 for n in operands) > 0.7 * len(operands)
    assert {r["task_name"] for r in rows} == {"add", "sub", "mul"}


@pytest.mark.parametrize(("split", "digits"), SETS)
def test_every_answer_is_right_and_marked_as_gsm8k_marks_it(split: str, digits: int) -> None:
    for row in split_rows(split, digits):
        pattern, op = OPS[row["task_name"]]
        a, b = (int(x) for x in re.search(pattern, row["solution"]).groups())  # type: ignore[union-attr]
        numbers = [int(n) for n in re.findall(r"\d+", row["question"])]
        assert a in numbers, row
        assert b in numbers, row
        assert str(op(a, b)) == row["answer"], row
        assert row["solution"].endswith(f"\n#### {row['answer']}")
        assert gsm8k_gold(row["solution"]) == gsm8k_gold(row["answer"])
        prompt = Prompt(idx=row["idx"], task_name=row["task_name"], text=row["question"], answer=row["answer"])
        assert gsm8k(prompt, row["solution"]) == 1.0


def test_the_test_split_is_held_out_from_train_and_from_pre_training() -> None:
    train = {r["question"] for r in split_rows("train")}
    test = [r["question"] for r in split_rows("test")]
    corpus = {word_problem(DEFAULT_RECIPE.corpus_seed, i)["question"] for i in range(DEFAULT_RECIPE.corpus_rows)}
    assert all(held_out(q) for q in test)
    assert not any(held_out(q) for q in train | corpus)
    assert not set(test) & (train | corpus)
    assert len(set(test)) > 0.9 * len(test), "few repeats within the split"
    assert {r["task_name"] for r in split_rows("test")} == {"add", "sub", "mul"}


def test_the_example_reads_them_through_its_spec_fields() -> None:
    spec = DatasetSpec(uri=str(SHIPPED / "test.parquet"), promptField="question", answerField="answer")
    dataset = open_dataset(spec)
    prompt = collate_for(spec)(dataset[5])
    row = split_rows("test")[5]
    assert (prompt.idx, prompt.task_name, prompt.text, prompt.answer) == (
        5,
        row["task_name"],
        row["question"],
        row["answer"],
    )
