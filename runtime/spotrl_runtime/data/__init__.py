"""The prompt source: map-style datasets, the one-row collate, and the resumable loader."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from spotrl_runtime.data.arithmetic import DEFAULT_SIZE, ArithmeticDataset
from spotrl_runtime.data.collate import PromptCollate, row_fingerprint
from spotrl_runtime.data.dataset import DatasetError, PromptDataset, Row
from spotrl_runtime.data.jsonl import JsonlDataset

if TYPE_CHECKING:
    from spotrl_runtime.api.rljob import Dataset as DatasetSpec

__all__ = [
    "ArithmeticDataset",
    "DatasetError",
    "JsonlDataset",
    "PromptCollate",
    "PromptDataset",
    "Row",
    "check_fields",
    "collate_for",
    "describe_dataset",
    "open_dataset",
    "reopen_dataset",
    "row_fingerprint",
]

_SPLIT_SEED_OFFSET = {"train": 0, "test": 1}


def open_dataset(spec: DatasetSpec, **s3_options: Any) -> PromptDataset:
    """The dataset ``spec.dataset`` names: ``builtin:arithmetic[?size=N]``, a JSONL or Parquet
    (``*.parquet``) file, or a folder written by datasets' ``save_to_disk`` (``spec.dataset.split``
    picks a ``DatasetDict``'s split): a path or an s3:// URI (a folder's ends with ``/``)."""
    uri = spec.uri
    if uri.startswith("builtin:"):
        name, _, query = uri[len("builtin:") :].partition("?")
        if name != "arithmetic":
            raise DatasetError(f"unknown built-in dataset {uri!r}; the built-in datasets are: builtin:arithmetic")
        params = parse_qs(query)
        try:
            size = int(params.get("size", [str(DEFAULT_SIZE)])[0])
        except ValueError:
            raise DatasetError(f"{uri!r}: size must be an integer") from None
        if spec.split not in _SPLIT_SEED_OFFSET:
            raise DatasetError(f"{uri!r} has the splits {sorted(_SPLIT_SEED_OFFSET)}, not {spec.split!r}")
        return ArithmeticDataset(size=size, seed=spec.seed + _SPLIT_SEED_OFFSET[spec.split])
    # A folder datasets' save_to_disk wrote (a local folder, or an s3:// prefix ending in /).
    from spotrl_runtime.data.hf_disk import HFDiskDataset, is_hf_disk_uri

    if is_hf_disk_uri(uri):
        return HFDiskDataset.open(uri, spec.split, **s3_options)
    # A file: a path, file:// or s3:// URI; Parquet by its name, else JSONL.
    if uri.lower().endswith((".parquet", ".pq")):
        from spotrl_runtime.data.parquet import ParquetDataset

        return ParquetDataset.open(uri, **s3_options)
    return JsonlDataset.open(uri, **s3_options)


def collate_for(spec: DatasetSpec) -> PromptCollate:
    """The one-row collate for the fields ``spec.dataset`` names."""
    return PromptCollate(task_field=spec.task_field, prompt_field=spec.prompt_field, answer_field=spec.answer_field)


FIELD_CHECK_ROWS = 1024
"""Rows :func:`check_fields` reads before a run starts (the first ones; a larger dataset's later
rows are read as the run reaches them)."""


def check_fields(dataset: PromptDataset, spec: DatasetSpec, *, answers: bool, rows: int = FIELD_CHECK_ROWS) -> None:
    """The first ``rows`` rows each hold ``spec.promptField``, and ``spec.answerField`` when the
    reward reads answers (``answers``): a dataset without them would give every row an empty
    answer, every reward 0 and every group zero variance, and the run would train nothing
    without a word. Raises :class:`DatasetError` naming the field, the row and its fields."""
    for idx in range(min(rows, len(dataset))):
        row = dataset[idx]
        for name, value in (("promptField", spec.prompt_field), ("answerField", spec.answer_field)):
            if name == "answerField" and not answers:
                continue
            if row.get(value) in (None, ""):
                raise DatasetError(
                    f"row idx {idx} has no {value!r} (spec.dataset.{name}); its fields are "
                    f"{sorted(k for k in row if k != 'idx')}: set spec.dataset.{name} to the field that holds it"
                )


def describe_dataset(spec: DatasetSpec, dataset: PromptDataset) -> dict[str, Any]:
    """What a cut's manifest records about the prompt source, so verify and restore can reopen
    and check it: the spec's fields plus the row count."""
    return {
        "uri": spec.uri,
        "split": spec.split,
        "seed": spec.seed,
        "shuffle": spec.shuffle,
        "task_field": spec.task_field,
        "prompt_field": spec.prompt_field,
        "answer_field": spec.answer_field,
        "size": len(dataset),
    }


def reopen_dataset(
    description: dict[str, Any], uri: str | None = None, **s3_options: Any
) -> tuple[PromptDataset, PromptCollate]:
    """The dataset and collate a manifest's ``dataset`` describes (``uri`` overrides where it lives)."""
    from spotrl_runtime.api.rljob import Dataset as DatasetSpec

    fields = {
        "uri": uri or description["uri"],
        "split": description.get("split", "train"),
        "seed": description.get("seed", 0),
        "shuffle": description.get("shuffle", True),
        "taskField": description.get("task_field", "task_name"),
        "promptField": description.get("prompt_field", "prompt"),
        "answerField": description.get("answer_field", "answer"),
    }
    spec = DatasetSpec.model_validate(fields)
    return open_dataset(spec, **s3_options), collate_for(spec)
