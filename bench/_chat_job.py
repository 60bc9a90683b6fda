"""The CPU chat example (``examples/cpu-chat-gsm8k.yaml``) as a job file for a benchmark's runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def chat_job(path: Path, steps: int, **checkpoint: Any) -> Path:
    """Writes the example to ``path`` with ``steps`` steps and ``checkpoint`` fields set (its
    dataset path made absolute: the runs start elsewhere); returns ``path``. Without its
    validation: the benchmarks time training (and an older checkout, run by some of them for
    its "before", knows no ``spec.validation``)."""
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "cpu-chat-gsm8k.yaml").read_text())
    doc["spec"]["dataset"]["uri"] = str(ROOT / doc["spec"]["dataset"]["uri"])
    doc["spec"].pop("validation", None)
    doc["spec"]["training"]["totalSteps"] = steps
    doc["spec"]["checkpoint"].update(checkpoint)
    path.write_text(yaml.safe_dump(doc))
    return path
