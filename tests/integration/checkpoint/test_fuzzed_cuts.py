"""Fuzz: one value anywhere in a cut's JSON files replaced by one of another type or range, the
file's size and digest recomputed (a writer's bug, or an edit that recomputed the digests), and
the cut resumed as a controller resumes it (``resume_or_start`` with the job's expectations and
prompt encoder, into a trainer). Each mutation must end one of three ways:

- refused by a named check of the chain (a :class:`CutCheckError` whose check is in ``CHECKS``);
- accepted with exactly the unmutated cut's state (:func:`state_of`: everything the run goes on
  from): the mutation changed nothing the run reads back, such as a no-op or ``capture_seconds``;
- for a :data:`PAYLOAD` field (what generation produced or the audit recorded, which no other
  record holds, so only the file's digest vouches for it): accepted with a value of the field's
  own JSON type, carried into the state as written, and nothing else changed.

Anything else is a mutation silently accepted with a different state; the test lists each and
fails. A no-op (a value replaced by an equal one) must be accepted: no false refusal either.

Every place of every file is mutated once, with values drawn by a seed, then random (place,
value) pairs up to :data:`MUTATIONS`. The seed is drawn per run and printed;
``SPOTRL_FUZZ_SEED=<seed>`` replays a run, ``SPOTRL_FUZZ_MUTATIONS=<n>`` (``all``: every pair,
about a minute) sets how many."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
import shutil
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cut_scenarios import DATASET, EXAMPLE_B, JOB, dataset_description, example_b_before_cut, loader_for

from spotrl_e2e.forgery import CutSurgery
from spotrl_runtime.checkpoint.resume import Start, resume_or_start
from spotrl_runtime.core.cut_format import encode_owner_files
from spotrl_runtime.core.identity import JobIdentity
from spotrl_runtime.core.validation import CHECKS, CutCheckError
from spotrl_runtime.data import PromptCollate
from spotrl_runtime.storage import LocalStorage

ROLES = ["manifest", "sampler", "loader", "ledger", "spare_pool", "replay_index", "audit", "trainer_meta", "rollouts"]
VALUES = [None, "", "x", "a1", "g1", -1, 0, 1, 7, 10**12, 1.5, True, [], {}, ["a"], {"k": 1}, [[0, 1]], [[5, 3]]]
MUTATIONS = 1500
"""Mutations per run (of about 7,500 (place, value) pairs); each place at least once."""

Place = tuple[Any, ...]
ANY = "*"
"""In a :data:`PAYLOAD` place: any index of a list."""

PAYLOAD: dict[tuple[str, Place], frozenset[str]] = {
    # A rollout row: [group_id, index, reward, weight_version, text, finish_reason, 3 counts].
    # Generation's output, and which siblings of a partial group are done.
    ("rollouts", ("rows", ANY, 1)): frozenset({"integer"}),
    ("rollouts", ("rows", ANY, 2)): frozenset({"integer", "number"}),
    ("rollouts", ("rows", ANY, 3)): frozenset({"integer"}),
    ("rollouts", ("rows", ANY, 4)): frozenset({"string"}),
    ("rollouts", ("rows", ANY, 5)): frozenset({"string"}),
    # The audit tail: what past steps trained and dropped, as recorded then.
    ("audit", ("records", ANY, "attempt")): frozenset({"integer"}),
    ("audit", ("records", ANY, "weight_version")): frozenset({"integer"}),
    ("audit", ("records", ANY, "task_names", ANY)): frozenset({"string"}),
    ("audit", ("records", ANY, "dropped")): frozenset({"array"}),
    ("audit", ("records", ANY, "dropped", ANY, "reason")): frozenset({"string"}),
    ("audit", ("records", ANY, "dropped", ANY, "task_name")): frozenset({"string"}),
    # The policy version a group was generated with, and the admission it came in with (a label
    # any other admission of the same phase and stamp could carry).
    ("ledger", ("records", ANY, "weight_version")): frozenset({"integer", "null"}),
    ("ledger", ("records", ANY, "admission_id")): frozenset({"string"}),
    ("replay_index", ("groups", ANY, "weight_version")): frozenset({"integer", "null"}),
    ("replay_index", ("groups", ANY, "admission_id")): frozenset({"string"}),
}
"""Places only the file's digest vouches for -> the JSON types a value there may have."""


