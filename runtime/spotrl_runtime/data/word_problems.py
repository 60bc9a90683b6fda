"""Word problems in GSM8K's format, generated from code: the chat demo's dataset.

Each row is a pure function of ``(seed, idx)``, shaped as GSM8K rows are after the usual
preprocessing: ``question`` (the word problem), ``solution`` (a worked solution ending
``#### <number>``), ``answer`` (the number alone) and ``task_name`` (``add``, ``sub`` or
``mul``). The numbers are small (single-digit operands) so that a model of a few hundred
thousand parameters can learn them in seconds; what the demo is about is the format, the chat
template and the verifier, not the arithmetic.

    python -m spotrl_runtime.data.word_problems examples/data/word-problems
    python -m spotrl_runtime.data.word_problems examples/data/calculator-problems --digits=2

writes ``train.parquet`` and ``test.parquet`` there (the files the example ships). The two
splits use different seeds; a test checks that the shipped files are exactly what this module
generates.
"""

from __future__ import annotations

import hashlib
import random
import sys
from pathlib import Path

from spotrl_runtime.data.dataset import Row

SPLITS = {"train": (0, 2000), "test": (1, 200)}
"""Split → (seed, rows) of the shipped files."""
CALCULATOR_SPLITS = {"train": (2, 2000), "test": (3, 200)}
"""The calculator example's splits (two-digit operands), in ``examples/data/calculator-problems``."""
HELD_OUT = {"train": False, "test": True}
"""Which side of the partition each split's questions come from (:func:`held_out`)."""

SYSTEM_PROMPT = 'Solve the problem. Write the final answer after "####".'
"""The system turn the chat example sends (and the chat demo policy was pre-trained with)."""

NAMES = (
    ("Ava", "She"),
    ("Ben", "He"),
    ("Chloe", "She"),
    ("Dan", "He"),
    ("Ella", "She"),
    ("Finn", "He"),
    ("Grace", "She"),
    ("Hugo", "He"),
    ("Iris", "She"),
    ("Jack", "He"),
)
ITEMS = ("apples", "books", "cards", "coins", "eggs", "pens", "shells", "stamps", "marbles", "stickers")
CONTAINERS = ("bags", "boxes", "jars", "baskets")


def held_out(question: str) -> bool:
    """The partition of every possible question: a tenth of them (by a hash of the text) are
    held out. The test split draws only from those, the train split and the chat demo policy's
    pre-training corpus never: the test questions are ones the policy has never seen."""
    return hashlib.sha256(question.encode()).digest()[0] % 10 == 0


def word_problem(seed: int, idx: int, held: bool = False, digits: int = 1) -> Row:
    """Row ``idx`` of the split generated from ``seed``, from the held-out side of the
    partition if ``held``. ``digits`` 2: two-digit operands (the calculator example's problems,
    :data:`CALCULATOR_SPLITS`), beyond what a tiny model computes in its head."""
    # random.Random seeded with an int is stable across Python versions and processes.
    rng = random.Random(seed * 1_000_003 + idx)
    while True:
        row = _draw(rng, idx, digits)
        if held_out(row["question"]) == held:
            return row


def _draw(rng: random.Random, idx: int, digits: int = 1) -> Row:
    low, high = (1, 9) if digits == 1 else (10, 99)
    name, pronoun = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    task = rng.choice(("add", "sub", "mul"))
    if task == "add":
        a, b = rng.randint(low, high), rng.randint(low, high)
        c = a + b
        question = f"{name} has {a} {item}. {pronoun} gets {b} more {item}. How many {item} does {name} have now?"
        work = f"{name} has {a} + {b} = {c} {item}."
    elif task == "sub":
        b = rng.randint(low, high)
        c = rng.randint(low, high)
        a = b + c
        question = f"{name} has {a} {item}. {pronoun} gives {b} {item} to a friend. How many {item} are left?"
        work = f"{name} has {a} - {b} = {c} {item} left."
    else:
        a, b = (rng.randint(2, 5), rng.randint(2, 5)) if digits == 1 else (rng.randint(11, 49), rng.randint(3, 9))
        c = a * b
        box = rng.choice(CONTAINERS)
        question = f"{name} buys {a} {box} with {b} {item} in each. How many {item} does {name} buy?"
        work = f"{name} buys {a} * {b} = {c} {item}."
    return {
        "idx": idx,
        "task_name": task,
        "question": question,
        "solution": f"{work}\n#### {c}",
        "answer": str(c),
    }


def split_rows(split: str, digits: int = 1) -> list[Row]:
    """Every row of a shipped split (``digits`` 2: of the calculator example's)."""
    seed, size = (SPLITS if digits == 1 else CALCULATOR_SPLITS)[split]
    return [word_problem(seed, i, HELD_OUT[split], digits) for i in range(size)]


def write_parquet(rows: list[Row], path: Path, row_group_size: int = 500) -> None:
    """Writes rows as a Parquet file, column order as the rows have it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    # No statistics or creation time that could change from run to run: the files are committed.
    pq.write_table(table, path, row_group_size=row_group_size, compression="zstd", write_statistics=False)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or args[1:] not in ([], ["--digits=2"]):
        print("usage: python -m spotrl_runtime.data.word_problems FOLDER [--digits=2]", file=sys.stderr)
        return 2
    digits = 2 if args[1:] else 1
    for split in SPLITS:
        path = Path(args[0]) / f"{split}.parquet"
        write_parquet(split_rows(split, digits), path)
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
