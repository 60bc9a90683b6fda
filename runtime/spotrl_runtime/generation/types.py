"""What crosses the generation boundary: one request per group, one outcome per group."""

from __future__ import annotations

from dataclasses import dataclass, field

from spotrl_runtime.core.types import EpisodeState

FINISH_STOP = "stop"
"""The sample ended with the end-of-sequence token (which is part of its completion ids)."""
FINISH_LENGTH = "length"
"""The sample reached ``max_new_tokens``."""


@dataclass(frozen=True)
class GenerationRequest:
    """Generate ``n`` samples (one group) for one prompt.

    ``seed`` fixes the sampling of this group: the same weights, request and seed give the
    same samples on the transformers backend (vLLM: the same up to kernel non-determinism).
    """

    group_id: str
    prompt_token_ids: tuple[int, ...]
    n: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    weight_version: int | None = None
    """The weights to generate it with: the version the group was admitted with. The pool sends
    it to a worker before that version's successor and holds it until that version is given to
    the pool. None: whatever weights the pool holds when it reaches a worker."""
    yields: bool = False
    """Work no weight load waits for (a validation pass): a worker holding such a group when
    the next version is sent is left out of that sync, finishes its groups on the weights they
    ask for, then gets the newest version as a joiner."""

    indexes: tuple[int, ...] = ()
    """The rollout indexes of the ``n`` samples, in order (empty: 0 .. n-1). A multi-turn
    episode's seeds follow its rollout index, so that a group sent again for some of its
    samples gives each the seeds it had."""
    resume: tuple[EpisodeState, ...] = ()
    """Episodes of this group with finished turns (a restored ledger's): each continues from its
    last finished turn instead of starting again (:mod:`spotrl_runtime.rollouts.episodes`)."""

    def sample_indexes(self) -> tuple[int, ...]:
        return self.indexes or tuple(range(self.n))

    def __post_init__(self) -> None:
        if self.indexes and len(self.indexes) != self.n:
            raise ValueError(f"group {self.group_id}: {len(self.indexes)} indexes for {self.n} samples")
        if any(e.group_id != self.group_id or e.index not in self.sample_indexes() for e in self.resume):
            raise ValueError(f"group {self.group_id}: an episode to resume is not one of its samples")
        if not self.prompt_token_ids:
            raise ValueError(f"group {self.group_id}: prompt_token_ids is empty")
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"group {self.group_id}: n and max_new_tokens must be >= 1")
        if not self.temperature > 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"group {self.group_id}: temperature must be > 0 and top_p in (0, 1]")


@dataclass(frozen=True)
class Sample:
    """One generated completion with the log-probability of each of its tokens.

    ``logprobs[i]`` is the log-probability of ``completion_token_ids[i]`` under the
    distribution it was sampled from: the policy's logits divided by the temperature, restricted
    to the top-p nucleus and renormalised. The trainer's importance ratio is taken against these.
    """

    completion_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    text: str
    observed: tuple[tuple[int, int], ...] = ()
    """A multi-turn episode's observations: spans ``[start, end)`` of the completion that the
    environment wrote (log-prob 0 each), between the turns the policy generated."""


@dataclass(frozen=True)
class GroupGenerated:
    """All ``n`` samples of a group, and the weight version that generated every one of them."""

    group_id: str
    prompt_token_ids: tuple[int, ...]
    samples: tuple[Sample, ...]
    weight_version: int
    worker: str = ""
    seconds: float = 0.0
    episodes: EpisodeCounts = field(default_factory=lambda: EpisodeCounts())
    """What its episodes did (multi-turn jobs; zeros otherwise)."""


@dataclass(frozen=True)
class EpisodeCounts:
    """A multi-turn group's tallies, for the job's metrics."""

    tool_calls: int = 0
    """Calls its episodes' environments answered (a call that could not be parsed counts)."""
    tool_errors: int = 0
    """Of those, the answers that were errors (a tool missing, raising, timing out, bad arguments)."""
    environment_seconds: float = 0.0
    """Wall-clock seconds its episodes waited on their environments (they overlap generation)."""
    turns_resumed: int = 0
    """Finished turns of its episodes that a resume kept (not generated again)."""
    episodes_restarted: int = 0
    """Episodes with finished turns that started again from turn 0: their environment did not
    replay its action log to the same observations, or is another one."""


@dataclass(frozen=True)
class TurnsFinished:
    """An episode of an unfinished group finished a turn: its state for the ledger (not an
    outcome: its group is still generating)."""

    group_id: str
    episode: EpisodeState
    worker: str = ""


@dataclass(frozen=True)
class GroupFailed:
    """Generation of the group raised; the controller may retry it (up to ``maxRetries``) or drop it."""

    group_id: str
    error: str
    worker: str = ""


@dataclass(frozen=True)
class GroupLost:
    """The worker holding the group died before answering; redispatch it, nothing else is needed."""

    group_id: str
    worker: str
    reason: str


GroupOutcome = GroupGenerated | GroupFailed | GroupLost
WorkerReport = GroupOutcome | TurnsFinished
"""What a worker's ``collect`` returns."""
