"""A cut's policy as a Hugging Face folder: what a run trained, for evaluation or serving.

:func:`export_policy` runs the validation chain on the cut (every file's digest included, but
not the dataset's checks: no dataset is needed), loads the cut's weights into the base policy
the run started from (``spec.policy.model``: the architecture, tokenizer and generation config
come from there) with every name matched, and writes an ordinary folder that transformers,
vLLM and ``spec.policy.model`` load: config, safetensors, tokenizer, generation config, and
``spotrl-export.json`` naming the cut, its step and its manifest's sha256.

Both trainer formats export: a single process's ``torch.save`` cut and an FSDP group's sharded
``dcp/v1`` cut (the shards are gathered into one state here, in one process). The folder
appears whole or not at all (written beside it, then renamed).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotrl_runtime.checkpoint.layout import newest_committed
from spotrl_runtime.checkpoint.reader import StorageCutSource
from spotrl_runtime.core.validation import validate_cut
from spotrl_runtime.storage import Storage

EXPORT_FILE = "spotrl-export.json"


class ExportError(RuntimeError):
    """The cut cannot be exported as asked; the message says what to do."""


@dataclass(frozen=True)
class Exported:
    folder: Path
    cut_id: str
    trainer_step: int
    manifest_sha256: str


def export_policy(
    storage: Storage,
    base_model: str,
    out_dir: Path,
    *,
    cut_id: str | None = None,
    spool_dir: Path | None = None,
    dtype: str = "float32",
) -> Exported:
    """Writes the policy of ``cut_id`` (default: the newest committed cut) to ``out_dir``, which
    must not exist yet, its weights in ``dtype`` (a job's ``policy.dtype``: cuts hold float32
    masters, the job computes in its dtype). Raises the chain's ``CutCheckError`` for a cut that fails it, and
    :class:`ExportError` for the rest."""
    from spotrl_runtime.checkpoint.restore import sharded_cut, trainer_files
    from spotrl_runtime.checkpoint.sharded import DCP_FORMAT, load_sharded
    from spotrl_runtime.checkpoint.trainer_state import TorchSaveFormat
    from spotrl_runtime.models import load_policy

    if out_dir.exists():
        raise ExportError(f"--out {str(out_dir)!r} already exists; give a new folder")
    chosen = cut_id or newest_committed(storage)
    if chosen is None:
        raise ExportError(f"{storage.uri} holds no committed cut; nothing to export")
    model, tokenizer = load_policy(base_model)
    with StorageCutSource(storage, chosen, spool_dir) as source:
        validated = validate_cut(source, None)
        manifest = validated.manifest
        raw = source.read_manifest() or b""
        if manifest.trainer_format is None:
            raise ExportError(f"{source.location} holds no trainer state (a cut of a run without weights)")
        weights: Mapping[str, Any]
        if manifest.trainer_format == DCP_FORMAT:
            # DCP gathers what every rank saved into plain tensors shaped as the model's.
            shards = sharded_cut(storage, chosen, manifest, source)
            state = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
            load_sharded(state, storage, shards.folder, shards.files, spool_dir=spool_dir, no_dist=True)
            weights = state["model"]
        elif manifest.trainer_format in TorchSaveFormat.reads:
            # The weights alone: the optimizer's files (twice their size) are not read.
            weights = TorchSaveFormat().load({"weights": trainer_files(manifest, source).get("weights", [])}).weights
        else:
            raise ExportError(f"{source.location}: trainer format {manifest.trainer_format!r} is not one this reads")
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ExportError(
            f"{storage.uri}/cuts/{chosen}: its weights do not fit {base_model!r} ({str(err)[:300]}); "
            "give the policy the run was started with (-f its RLJob, or --base)"
        ) from None
    if dtype != "float32":
        import torch

        model = model.to(getattr(torch, dtype))
    step = int(validated.documents.trainer_step)
    out_dir = out_dir.absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        digest = hashlib.sha256(raw).hexdigest()
        (tmp / EXPORT_FILE).write_text(
            json.dumps(
                {
                    "storage": storage.uri,
                    "cut_id": chosen,
                    "trainer_step": step,
                    "manifest_sha256": digest,
                    "base_model": base_model,
                },
                indent=2,
            )
        )
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out_dir, chosen, step, digest)
