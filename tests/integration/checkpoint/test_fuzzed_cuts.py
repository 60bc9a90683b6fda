"""Fuzz: any value anywhere in a cut's JSON files replaced by one of another type or range,
with the file's size and digest recomputed. Restore either accepts the cut or refuses it
with a named check; it never fails with an exception that names no check (a TypeError
from deep inside, a KeyError, a torch error)."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
from cut_scenarios import DATASET, EXAMPLE_B, example_b_before_cut, loader_for
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note
from hypothesis import strategies as st

from spotrl_e2e.forgery import CutSurgery
from spotrl_runtime.checkpoint import restore_cut
from spotrl_runtime.core.validation import CutCheckError
from spotrl_runtime.data import PromptCollate
from spotrl_runtime.storage import LocalStorage

ROLES = ["manifest", "sampler", "loader", "ledger", "spare_pool", "replay_index", "audit", "trainer_meta", "rollouts"]
VALUES = [None, "", "x", "a1", "g1", -1, 0, 1, 7, 10**12, 1.5, True, [], {}, ["a"], {"k": 1}, [[0, 1]], [[5, 3]]]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed cut of worked example B after one trained step (finished, in-flight,
    reserved and spare groups, an audit record, a shortfall-free borrow)."""
    root = tmp_path_factory.mktemp("fuzz") / "job"
    run = example_b_before_cut(LocalStorage(root))
    run.finish("g3", (0,))
    run.train()
    run.pump()
    run.cut()
    return root


def leaves(doc: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document (containers and scalars), as key paths."""
    out = [at]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += leaves(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += leaves(v, (*at, i))
    return out


def put(doc: Any, at: tuple[Any, ...], value: Any) -> Any:
    if not at:
        return value
    parent = doc
    for k in at[:-1]:
        parent = parent[k]
    parent[at[-1]] = value
    return doc


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(role=st.sampled_from(ROLES), pick=st.integers(0, 10**6), value=st.sampled_from(VALUES))
def test_a_mutated_cut_is_accepted_or_refused_by_a_named_check(base: Path, role: str, pick: int, value: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "job"
        shutil.copytree(base, root)
        cut = CutSurgery.only_cut(root)
        if role == "manifest":  # the manifest has no digest: any edit is possible
            places = leaves(cut.m)
            cut.m = put(cut.m, places[pick % len(places)], value)
            cut.save_manifest()
        else:
            blob = cut.path(role).read_bytes()
            if role == "rollouts":  # SPOTRLR1 + u64 length + the JSON row table, then the arrays
                (length,) = struct.unpack_from("<Q", blob, 8)
                doc, arrays = json.loads(blob[16 : 16 + length]), blob[16 + length :]
            else:
                doc, arrays = json.loads(blob), b""
            places = leaves(doc)
            data = json.dumps(put(doc, places[pick % len(places)], value)).encode()
            if role == "rollouts":
                data = b"SPOTRLR1" + struct.pack("<Q", len(data)) + data + arrays
            cut.replace(role, data)
        try:
            restore_cut(
                LocalStorage(root), dataset=DATASET, collate=PromptCollate(), source=loader_for(EXAMPLE_B, DATASET)
            )
            note("accepted")
        except CutCheckError as err:
            note(f"refused: {err.check}")
