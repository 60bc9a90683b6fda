"""A cut's policy as a Hugging Face folder: what a run trained, for evaluation or serving.

:func:`export_policy` runs the validation chain on the cut (every file's digest included, but
not the dataset's checks: no dataset is needed), loads the cut's weights into the base policy
the run started from (``spec.policy.model``: the architecture, tokenizer and generation config
come from there) with every name matched, and writes an ordinary folder that transformers,
vLLM and ``spec.policy.model`` load: config, safetensors, tokenizer, generation config, and
``spotrl-export.json`` naming the cut, its step and its manifest's sha256.

Both trainer formats export: a single process's ``torch.save`` cut and an FSDP group's sharded
``dcp/v1`` cut (the shards are gathered into one state here, in one process). A LoRA run's cut
exports as a PEFT adapter folder (vLLM, ``PeftModel.from_pretrained`` and ``spec.policy.model``
load it), or merged into its base (``merge``). The folder appears whole or not at all (written
beside it, then renamed).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotrl_runtime.checkpoint.layout import newest_committed
from spotrl_runtime.checkpoint.reader import StorageCutSource
from spotrl_runtime.core.validation import validate_cut
from spotrl_runtime.models import lora
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
    merge: bool = False,
) -> Exported:
    """Writes the policy of ``cut_id`` (default: the newest committed cut) to ``out_dir``, which
    must not exist yet, its weights in ``dtype`` (a job's ``policy.dtype``: cuts hold float32
    masters, the job computes in its dtype). A LoRA run's cut is written as a PEFT adapter folder
    (``adapter_config.json``, ``adapter_model.safetensors``, the tokenizer), or with ``merge`` as
    the base with the adapter merged in. Raises the chain's ``CutCheckError`` for a cut that
    fails it, and :class:`ExportError` for the rest."""
    from spotrl_runtime.models import load_policy

    if out_dir.exists():
        raise ExportError(f"--out {str(out_dir)!r} already exists; give a new folder")
    chosen = cut_id or newest_committed(storage)
    if chosen is None:
        raise ExportError(f"{storage.uri} holds no committed cut; nothing to export")
    with StorageCutSource(storage, chosen, spool_dir) as source:
        validated = validate_cut(source, None)
        raw = source.read_manifest() or b""
        adapter = _adapter_of(storage, chosen, validated.manifest, source, base_model)
        model, tokenizer = load_policy(base_model)  # once the cut and its base are known to fit
        if adapter is not None:
            lora.add_adapter(model, _lora_spec(adapter), base=adapter.base)
        weights = _cut_weights(storage, chosen, validated.manifest, source, model, spool_dir)
    what = "adapter" if adapter is not None else "weights"
    try:
        if adapter is not None:
            own = lora.adapter_tensors(model, keep_vars=True)
            if set(own) != set(weights):
                raise RuntimeError(f"adapter tensors {sorted(set(own) ^ set(weights))[:3]} do not match")
        else:
            model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ExportError(
            f"{storage.uri}/cuts/{chosen}: its {what} do not fit {base_model!r} ({str(err)[:300]}); "
            "give the policy the run was started with (-f its RLJob, or --base)"
        ) from None
    step = int(validated.documents.trainer_step)
    digest = hashlib.sha256(raw).hexdigest()
    record = {
        "storage": storage.uri,
        "cut_id": chosen,
        "trainer_step": step,
        "manifest_sha256": digest,
        "base_model": base_model,
    }

    def write(tmp: Path) -> None:
        if adapter is None:
            _cast(model, dtype).save_pretrained(tmp)
        elif not merge:
            lora.write_peft_folder(weights, adapter, base_model, tmp, dtype=_torch_dtype(dtype))
        else:
            with tempfile.TemporaryDirectory() as folder:
                lora.write_peft_folder(weights, adapter, base_model, Path(folder))
                merged, _ = lora.merged(Path(folder), dtype)
                merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_FILE).write_text(json.dumps(record | {"merged": bool(adapter and merge)}, indent=2))

    _write_whole(out_dir, write)
    return Exported(out_dir.absolute(), chosen, step, digest)


def _adapter_of(storage: Storage, cut_id: str, manifest: Any, source: Any, base_model: str) -> Any:
    """The cut's adapter identity (None: a full policy's cut), its base checked against ``base_model``."""
    from spotrl_runtime.models import resolve_model_dir

    meta_file = manifest.file("trainer_meta")
    if manifest.trainer_format is None or meta_file is None:
        raise ExportError(f"{storage.uri}/cuts/{cut_id} holds no trainer state (a cut of a run without weights)")
    saved = json.loads(source.read(meta_file.path)).get("adapter")
    if saved is None:
        return None
    identity = lora.AdapterIdentity(saved["base"], int(saved["rank"]), float(saved["alpha"]), tuple(saved["targets"]))
    if lora.base_digest(resolve_model_dir(base_model)) != identity.base:
        raise ExportError(
            f"{storage.uri}/cuts/{cut_id} holds a LoRA adapter trained on another base than {base_model!r} (its "
            "files' digest differs); give the policy the run was started with (-f its RLJob, or --base)"
        )
    return identity


def _lora_spec(identity: Any) -> Any:
    from spotrl_runtime.api.rljob import Lora

    return Lora(rank=identity.rank, alpha=identity.alpha, target_modules=list(identity.targets))


def _cut_weights(
    storage: Storage, cut_id: str, manifest: Any, source: Any, model: Any, spool_dir: Path | None
) -> Mapping[str, Any]:
    """What the cut's trainer trained, by name: the whole policy's weights, or the adapter's."""
    from spotrl_runtime.checkpoint.restore import sharded_cut, trainer_files
    from spotrl_runtime.checkpoint.sharded import DCP_FORMAT, load_sharded
    from spotrl_runtime.checkpoint.trainer_state import TorchSaveFormat

    if manifest.trainer_format == DCP_FORMAT:
        # DCP gathers what every rank saved into plain tensors shaped as the model's.
        shards = sharded_cut(storage, cut_id, manifest, source)
        trained = lora.adapter_tensors(model) if lora.has_adapter(model) else model.state_dict()
        state = {"model": {k: v.clone() for k, v in trained.items()}}
        load_sharded(state, storage, shards.folder, shards.files, spool_dir=spool_dir, no_dist=True)
        return dict(state["model"])
    if manifest.trainer_format in TorchSaveFormat.reads:
        # The weights alone: the optimizer's files (twice their size) are not read.
        return TorchSaveFormat().load({"weights": trainer_files(manifest, source).get("weights", [])}).weights
    raise ExportError(f"{source.location}: trainer format {manifest.trainer_format!r} is not one this reads")


def _torch_dtype(dtype: str) -> Any:
    import torch

    return getattr(torch, dtype)


def _cast(model: Any, dtype: str) -> Any:
    return model if dtype == "float32" else model.to(_torch_dtype(dtype))


def _write_whole(out_dir: Path, write: Callable[[Path], None]) -> None:
    """``write`` fills a sibling temp folder, renamed to ``out_dir`` once whole."""
    out_dir = out_dir.absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write(tmp)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
