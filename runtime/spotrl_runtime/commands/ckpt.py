"""`spotrl ckpt list|verify|inspect|export|delete URI`: look at a job's cuts without running
anything, export a policy from one, or delete them.

URI is a job's checkpoint root (then the newest committed cut is meant) or one cut
folder (``.../cuts/<id>``), as a local path, ``file://`` or ``s3://bucket/prefix`` URI.
S3 endpoint and credentials come from the flags or the environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``).

``verify`` runs the same validation chain as a restore and exits 0 only for a valid cut;
otherwise it prints the failed check's name and exits 1 (2 when it cannot even start,
e.g. the dataset cannot be opened). With ``-f RLJOB.yaml`` it also checks the cut against
the spec that would resume it (job, group and batch size, dataset, shuffle and seed): "will
this resume?" without starting a run. Only ``rollout_prompt_tokens`` (it needs the
policy's tokenizer) is left to the restore.

``delete URI --job NAMESPACE/NAME`` deletes what the job owns under its root (cuts, pointer,
audit, fence claims; nothing else), and only where URI is that job's own prefix
(``.../<namespace>/<name>``). Without ``--yes`` it lists what it would delete. The operator
runs it, in a pod with the job's credentials, for ``retentionPolicy: Delete``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_s3_flags(q: argparse.ArgumentParser) -> None:
    """How a command reaches S3; every command that reads a job's storage takes these."""
    q.add_argument("--endpoint", help="S3 endpoint URL (default: $AWS_ENDPOINT_URL)")
    q.add_argument("--region", help="S3 region (default: $AWS_REGION or us-east-1)")
    q.add_argument("--credentials-dir", help="folder with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY files")


def s3_options(args: argparse.Namespace) -> dict[str, Any]:
    """What :func:`add_s3_flags` parsed, as :func:`~spotrl_runtime.storage.open_storage` takes it."""
    return {"endpoint_url": args.endpoint, "region": args.region, "credentials_dir": args.credentials_dir}


def register(sub: Any) -> None:
    p = sub.add_parser("ckpt", help="list, verify, inspect, export and delete cuts (checkpoints)")
    cmds = p.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("uri", help="a job's checkpoint root or one cut folder (path, file:// or s3://)")
        add_s3_flags(q)
        q.add_argument("--json", action="store_true", help="machine-readable output")

    q = cmds.add_parser("list", help="every cut of a job: committed or torn, kind, step, size")
    common(q)
    q.set_defaults(func=run_list)
    q = cmds.add_parser("verify", help="run the validation chain on a cut; exit 0 only if it is valid")
    common(q)
    q.add_argument("--dataset", help="where the dataset is now, if not where the cut's manifest says")
    q.add_argument("--job", help="fail unless the cut belongs to this job (default with -f: the RLJob's)")
    q.add_argument("-f", "--filename", help="the RLJob YAML that would resume from the cut: check the cut against it")
    q.set_defaults(func=run_verify)
    q = cmds.add_parser("inspect", help="the owners a cut holds: loader, ledger, replay, spares, cursor, files")
    common(q)
    q.set_defaults(func=run_inspect)
    q = cmds.add_parser(
        "export",
        help="write a cut's policy as a Hugging Face folder (config, safetensors, tokenizer); a LoRA run's as a "
        "PEFT adapter folder",
    )
    common(q)
    q.add_argument("--out", required=True, help="the folder to write (must not exist)")
    base = q.add_mutually_exclusive_group(required=True)
    base.add_argument("-f", "--filename", help="the job's RLJob YAML: its spec.policy.model is the base policy")
    base.add_argument("--base", help="the policy the run started from (builtin:<name>, a folder or s3:// prefix)")
    q.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="the exported weights' dtype (default: the job's policy.dtype with -f, else float32; cuts hold float32)",
    )
    q.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run's cut: write the base with the adapter merged in, not the PEFT adapter folder",
    )
    q.set_defaults(func=run_export)
    q = cmds.add_parser("delete", help="delete a job's cuts, audit and pointer (only under its own prefix)")
    common(q)
    q.add_argument("--job", required=True, metavar="NAMESPACE/NAME", help="the job the root must belong to")
    q.add_argument("--yes", action="store_true", help="delete; without it, only list what would go")
    q.add_argument("--termination-log", help="also write the JSON result here (a pod's terminationMessagePath)")
    q.set_defaults(func=run_delete)


