"""The one-row collate: dataset row -> :class:`~spotrl_runtime.core.types.Prompt`.

Dispatch and restore both call this, so a prompt rebuilt from ``dataset[idx]`` after a
preemption is exactly the prompt that was first dispatched. The fingerprint is the sha256
of the whole row (canonical JSON); it lets restore notice a row edited under the same idx.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from spotrl_runtime.core.types import Prompt
from spotrl_runtime.data.dataset import DatasetError, Row

DEFAULT_TASK = "default"


def row_fingerprint(row: Row) -> str:
    """sha256 of the row's canonical JSON (sorted keys), as hex."""
    canonical = json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class PromptCollate:
    """Maps a row's fields (as ``spec.dataset`` names them) onto a Prompt."""

    task_field: str = "task_name"
    prompt_field: str = "prompt"
    answer_field: str = "answer"

    def __call__(self, row: Row) -> Prompt:
        idx = row.get("idx")
        if not isinstance(idx, int) or isinstance(idx, bool) or idx < 0:
            raise DatasetError(f"row has no valid idx (got {idx!r}); datasets must set each row's position as idx")
        if self.prompt_field not in row:
            raise DatasetError(
                f"row idx {idx} has no field {self.prompt_field!r}; set spec.dataset.promptField to the "
                f"field that holds the prompt (the row has {sorted(row)})"
            )
        task = row.get(self.task_field, DEFAULT_TASK)
        answer = row.get(self.answer_field, "")
        value = row[self.prompt_field]
        turns = isinstance(value, list)
        if turns and not all(isinstance(t, dict) and {"role", "content"} <= set(t) for t in value):
            raise DatasetError(
                f"row idx {idx}: field {self.prompt_field!r} is a list, but not of chat turns "
                '({"role": ..., "content": ...}); give it a string, or the turns of the HF messages convention'
            )
        return Prompt(
            idx=idx,
            task_name=str(task) if task not in (None, "") else DEFAULT_TASK,
            text=json.dumps(value, ensure_ascii=False) if turns else str(value),
            answer="" if answer is None else str(answer),
            fingerprint=row_fingerprint(row),
            turns=turns,
        )

    def batch(self, rows: list[Row]) -> list[Prompt]:
        """The loader's collate: one Prompt per row, in order."""
        return [self(row) for row in rows]
