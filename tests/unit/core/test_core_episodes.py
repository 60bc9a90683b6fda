"""Unfinished episodes' finished turns in the recovery core: the ledger keeps the newest state of
each episode of an ADMITTED group until its rollout finishes; a cut holds them (an owner file of
its own, only when there are any); a restore sends them back with the group's dispatch; a cut
whose episodes are forged or belong to no missing rollout is refused."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from scripted_generation import new_owners, rollout

from spotrl_runtime.core.cut_format import (
    CutDocuments,
    OwnerFileError,
    decode_owner_files,
    encode_owner_files,
    to_snapshot,
)
from spotrl_runtime.core.owners import Owners, OwnersSnapshot, RecoveryConfig
from spotrl_runtime.core.types import EpisodeState, ToolTurn
from spotrl_runtime.core.validation import RolloutRowsError, check_episodes
from spotrl_runtime.data import ArithmeticDataset, PromptCollate
from spotrl_runtime.data.loader import PromptLoader

CONFIG = RecoveryConfig(group_size=4, prompts_per_step=1, lookahead=0)


def episode(group_id: str, index: int, turns: int) -> EpisodeState:
    """An episode after ``turns`` turns of 3 generated tokens and a 2-token observation each."""
    ids: list[int] = []
    observed = []
    for t in range(turns):
        ids += [10 + t, 11, 12]
        observed.append((len(ids), len(ids) + 2))
        ids += [90, 91]
    logprobs = [0.0 if any(a <= k < b for a, b in observed) else -0.25 for k in range(len(ids))]
    actions = tuple(ToolTurn((("calculator", f'{{"expression": "{t}+1"}}'),), f"{t:064x}") for t in range(turns))
    return EpisodeState(group_id, index, tuple(ids), tuple(logprobs), tuple(observed), actions, 0, "builtin:calculator")


def _with_turns() -> tuple[Owners, OwnersSnapshot]:
    owners = new_owners(CONFIG)
    (d,) = owners.pump()
    owners.add_rollout(d.group_id, rollout(d, 0))
    assert owners.keep_turns(episode("g0", 2, 1))
    assert owners.keep_turns(episode("g0", 2, 2))
    assert owners.keep_turns(episode("g0", 3, 1))
    return owners, owners.capture()


def test_the_ledger_keeps_the_newest_turns_of_each_unfinished_episode() -> None:
    owners, snap = _with_turns()
    assert {gid: [(e.index, e.turns) for e in es] for gid, es in snap.episodes.items()} == {"g0": [(2, 2), (3, 1)]}
    assert not owners.keep_turns(episode("g0", 2, 1)), "an older report changes nothing"
    assert not owners.keep_turns(episode("g0", 0, 3)), "rollout 0 finished"
    assert not owners.keep_turns(episode("g0", 4, 1)), "outside the group"
    assert not owners.keep_turns(episode("g9", 1, 1)), "no such group"
    (d,) = [x for x in owners.in_flight() if x.group_id == "g0"]
    assert [(e.index, e.turns) for e in d.resume] == [(2, 2), (3, 1)]
    owners.add_rollout("g0", rollout(d, 2))
    assert [e.index for e in owners.capture().episodes["g0"]] == [3], "a finished rollout's turns go"
    for i in (1, 3):
        owners.add_rollout("g0", rollout(d, i))
    assert owners.capture().episodes == {}, "a finished group leaves none behind"


def test_a_restore_sends_the_finished_turns_with_the_groups_dispatch() -> None:
    _, snap = _with_turns()
    loader = PromptLoader(ArithmeticDataset(size=1000), PromptCollate(), batch_size=1, shuffle=False)
    restored = Owners.restore(snap, loader, attempt=1)
    (d,) = [x for x in restored.pump() if x.group_id == "g0"]
    assert d.rollout_indexes == (1, 2, 3)
    assert d.resume == snap.episodes["g0"]
    assert restored.counters.turns_found == 3
    again = restored.dispatch_again("g0")
    assert again is not None
    assert again.resume == d.resume


def test_a_cut_holds_the_episodes_in_a_file_of_their_own() -> None:
    _owners, snap = _with_turns()
    blobs = encode_owner_files(snap)
    assert "episodes" in blobs
    docs = decode_owner_files(blobs)
    assert docs.episodes == snap.episodes["g0"]
    docs = replace(docs, ledger=snap.ledger)
    assert to_snapshot(docs, snap.prompts).episodes == snap.episodes
    assert "episodes" not in encode_owner_files(replace(snap, episodes={})), "a single-turn cut is unchanged"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("logprobs", [-0.25], "logprobs must be a list of"),
        ("observed", [[3, 5], [4, 6]], "observation spans"),
        ("observed", [[3, 5]], "as many as the observation spans"),
        (
            "actions",
            [{"calls": [["calculator", "{}"]], "digest": "0" * 64}, {"calls": [], "digest": "short"}],
            "digest",
        ),
        ("index", -1, "index must be an integer"),
        ("completion_token_ids", [10, 11, 12, 90, 91, 7], "logprobs must be a list of"),
    ],
)
def test_a_forged_episode_is_refused_naming_the_file(field: str, value: object, message: str) -> None:
    _, snap = _with_turns()
    blobs = encode_owner_files(snap)
    doc = json.loads(blobs["episodes"])
    doc["episodes"][0][field] = value
    blobs["episodes"] = json.dumps(doc).encode()
    with pytest.raises(OwnerFileError, match=message) as err:
        decode_owner_files(blobs)
    assert err.value.role == "episodes"


def test_an_episode_ending_before_its_last_observation_is_refused() -> None:
    state = episode("g0", 1, 2).to_json()
    state["completion_token_ids"] += [7]
    state["logprobs"] += [-0.5]
    with pytest.raises(ValueError, match="end with its last observation"):
        EpisodeState.from_json(state)


def _docs(snap: OwnersSnapshot, *episodes: EpisodeState) -> CutDocuments:
    docs = replace(decode_owner_files(encode_owner_files(snap)), ledger=snap.ledger)
    return replace(docs, episodes=episodes)


def test_episodes_of_no_missing_rollout_are_refused() -> None:
    from spotrl_runtime.core.cut_format import Manifest

    _, snap = _with_turns()
    manifest = Manifest.__new__(Manifest)
    object.__setattr__(manifest, "files", ())
    check_episodes("s3://b/cut", manifest, _docs(snap, episode("g0", 2, 2)))
    for bad in (
        (episode("g9", 1, 1),),  # no such group
        (episode("g0", 0, 1),),  # rollout 0 finished
        (episode("g0", 4, 1),),  # outside the group
        (episode("g0", 2, 1), episode("g0", 2, 2)),  # twice
    ):
        with pytest.raises(RolloutRowsError, match="episode"):
            check_episodes("s3://b/cut", manifest, _docs(snap, *bad))


def test_a_retried_group_lets_go_of_its_kept_turns() -> None:
    """A group whose generation failed is retried from its first turn with other seeds: the turns
    kept from the failed try must not resume the retry's episodes."""
    owners, _ = _with_turns()
    owners.forget_turns("g0")
    assert owners.capture().episodes == {}
    assert owners.keep_turns(episode("g0", 2, 1)), "the retry's first turn is kept afresh"