class _Target:
    """A resolved URI: the job root's store and the cut meant (None if the job has none)."""

    def __init__(self, args: argparse.Namespace):
        from spotrl_runtime.checkpoint.layout import CUTS, newest_committed, seq_of
        from spotrl_runtime.storage import open_storage

        uri = args.uri.rstrip("/")
        if uri.endswith("/manifest.json"):
            uri = uri[: -len("/manifest.json")]
        head, _, last = uri.rpartition("/")
        parent, _, cuts = head.rpartition("/")
        options = s3_options(args)
        if cuts == CUTS and seq_of(last) is not None:
            self.root = parent or "."
            self.storage = open_storage(self.root, **options)
            self.cut_id: str | None = last
        else:
            self.root = uri
            self.storage = open_storage(uri, **options)
            self.cut_id = None
        self.named_cut = self.cut_id is not None
        self.s3_options = options
        if self.cut_id is None:
            self.cut_id = newest_committed(self.storage)


def _print(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=1, sort_keys=True) if args.json else text)


# reserved, admitted (in flight), finished (replay buffer), spares
_COUNT_TAGS = (("reserved", "R"), ("admitted", "A"), ("replay", "F"), ("spares", "S"))


def _form(row: dict[str, Any]) -> str:
    """``full``, or ``delta on <base>``: a delta cut names the full cut it extends."""
    if not row.get("committed"):
        return "-"
    return f"delta on {row['base']}" if row.get("form") == "delta" else str(row.get("form") or "full")


def run_list(args: argparse.Namespace) -> int:
    from spotrl_runtime.checkpoint.layout import list_cut_folders, manifest_key, read_pointer
    from spotrl_runtime.storage import StorageError

    target = _Target(args)
    pointer = (read_pointer(target.storage) or {}).get("cut_id")
    rows: list[dict[str, Any]] = []
    for folder in list_cut_folders(target.storage):
        row: dict[str, Any] = {"cut_id": folder.cut_id, "committed": folder.committed, "size": folder.size}
        if folder.committed:
            try:
                m = json.loads(target.storage.get_bytes(manifest_key(folder.cut_id)))
                row |= {k: m.get(k) for k in ("kind", "trainer_step", "dispatch_index", "created_at", "group_counts")}
                row["form"] = m.get("form", "full")
                row["base"] = (m.get("base") or {}).get("cut_id")
            except (StorageError, ValueError) as err:
                row["error"] = str(err)
        row["latest"] = folder.cut_id == pointer
        rows.append(row)
    lines = [
        f"{'cut':<12} {'state':<10} {'kind':<9} {'form':<16} {'step':>6} {'cursor':>6} {'groups':>24} {'bytes':>12}  "
        "created"
    ]
    for r in rows:
        counts = r.get("group_counts") or {}
        groups = " ".join(f"{counts.get(k, 0)}{tag}" for k, tag in _COUNT_TAGS)
        lines.append(
            f"{r['cut_id']:<12} {'committed' if r['committed'] else 'torn':<10} {r.get('kind') or '-':<9} "
            f"{_form(r):<16} "
            f"{r.get('trainer_step', '-')!s:>6} {r.get('dispatch_index', '-')!s:>6} "
            f"{groups if r['committed'] else '-':>24} {r['size']:>12}  {r.get('created_at') or ''}"
            + ("  <- LATEST" if r["latest"] else "")
        )
    if not rows:
        lines = [f"{target.storage.uri}: no cuts"]
    _print(args, {"root": target.storage.uri, "cuts": rows}, "\n".join(lines))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from spotrl_runtime.checkpoint.ownership import prove_ownership
    from spotrl_runtime.checkpoint.restore import DatasetLookup, validate_stored_cut
    from spotrl_runtime.core.identity import JobIdentity
    from spotrl_runtime.core.validation import CHECKS, CutCheckError, Expectations, check_manifest
    from spotrl_runtime.data import DatasetError, reopen_dataset
    from spotrl_runtime.storage import StorageError

    target = _Target(args)
    if target.cut_id is None:
        return _fail(args, None, "manifest_present", f"{target.storage.uri} holds no committed cut", 1)
    from spotrl_runtime.checkpoint.reader import StorageCutSource

    expect = Expectations(job=args.job)
    job = None
    if args.filename:
        from spotrl_runtime.api.rljob import SpecError
        from spotrl_runtime.commands.run import load_job

        try:
            job = load_job(args.filename)
        except (SpecError, OSError, ValueError) as err:
            print(f"spotrl ckpt verify: {args.filename}: {err}", file=sys.stderr)
            return 2
    try:
        # Open the dataset the (parsed) manifest names; a bad manifest fails here with its check.
        with StorageCutSource(target.storage, target.cut_id) as source:
            manifest = check_manifest(source.location, source.read_manifest())
        try:
            if job is not None:
                dataset, collate, expect = _job_expectations(job, args, target.s3_options)
            else:
                dataset, collate = reopen_dataset(dict(manifest.dataset), args.dataset, **target.s3_options)
        except (DatasetError, StorageError, ValueError, KeyError) as err:
            print(
                f"cut {target.cut_id}: cannot open the dataset {manifest.dataset.get('uri')!r} to check prompts: "
                f"{err}; pass --dataset with where it is now",
                file=sys.stderr,
            )
            return 2
        if expect.job is not None:  # as a resume would, it refuses a store of another job
            who = JobIdentity(args.job) if args.job or job is None else JobIdentity.of(job.metadata)
            prove_ownership(target.storage, who, claim=False)
        validated = validate_stored_cut(target.storage, target.cut_id, DatasetLookup(dataset, collate), expect)
    except CutCheckError as err:
        return _fail(args, target.cut_id, err.check, err.detail, 1, err.path)
    except StorageError as err:
        print(f"cut {target.cut_id}: cannot read it: {err}", file=sys.stderr)
        return 2
    checks = list(validated.checks)
    data = {"cut_id": target.cut_id, "valid": True, "checks": checks, "all_checks": list(CHECKS)}
    _print(
        args,
        data,
        f"cut {target.cut_id} of {target.storage.uri}: valid (step {validated.manifest.trainer_step}, "
        f"{len(checks)} checks passed: {', '.join(checks)})",
    )
    return 0