@dataclasses.dataclass
class Trainer:
    """What ``resume_or_start`` loads a ``torch.save`` cut into: the scenario's model and optimizer."""

    model: torch.nn.Linear
    optimizer: torch.optim.Optimizer
    step: int = 0

    @classmethod
    def new(cls) -> Trainer:
        model = torch.nn.Linear(4, 1)
        return cls(model, torch.optim.AdamW(model.parameters(), lr=0.05))

    def load_trained_state(self, weights: Any) -> None:
        self.model.load_state_dict(weights, strict=True)


@dataclasses.dataclass(frozen=True)
class Cut:
    """The unmutated cut: its folder, its id and the state it resumes to."""

    root: Path
    cut_id: str
    state: dict[str, Any]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Cut:
    """A committed cut of worked example B after one trained step (finished, in-flight,
    reserved and spare groups, an audit record, a shortfall-free borrow)."""
    root = tmp_path_factory.mktemp("fuzz") / "job"
    run = example_b_before_cut(LocalStorage(root))
    run.finish("g3", (0,))
    run.train()
    run.pump()
    run.cut()
    cut_id = CutSurgery.only_cut(root).cut.name
    state = resumed(copy_of(root, tmp_path_factory.mktemp("reference")), cut_id)
    assert resumed(copy_of(root, tmp_path_factory.mktemp("again")), cut_id) == state, "a resume is repeatable"
    return Cut(root, cut_id, state)


def copy_of(root: Path, parent: Path) -> Path:
    return Path(shutil.copytree(root, parent / "job"))


def resumed(root: Path, cut_id: str) -> dict[str, Any]:
    """The state a controller resumes to from ``cut_id`` (raises the chain's refusal). The RNG
    streams start from one seed, so a cut whose RNG did not load shows."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    trainer = Trainer.new()
    start = resume_or_start(
        LocalStorage(root),
        job=JobIdentity(JOB),
        config=EXAMPLE_B,
        dataset=DATASET,
        collate=PromptCollate(),
        loader=loader_for(EXAMPLE_B, DATASET),
        trainer=trainer,
        resume=cut_id,
        attempt=1,
        latest_audited_attempt=lambda: None,
        dataset_description=dataset_description(DATASET),
        encode=lambda prompt: [ord(c) for c in prompt.text],
    )
    return state_of(start, trainer)


def state_of(start: Start, trainer: Trainer) -> dict[str, Any]:
    """Everything the run goes on from: the owners (as the next cut writes them), their prompts
    and counters, the rows the loader yields next (its position's meaning; the rest of its
    state_dict is torchdata's bookkeeping), the trainer's weights, optimizer, step and RNG
    streams, the redo steps, and the manifest's facts the controller reads (its resume info)."""
    assert start.restored is not None
    snapshot = start.owners.capture()
    files = encode_owner_files(snapshot)
    del files["loader"]
    manifest = start.restored.manifest
    return {
        "owners": files,
        "prompts": plain(dict(sorted(snapshot.prompts.items()))),
        "counters": plain(start.owners.counters),
        "next_rows": next_rows(snapshot.loader_state),
        "trainer": plain(
            {
                "weights": trainer.model.state_dict(),
                "optimizer": trainer.optimizer.state_dict(),
                "step": trainer.step,
                "rng": (torch.get_rng_state(), np.random.get_state(), random.getstate()),
            }
        ),
        "redo": plain(start.restored.redo),
        "manifest": plain(
            {
                "cut_id": start.restored.cut_id,
                "kind": manifest.kind,
                "created_at": manifest.created_at,
                "form": manifest.form,
                "trainer_step": manifest.trainer_step,
                "base": None if manifest.base is None else (manifest.base.cut_id, manifest.base.trainer_step),
            }
        ),
    }


def next_rows(loader_state: dict[str, Any]) -> list[int] | str:
    """The rows a loader resumed at ``loader_state`` reads next, past an epoch's end; or how it
    fails (a state the chain passed that breaks the loader later)."""
    loader = loader_for(EXAMPLE_B, DATASET)
    try:
        loader.load_state_dict(json.loads(json.dumps(loader_state)))
        return [p.idx for _ in range(40) for p in loader.next_batch()]
    except Exception as err:
        return f"the loader fails: {type(err).__name__}: {err}"


def plain(x: Any) -> Any:
    """``x`` as comparable values: tensors and arrays as (dtype, shape, bytes), scalars with
    their type (``True`` is not ``1``)."""
    if isinstance(x, torch.Tensor):
        raw = x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        return ("tensor", str(x.dtype), tuple(x.shape), raw)
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.shape, x.tobytes())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)})
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return (type(x).__name__, [plain(v) for v in x])
    return (type(x).__name__, x)


