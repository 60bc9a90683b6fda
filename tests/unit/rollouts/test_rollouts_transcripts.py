"""An episode as a person reads it: the policy's turns and the environment's between them."""

from __future__ import annotations

from spotrl_runtime.core.types import FinishedGroup, Prompt, Rollout
from spotrl_runtime.rollouts.transcripts import transcripts, turns


def _decode(ids: list[int]) -> str:
    return " ".join(str(i) for i in ids)


def test_turns_alternate_at_the_observation_spans() -> None:
    r = Rollout("g", 0, (1,), (5, 6, 7, 8, 9, 10), (0.0,) * 6, 1.0, 3, observed=((2, 4),))
    assert turns(r, _decode) == [
        {"role": "policy", "text": "5 6"},
        {"role": "environment", "text": "7 8"},
        {"role": "policy", "text": "9 10"},
    ]
    single = Rollout("g", 1, (1,), (5, 6), (0.0,) * 2, 0.0, 3)
    assert turns(single, _decode) == [{"role": "policy", "text": "5 6"}]


def test_a_step_keeps_its_first_episodes_with_their_prompts_and_rewards() -> None:
    def group(gid: str, idx: int) -> FinishedGroup:
        rollouts = tuple(Rollout(gid, i, (idx,), (5, 6), (0.0, 0.0), float(i), 2, "", "stop") for i in range(3))
        return FinishedGroup(gid, Prompt(idx, "t", "q"), 2, rollouts)

    kept = transcripts([group("a", 4), group("b", 9)], _decode, limit=4)
    assert [(e["group_id"], e["index"]) for e in kept] == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    assert kept[3] == {
        "group_id": "b",
        "index": 0,
        "prompt_idx": 9,
        "prompt": "9",
        "reward": 0.0,
        "finish_reason": "stop",
        "weight_version": 2,
        "turns": [{"role": "policy", "text": "5 6"}],
    }