def _job_expectations(job: Any, args: argparse.Namespace, s3_options: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The dataset a resume of ``job`` would open, and what the cut must match to resume it."""
    from spotrl_runtime.core.owners import RecoveryConfig
    from spotrl_runtime.core.validation import Expectations
    from spotrl_runtime.data import collate_for, describe_dataset, open_dataset

    spec = job.spec
    dataset_spec = spec.dataset if not args.dataset else spec.dataset.model_copy(update={"uri": args.dataset})
    dataset = open_dataset(dataset_spec, **s3_options)
    expect = Expectations(
        job=args.job or job.name,
        config=RecoveryConfig.from_spec(spec),
        dataset=describe_dataset(dataset_spec, dataset),
    )
    return dataset, collate_for(dataset_spec), expect


def _fail(
    args: argparse.Namespace, cut_id: str | None, check: str, message: str, rc: int, path: str | None = None
) -> int:
    if args.json:
        print(json.dumps({"cut_id": cut_id, "valid": False, "check": check, "path": path, "error": message}, indent=1))
    else:
        print(f"cut {cut_id}: FAILED check {check}: {message}", file=sys.stderr)
    return rc


def run_inspect(args: argparse.Namespace) -> int:
    from spotrl_runtime.checkpoint.reader import StorageCutSource
    from spotrl_runtime.core.cut_format import (
        DELTA_FILES,
        OWNER_AND_EPISODE_FILES,
        OwnerFileError,
        decode_delta_files,
        decode_owner_files,
    )
    from spotrl_runtime.core.validation import INDEX_ROLE, SHARD_ROLE, CutCheckError, check_manifest
    from spotrl_runtime.data.loader import loader_position
    from spotrl_runtime.storage import StorageError

    target = _Target(args)
    if target.cut_id is None:
        print(f"{target.storage.uri} holds no committed cut", file=sys.stderr)
        return 1
    with StorageCutSource(target.storage, target.cut_id) as source:
        try:
            manifest = check_manifest(source.location, source.read_manifest())
            blobs = {f.role: source.read(f.path) for f in manifest.files if f.role in OWNER_AND_EPISODE_FILES}
            docs = decode_owner_files(blobs)
            if manifest.is_delta:
                redo = {f.role: source.read(f.path) for f in manifest.files if f.role in DELTA_FILES}
                docs = decode_delta_files(docs, redo)
        except CutCheckError as err:
            return _fail(args, target.cut_id, err.check, err.detail, 1, err.path)
        except (OwnerFileError, StorageError) as err:
            print(f"cut {target.cut_id}: cannot read its owner files: {err}", file=sys.stderr)
            return 1
    pos = loader_position(docs.loader_state)
    replay = sorted(docs.replay, key=lambda g: (g.target_step, g.order))
    data: dict[str, Any] = {
        "cut_id": manifest.cut_id,
        "uri": source.location,
        "kind": manifest.kind,
        "form": manifest.form,
        "base": manifest.base.to_json() if manifest.base is not None else None,
        "redo_steps": [s.step for s in docs.redo_index],
        "job": manifest.job,
        "attempt": manifest.attempt,
        "created_at": manifest.created_at,
        "schema_version": manifest.schema_version,
        "trainer_step": docs.trainer_step,
        "sampler": {"dispatch_index": docs.dispatch_index, "lookahead": docs.config.lookahead},
        "config": docs.config.to_json(),
        "dataset": dict(manifest.dataset),
        "loader": {"epoch": pos.epoch, "offset": pos.offset, "batches": pos.batches},
        "ledger": docs.ledger_raw,
        "replay": [
            {
                "group_id": g.group_id,
                "idx": g.idx,
                "task_name": g.task_name,
                "target_step": g.target_step,
                "rollouts": g.rollouts,
            }
            for g in replay
        ],
        "episodes": [
            {"group_id": e.group_id, "index": e.index, "turns": e.turns, "tokens": len(e.completion_token_ids)}
            for e in docs.episodes
        ],
        "spare_pool": [s.to_json() for s in docs.spares],
        "shortfall": {str(k): v for k, v in docs.shortfall.items()},
        "dropped": {str(k): [d.to_json() for d in v] for k, v in docs.dropped.items()},
        "group_counts": dict(manifest.group_counts),
        "audit_tail": [a.to_json() for a in docs.audit_tail],
        "trainer_format": manifest.trainer_format,
        "trainer_files": {
            "shards": sum(1 for f in manifest.files if f.role == SHARD_ROLE),
            "shard_bytes": sum(f.size for f in manifest.files if f.role == SHARD_ROLE),
            "index": next((f.path for f in manifest.files if f.role == INDEX_ROLE), None),
            "bytes": sum(f.size for f in manifest.files if f.path.startswith(f"{manifest.data_dir}/trainer/")),
        },
        "files": [{"path": f.path, "role": f.role, "size": f.size, "sha256": f.sha256} for f in manifest.files],
    }
    _print(args, data, _inspect_text(data))
    return 0


def _inspect_text(d: dict[str, Any]) -> str:
    out = [
        f"cut {d['cut_id']} ({d['kind']}) of job {d['job'] or '-'}, attempt {d['attempt']}, {d['created_at']}",
        f"  {d['uri']}",
        *(
            [
                f"delta on      full cut {d['base']['cut_id']} (step {d['base']['trainer_step']}); redo steps "
                f"{d['redo_steps'][0] if d['redo_steps'] else '-'}..{d['redo_steps'][-1] if d['redo_steps'] else '-'}"
            ]
            if d["base"]
            else []
        ),
        f"trainer step   {d['trainer_step']}",
        f"sampler cursor {d['sampler']['dispatch_index']} (lookahead {d['sampler']['lookahead']})",
        f"loader         epoch {d['loader']['epoch']}, offset {d['loader']['offset']}, "
        f"{d['loader']['batches']} batches yielded ({d['dataset'].get('uri')}, {d['dataset'].get('size')} rows)",
        f"ledger         {len(d['ledger'])} groups",
    ]
    for r in d["ledger"]:
        out.append(
            f"  {r.get('group_id')!s:<10} {r.get('phase')!s:<9} step {r.get('target_step')!s:<5} "
            f"idx {r.get('idx')!s:<8} {r.get('task_name')!s:<12} admission {r.get('admission_id')}"
        )
    out.append(f"replay buffer  {len(d['replay'])} finished groups")
    for g in d["replay"]:
        out.append(
            f"  {g['group_id']:<10} step {g['target_step']:<5} idx {g['idx']:<8} {g['task_name']:<12} "
            f"{g['rollouts']} rollouts"
        )
    if d["episodes"]:
        turns = sum(e["turns"] for e in d["episodes"])
        out.append(f"episodes       {len(d['episodes'])} unfinished, {turns} finished turns kept")
        for e in d["episodes"]:
            out.append(f"  {e['group_id'] + '/' + str(e['index']):<12} {e['turns']} turns, {e['tokens']} tokens")
    out.append(
        f"spare pool     {len(d['spare_pool'])} prompts: "
        + ", ".join(f"{s['group_id']} (idx {s['idx']})" for s in d["spare_pool"])
    )
    if d["shortfall"]:
        out.append(f"shortfall      {d['shortfall']}")
    out.append(f"audit tail     {len(d['audit_tail'])} trained steps")
    t = d["trainer_files"]
    trainer = f"trainer        {d['trainer_format'] or 'none'}, {t['bytes']} bytes"
    if t["shards"] or t["index"]:
        trainer += f" ({t['shards']} shards, {t['shard_bytes']} bytes; index {t['index'] or 'missing'})"
    out.append(trainer)
    out.append("files")
    for f in d["files"]:
        out.append(f"  {f['path']:<44} {f['role']:<14} {f['size']:>12}  {f['sha256']}")
    return "\n".join(out)


def run_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from spotrl_runtime.checkpoint.export import ExportError, export_policy
    from spotrl_runtime.core.validation import CutCheckError

    base, dtype = args.base, args.dtype or "float32"
    if args.filename:
        from spotrl_runtime.commands.preflight import load_rljob_file

        policy = load_rljob_file(args.filename).spec.policy
        base, dtype = policy.model, args.dtype or policy.dtype
    target = _Target(args)
    try:
        done = export_policy(
            target.storage,
            base,
            Path(args.out),
            cut_id=target.cut_id if target.named_cut else None,
            dtype=dtype,
            merge=args.merge,
        )
    except CutCheckError as err:
        print(f"not exported: cut fails check {err.check}: {err}", file=sys.stderr)
        return 1
    except ExportError as err:
        print(f"not exported: {err}", file=sys.stderr)
        return 1
    data = {"folder": str(done.folder), "cut_id": done.cut_id, "trainer_step": done.trainer_step}
    _print(
        args,
        data | {"manifest_sha256": done.manifest_sha256},
        f"cut {done.cut_id} (step {done.trainer_step}) -> {done.folder}",
    )
    return 0


def run_delete(args: argparse.Namespace) -> int:
    """Torch-free (it runs in the operator's image): storage and the purge module only."""
    from spotrl_runtime.storage import StorageError, open_storage
    from spotrl_runtime.storage.purge import job_keys, job_prefix_problem, purge

    namespace, sep, name = args.job.partition("/")
    if not sep or not namespace or not name or "/" in name:
        print(f"spotrl ckpt delete: --job {args.job!r}: expected NAMESPACE/NAME", file=sys.stderr)
        return 2
    uri = args.uri.rstrip("/")
    problem = job_prefix_problem(uri, namespace, name)
    if problem:
        print(f"spotrl ckpt delete: refused: {problem}", file=sys.stderr)
        return 2
    try:
        store = open_storage(uri, **s3_options(args))
        keys = purge(store) if args.yes else job_keys(store)
    except StorageError as err:
        print(f"spotrl ckpt delete: {uri}: {err}", file=sys.stderr)
        return 1
    result = {"root": uri, "deleted" if args.yes else "would_delete": len(keys)}
    if args.termination_log:
        with open(args.termination_log, "w") as f:
            json.dump(result, f)
    verb = "deleted" if args.yes else "would delete (run again with --yes)"
    _print(args, {**result, "keys": keys}, f"{uri}: {verb} {len(keys)} objects")
    return 0