# ------------------------------------------------------------------ mutations


def document(cut: CutSurgery, role: str) -> tuple[Any, bytes]:
    """A file's JSON document and, for the rollout rows, the arrays after it."""
    if role == "manifest":
        return cut.m, b""
    blob = cut.path(role).read_bytes()
    if role == "rollouts":  # SPOTRLR1 + u64 length + the JSON row table, then the arrays
        (length,) = struct.unpack_from("<Q", blob, 8)
        return json.loads(blob[16 : 16 + length]), blob[16 + length :]
    return json.loads(blob), b""


def places(doc: Any, at: Place = ()) -> list[Place]:
    """Every place in a JSON document (containers and scalars), as key paths."""
    out = [at]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += places(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += places(v, (*at, i))
    return out


def at(doc: Any, place: Place) -> Any:
    for k in place:
        doc = doc[k]
    return doc


def put(doc: Any, place: Place, value: Any) -> Any:
    if not place:
        return value
    at(doc, place[:-1])[place[-1]] = value
    return doc


def mutate(root: Path, role: str, place: Place, value: Any) -> Any:
    """Puts ``value`` at ``place`` of the cut's ``role`` file, its size and digest recomputed;
    returns the mutated document."""
    cut = CutSurgery.only_cut(root)
    doc, arrays = document(cut, role)
    doc = put(doc, place, value)
    if role == "manifest":  # the manifest has no digest: any edit is possible
        cut.m = doc
        cut.save_manifest()
        return doc
    data = json.dumps(doc).encode()
    if role == "rollouts":
        data = b"SPOTRLR1" + struct.pack("<Q", len(data)) + data + arrays
    cut.replace(role, data)
    return doc


def mutations(root: Path, rng: random.Random, count: int | None) -> list[tuple[str, Place, Any]]:
    """Each place once with a value ``rng`` draws, then random other pairs up to ``count``
    (None: every pair)."""
    cut = CutSurgery.only_cut(root)
    spots = [(role, place) for role in ROLES for place in places(document(cut, role)[0])]
    pairs = [(role, place, i) for role, place in spots for i in range(len(VALUES))]
    if count is None:
        return [(role, place, VALUES[i]) for role, place, i in pairs]
    first = [(role, place, rng.randrange(len(VALUES))) for role, place in spots]
    rest = sorted(set(pairs) - set(first))
    chosen = first + rng.sample(rest, max(0, min(len(rest), count - len(first))))
    return [(role, place, VALUES[i]) for role, place, i in chosen]


# ------------------------------------------------------------------ outcomes


def canonical(value: Any) -> str:
    """JSON with its types: ``true``, ``1`` and ``1.0`` differ."""
    return json.dumps(value, sort_keys=True)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def payload_types(role: str, place: Place) -> frozenset[str] | None:
    """The JSON types a :data:`PAYLOAD` place may hold (None: not a payload place)."""

    def matches(pattern: Place) -> bool:
        return len(pattern) == len(place) and all(
            isinstance(q, int) if p == ANY else p == q for p, q in zip(pattern, place, strict=True)
        )

    return next((types for (r, pattern), types in PAYLOAD.items() if r == role and matches(pattern)), None)


def as_written(base: Cut, state: dict[str, Any], role: str, doc: Any) -> bool:
    """Whether the state's owner file ``role`` holds ``doc`` exactly (the rollout rows: ``doc`` as
    their table, and the unmutated cut's arrays)."""
    blob, arrays, before = state["owners"][role], b"", b""
    if role == "rollouts":
        (length,) = struct.unpack_from("<Q", blob, 8)
        blob, arrays = blob[16 : 16 + length], blob[16 + length :]
        (length,) = struct.unpack_from("<Q", base.state["owners"][role], 8)
        before = base.state["owners"][role][16 + length :]
    return canonical(json.loads(blob)) == canonical(doc) and arrays == before


def outcome(base: Cut, role: str, place: Place, value: Any, work: Path) -> tuple[str, str | None]:
    """(how the mutation ended, why it is a failure or None)."""
    root = copy_of(base.root, work)
    noop = canonical(at(document(CutSurgery.only_cut(root), role)[0], place)) == canonical(value)
    doc = mutate(root, role, place, value)
    try:
        state = resumed(root, base.cut_id)
    except CutCheckError as err:
        if err.check not in CHECKS:
            return f"refused: {err.check}", f"refused by {err.check!r}, which is no check of the chain"
        if noop:
            return "no-op refused", f"a no-op was refused by {err.check}: {err}"
        return f"refused: {err.check}", None
    if state == base.state:
        return ("no-op" if noop else "accepted, nothing changed"), None
    changed = sorted(k for k in state if state[k] != base.state[k])
    if changed == ["owners"]:
        changed = sorted(f"owners.{r}" for r in state["owners"] if state["owners"][r] != base.state["owners"][r])
    types = payload_types(role, place)
    if types is not None and changed == [f"owners.{role}"] and as_written(base, state, role, doc):
        if json_type(value) in types:
            return "payload, carried as written", None
        return "payload of another type", f"accepted a {json_type(value)} where {sorted(types)} belong"
    return "silently accepted", f"accepted, and the resumed state differs in {', '.join(changed)}"


def describe(role: str, place: Place, value: Any) -> str:
    return f"{role}:{'.'.join(map(str, place)) or '<root>'} = {value!r}"


def test_a_mutated_cut_is_refused_by_a_named_check_or_resumes_to_the_same_state(base: Cut, tmp_path: Path) -> None:
    seed = int(os.environ.get("SPOTRL_FUZZ_SEED") or secrets.randbits(32))
    wanted = os.environ.get("SPOTRL_FUZZ_MUTATIONS") or str(MUTATIONS)
    print(f"\nfuzz seed {seed}: SPOTRL_FUZZ_SEED={seed} replays this run")
    chosen = mutations(base.root, random.Random(seed), None if wanted == "all" else int(wanted))
    tally: Counter[str] = Counter()
    failures: list[str] = []
    for n, (role, place, value) in enumerate(chosen):
        work = tmp_path / str(n)
        work.mkdir()
        how, failure = outcome(base, role, place, value, work)
        shutil.rmtree(work)
        tally[how] += 1
        if failure is not None:
            failures.append(f"{describe(role, place, value)}: {failure}")
    print(f"{len(chosen)} mutations: " + ", ".join(f"{how} {n}" for how, n in sorted(tally.items())))
    assert not failures, (
        f"{len(failures)} of {len(chosen)} mutations (SPOTRL_FUZZ_SEED={seed}) were not refused by a named check "
        "and did not resume to the cut's state:\n" + "\n".join(failures[:40])
    )
    assert sum(n for how, n in tally.items() if how.startswith("refused: ")) > len(chosen) // 2
    assert tally["no-op"] > 0
