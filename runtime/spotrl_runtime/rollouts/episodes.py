"""The turn loop: a generation backend that runs each sample of a group as an episode.

:class:`EpisodeBackend` wraps an engine's backend (transformers or vLLM). A group's first turn
is the group's own request, unchanged (``n`` samples, the group's seed): a job without an
environment, or an episode that calls no tool, is exactly today's single-turn completion. A
sample whose turn calls a tool becomes an episode: its environment acts in a thread of its
own while the engine goes on with every other episode's turn (the engine never waits on one
tool call), then the observation is appended with the chat template and the episode's next
turn goes back to the engine as a one-sample request with its context as the prompt (token
in, token out) and the turn's own seed. The group comes back once every episode has ended,
each sample one sequence: the turns' tokens with their log-probs, the observations between
them as :attr:`~spotrl_runtime.generation.types.Sample.observed` spans (log-prob 0, never
trained).

Every turn of a group runs on the weights its first turn ran on: the worker loads a new version
only once no group is unfinished, and a turn that comes back on another version fails its group.

Each finished turn (its tokens, the observation after it, the action log so far) is reported as
:class:`~spotrl_runtime.generation.types.TurnsFinished`, for the ledger. A request that carries
such states (``resume``) continues those episodes from their last finished turn, with the seeds
they had, once their environment replayed the action log (:mod:`.action_log`); an environment that
does not replay restarts its episode from turn 0, counted in ``episodes_restarted``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from spotrl_runtime.core.types import EpisodeState, ToolTurn
from spotrl_runtime.failpoints import failpoint
from spotrl_runtime.generation.backend import GenerationBackend
from spotrl_runtime.generation.types import (
    FINISH_LENGTH,
    FINISH_STOP,
    EpisodeCounts,
    GenerationRequest,
    GroupFailed,
    GroupGenerated,
    Sample,
    TurnsFinished,
)
from spotrl_runtime.rollouts.action_log import act, replay, tool_turn
from spotrl_runtime.rollouts.chat import ObservationRenderer
from spotrl_runtime.rollouts.protocol import Environment, Observation
from spotrl_runtime.rollouts.tool_calls import ParsedTurn, ToolCallParser

if TYPE_CHECKING:
    from spotrl_runtime.generation.weights import ChannelAddress, SyncPlan

MAX_OBSERVATION_CHARS = 8192
"""A tool's answer longer than this is cut to it, saying how much was left out: a huge output is
an observation like any other, never tokenized whole."""
WAIT_FOR_TOOLS_SECONDS = 0.5
"""How long a step with nothing for the engine waits for a tool call to answer (then returns,
so that the worker's loop can take new groups, aborts and weight loads)."""


@dataclass(frozen=True)
class EpisodeLimits:
    """``spec.environment``'s bounds on one episode."""

    max_turns: int = 8
    max_episode_tokens: int = 2048
    """Its completion's tokens, observations included."""
    max_episode_seconds: float | None = None
    """Checked at each turn's end: an episode past it ends there (truncated)."""
    max_model_len: int | None = None
    """The engine's context: an episode whose next turn would not fit ends (truncated)."""
    tool_seconds: float = 60.0
    """A tool call that has not answered by then gets an error observation instead."""


class EnvironmentStartError(RuntimeError):
    """An episode's environment did not start (a server not there, at capacity, refusing the
    reset): its group fails, and is retried or dropped by the job's policy, never trained on
    episodes whose tools were never there."""


def turn_seed(group_seed: int, index: int, turn: int) -> int:
    """The sampling seed of the turn after ``turn`` finished turns of sample ``index`` (its
    environment's seed at 0): stable across restarts."""
    digest = hashlib.sha256(f"{group_seed}:{index}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class Episode:
    """One sample's episode so far."""

    group_id: str
    index: int
    prompt: tuple[int, ...]
    environment: Environment | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    observed: list[tuple[int, int]] = field(default_factory=list)
    actions: list[ToolTurn] = field(default_factory=list)
    """The action log: one entry a turn that called tools."""
    turns: int = 0
    finish: str = ""
    """Empty while it runs; then the last turn's finish, or ``length`` if a limit ended it."""
    started: float = field(default_factory=time.monotonic)

    first: Sample | None = None
    """The first turn as the engine returned it: a one-turn episode is that sample."""

    def add_turn(self, sample: Sample) -> None:
        self.first = self.first or sample
        self.tokens.extend(sample.completion_token_ids)
        self.logprobs.extend(sample.logprobs)
        self.turns += 1

    def add_observation(self, tokens: Sequence[int], action: ToolTurn) -> None:
        self.actions.append(action)
        self.observed.append((len(self.tokens), len(self.tokens) + len(tokens)))
        self.tokens.extend(tokens)
        self.logprobs.extend([0.0] * len(tokens))

    @classmethod
    def resumed(cls, state: EpisodeState, prompt: tuple[int, ...]) -> Episode:
        """The episode a ledger's state describes, at its last finished turn."""
        return cls(
            state.group_id,
            state.index,
            prompt,
            tokens=list(state.completion_token_ids),
            logprobs=list(state.logprobs),
            observed=list(state.observed),
            actions=list(state.actions),
            turns=state.turns,
        )

    def state(self, weight_version: int, environment: str) -> EpisodeState:
        return EpisodeState(
            group_id=self.group_id,
            index=self.index,
            completion_token_ids=tuple(self.tokens),
            logprobs=tuple(self.logprobs),
            observed=tuple(self.observed),
            actions=tuple(self.actions),
            weight_version=weight_version,
            environment=environment,
        )

    def sample(self, decode: Callable[[list[int]], str]) -> Sample:
        if self.first is not None and self.turns == 1:
            return replace(self.first, finish_reason=self.finish)
        return Sample(
            completion_token_ids=tuple(self.tokens),
            logprobs=tuple(self.logprobs),
            finish_reason=self.finish,
            text=decode(self.tokens),
            observed=tuple(self.observed),
        )


@dataclass
class _Group:
    request: GenerationRequest
    episodes: dict[int, Episode] = field(default_factory=dict)
    """By rollout index."""
    fresh: tuple[int, ...] = ()
    """The rollout indexes its first turn generates (every one but the episodes resumed)."""
    version: int | None = None
    counts: EpisodeCounts = field(default_factory=EpisodeCounts)

    @property
    def done(self) -> bool:
        indexes = self.request.sample_indexes()
        return all(i in self.episodes and self.episodes[i].finish for i in indexes)


@dataclass(frozen=True)
class _Pending:
    """Work at the tool threads: ``then`` gets its result, or None once ``deadline`` passed; an
    environment that did not start fails ``group``."""

    group: _Group
    then: Callable[[Any], None]
    deadline: float
    since: float = field(default_factory=time.monotonic)


class EpisodeBackend(GenerationBackend):
    """Runs each group's samples as episodes against ``environment`` (a factory: one
    environment an episode), on ``inner``'s engine."""

    def __init__(
        self,
        inner: GenerationBackend,
        tokenizer: Any,
        environment: Callable[[], Environment],
        limits: EpisodeLimits,
        *,
        tool_parser: str = "hermes",
        tool_threads: int = 8,
        name: str = "",
    ) -> None:
        self.inner = inner
        self.name = name
        """The environment's name, kept with each episode's state: another one never resumes it."""
        self.tokenizer = tokenizer
        self.limits = limits
        self._environment = environment
        self._parser = ToolCallParser(tokenizer, tool_parser)
        self._renderer = ObservationRenderer(tokenizer)
        self._tools = concurrent.futures.ThreadPoolExecutor(tool_threads, thread_name_prefix="tool")
        self._groups: dict[str, _Group] = {}
        self._turns: dict[str, Episode] = {}
        """A later turn's request id -> its episode."""
        self._pending: dict[concurrent.futures.Future[Any], _Pending] = {}
        self._done: list[GroupGenerated | GroupFailed | TurnsFinished] = []
        self.turns_reported = 0
        """Finished turns of groups that train (not a validation pass's) reported so far: the
        step of failpoint ``worker.turns_reported``."""

    @classmethod
    def from_spec(cls, engine: GenerationBackend, environment: Any, *, max_model_len: int | None) -> EpisodeBackend:
        """The turn loop ``spec.environment`` asks for, around ``engine`` (its tokenizer's template)."""
        from spotrl_runtime.rollouts.environments import make_environment

        limits = EpisodeLimits(
            max_turns=environment.max_turns,
            max_episode_tokens=environment.max_episode_tokens,
            max_episode_seconds=environment.max_episode_seconds,
            max_model_len=max_model_len or engine.context_tokens(),
            tool_seconds=environment.tool_seconds,
        )
        tokenizer = getattr(engine, "tokenizer")  # noqa: B009 - every engine has one; the base class does not say
        return cls(
            engine,
            tokenizer,
            lambda: make_environment(environment.name, environment.url, environment.tool_seconds),
            limits,
            tool_parser=environment.tool_parser,
            name=environment.name,
        )

    # ------------------------------------------------------------------ the engine's, passed on

    @property
    def weight_version(self) -> int:  # type: ignore[override]  # the engine's, never set here
        return self.inner.weight_version

    def join_channel(self, address: ChannelAddress) -> None:
        self.inner.join_channel(address)

    def receive_weights(self, plan: SyncPlan, version: int) -> int:
        return self.inner.receive_weights(plan, version)

    def close(self) -> None:
        self.abort()
        self._tools.shutdown(wait=False, cancel_futures=True)
        self.inner.close()

    def context_tokens(self) -> int | None:
        return self.inner.context_tokens()

    def kv_cache_tokens(self) -> int | None:
        tokens = getattr(self.inner, "kv_cache_tokens", None)
        return tokens() if callable(tokens) else None

    # ------------------------------------------------------------------ streaming

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GroupGenerated]:
        """Runs ``requests`` to the end, in order; raises if a group failed."""
        self.start(requests)
        done: dict[str, GroupGenerated | GroupFailed] = {}
        while len(done) < len(requests):
            done.update((o.group_id, o) for o in self.step() if not isinstance(o, TurnsFinished))
        failed = [o for o in done.values() if isinstance(o, GroupFailed)]
        if failed:
            raise RuntimeError(f"group {failed[0].group_id} failed: {failed[0].error}")
        return [done[r.group_id] for r in requests]  # type: ignore[misc]

    def start(self, requests: Iterable[GenerationRequest]) -> None:
        first = []
        for request in requests:
            resume = {e.index: e for e in request.resume if e.environment == self.name}
            group = _Group(request, counts=EpisodeCounts(episodes_restarted=len(request.resume) - len(resume)))
            group.fresh = tuple(i for i in request.sample_indexes() if i not in resume)
            self._groups[request.group_id] = group
            if group.fresh:
                first.append(replace(request, n=len(group.fresh), indexes=group.fresh, resume=()))
            for state in resume.values():
                self._replay(group, state)
        self.inner.start(first)

    def unfinished(self) -> int:
        return len(self._groups)

    def step(self) -> list[GroupGenerated | GroupFailed | TurnsFinished]:  # type: ignore[override]
        """The groups that ended, and the turns that finished, since the last step."""
        failpoint("worker.turns_reported", self.turns_reported)
        self._take_tool_results()
        if self.inner.unfinished():
            for outcome in self.inner.step():
                self._take_turn(outcome)
        elif self._pending:
            concurrent.futures.wait(
                list(self._pending), timeout=WAIT_FOR_TOOLS_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED
            )
            self._take_tool_results()
        done, self._done = self._done, []
        return done

    def abort(self) -> list[str]:
        self.inner.abort()
        for future in self._pending:
            future.cancel()
        for group in self._groups.values():
            self._close(group)
        ids = list(self._groups)
        self._groups.clear()
        self._turns.clear()
        self._pending.clear()
        self._done.clear()
        return ids

    # ------------------------------------------------------------------ turns

    def _take_turn(self, outcome: GroupGenerated | GroupFailed) -> None:
        episode = self._turns.pop(outcome.group_id, None)
        group = self._groups.get(episode.group_id if episode else outcome.group_id)
        if group is None:
            return  # a turn of a group that already failed or was aborted
        if isinstance(outcome, GroupFailed):
            return self._fail(group, outcome.error)
        if group.version is None:
            group.version = outcome.weight_version
        elif outcome.weight_version != group.version:
            return self._fail(group, f"a turn ran on version {outcome.weight_version}, its group on {group.version}")
        try:
            if episode is None:  # the group's first turn: one sample an episode
                prompt = group.request.prompt_token_ids
                for index, sample in zip(group.fresh, outcome.samples, strict=True):
                    group.episodes[index] = Episode(group.request.group_id, index, prompt)
                    group.episodes[index].add_turn(sample)
                    self._after_turn(group, group.episodes[index], sample.finish_reason)
            else:
                episode.add_turn(outcome.samples[0])
                self._after_turn(group, episode, outcome.samples[0].finish_reason)
        except Exception:
            self._fail(group, traceback.format_exc(limit=8))

    def _after_turn(self, group: _Group, episode: Episode, finish: str) -> None:
        """Ends ``episode`` or sends its calls to its environment."""
        parsed = self._parser.parse(self._turn_text(episode, finish)) if finish == FINISH_STOP else ParsedTurn()
        if not parsed.wants_tools:
            return self._end(group, episode, finish)
        if episode.turns >= self.limits.max_turns or self._out_of_time(episode):
            return self._end(group, episode, FINISH_LENGTH)
        future = self._tools.submit(self._act, group, episode, parsed)
        self._pending[future] = _Pending(
            group,
            lambda observations: self._observe(group, episode, parsed, observations),
            time.monotonic() + self.limits.tool_seconds,
        )

    def _act(self, group: _Group, episode: Episode, parsed: ParsedTurn) -> list[Observation]:
        """At a tool thread: the episode's environment, started and reset at its first call (a
        server's session may take a while to open), answers the turn's calls. One that does not
        start raises :class:`EnvironmentStartError`: not the policy's doing, so no observation."""
        if episode.environment is None:
            episode.environment = self._start(self._environment(), group, episode)
        return act(episode.environment, parsed)

    def _start(self, environment: Environment, group: _Group, episode: Episode) -> Environment:
        """``environment`` reset with the episode's seed, or :class:`EnvironmentStartError`."""
        try:
            environment.reset(seed=self._env_seed(group, episode), episode_id=self._id(episode))
        except Exception as err:
            with contextlib.suppress(Exception):
                environment.close()
            raise EnvironmentStartError(f"episode {self._id(episode)}: {str(err)[:300]}") from None
        return environment

    def _take_tool_results(self) -> None:
        now = time.monotonic()
        for future, pending in list(self._pending.items()):
            if not (future.done() or now > pending.deadline):
                continue
            del self._pending[future]
            self._tally(pending.group, environment_seconds=now - pending.since)
            if future.done() and isinstance(future.exception(), EnvironmentStartError):
                self._fail(pending.group, f"the environment did not start: {future.exception()}")
            else:
                pending.then(future.result() if future.done() else None)

    def _observe(
        self, group: _Group, episode: Episode, parsed: ParsedTurn, observations: list[Observation] | None
    ) -> None:
        if self._groups.get(group.request.group_id) is not group:
            return  # the group failed or was aborted meanwhile
        if observations is None:
            observations = [
                Observation(f"error: the tool did not answer within {self.limits.tool_seconds:g} s", error=True)
            ]
        self._tally(group, tool_calls=len(observations), tool_errors=sum(o.error for o in observations))
        if any(o.done for o in observations):
            return self._end(group, episode, FINISH_STOP)
        observation = self._renderer.render([{"role": "tool", "content": _bounded(o.text)} for o in observations])
        if self._budget(group, episode, len(observation)) < 1:
            return self._end(group, episode, FINISH_LENGTH)  # no room for a token after the observation
        episode.add_observation(observation, tool_turn(parsed, observations))
        version = group.version if group.version is not None else self.weight_version
        self._done.append(TurnsFinished(group.request.group_id, episode.state(version, self.name)))
        self.turns_reported += 0 if group.request.yields else 1
        self._next_turn(group, episode)

    def _budget(self, group: _Group, episode: Episode, extra: int = 0) -> int:
        """How many tokens the episode's next turn may generate, ``extra`` more in its context."""
        used = len(episode.tokens) + extra
        budget = min(group.request.max_new_tokens, self.limits.max_episode_tokens - used)
        if self.limits.max_model_len is not None:
            budget = min(budget, self.limits.max_model_len - len(episode.prompt) - used)
        return budget

    def _next_turn(self, group: _Group, episode: Episode) -> None:
        """Sends the episode's next turn to the engine: one sample, its context as the prompt,
        the turn's own seed (turn 0: a restarted episode's first turn, alone)."""
        request = replace(
            group.request,
            group_id=f"{group.request.group_id}#s{episode.index}t{episode.turns}",
            prompt_token_ids=episode.prompt + tuple(episode.tokens),
            n=1,
            max_new_tokens=self._budget(group, episode),
            seed=turn_seed(group.request.seed, episode.index, episode.turns),
            indexes=(),
            resume=(),
        )
        self._turns[request.group_id] = episode
        self.inner.start([request])

    # ------------------------------------------------------------------ resume

    def _replay(self, group: _Group, state: EpisodeState) -> None:
        """Restores a resumed episode's environment at the tool threads (a replay is tool calls)."""
        episode = Episode.resumed(state, group.request.prompt_token_ids)
        environment = self._environment()
        future = self._tools.submit(lambda: replay(self._start(environment, group, episode), state.actions))
        self._pending[future] = _Pending(
            group,
            lambda replayed: self._resumed(group, episode, environment, replayed is True),
            time.monotonic() + self.limits.tool_seconds * (state.turns + 1),
        )

    def _resumed(self, group: _Group, episode: Episode, environment: Environment, replayed: bool) -> None:
        """Continues a resumed episode from its last finished turn, or (its environment did not
        replay) from turn 0 with a fresh environment."""
        if not replayed or self._groups.get(group.request.group_id) is not group:
            with contextlib.suppress(Exception):
                environment.close()
        if self._groups.get(group.request.group_id) is not group:
            return
        if replayed:
            episode.environment = environment
            self._tally(group, turns_resumed=episode.turns)
        else:
            self._tally(group, episodes_restarted=1)
            episode = Episode(episode.group_id, episode.index, episode.prompt)
        group.episodes[episode.index] = episode
        self._next_turn(group, episode)

    # ------------------------------------------------------------------ ends

    def _end(self, group: _Group, episode: Episode, finish: str) -> None:
        episode.finish = finish
        if not group.done:
            return
        self._close(group)
        del self._groups[group.request.group_id]
        episodes = [group.episodes[i] for i in group.request.sample_indexes()]
        self._done.append(
            GroupGenerated(
                group_id=group.request.group_id,
                prompt_token_ids=group.request.prompt_token_ids,
                samples=tuple(ep.sample(self._decode) for ep in episodes),
                weight_version=group.version if group.version is not None else self.weight_version,
                seconds=time.monotonic() - min(ep.started for ep in episodes),
                episodes=group.counts,
            )
        )

    @staticmethod
    def _tally(group: _Group, **more: float) -> None:
        group.counts = replace(group.counts, **{k: getattr(group.counts, k) + v for k, v in more.items()})

    def _fail(self, group: _Group, error: str) -> None:
        self._close(group)
        # Its turns still in the engine or at a tool find no group when they come back.
        if self._groups.pop(group.request.group_id, None) is not None:
            self._done.append(GroupFailed(group.request.group_id, error))

    def _close(self, group: _Group) -> None:
        for episode in group.episodes.values():
            if episode.environment is not None:
                # An environment that fails to close changes nothing in the episode.
                with contextlib.suppress(Exception):
                    episode.environment.close()
                episode.environment = None

    def _out_of_time(self, episode: Episode) -> bool:
        limit = self.limits.max_episode_seconds
        return limit is not None and time.monotonic() - episode.started > limit

    def _turn_text(self, episode: Episode, finish: str) -> str:
        """The last turn's text with its special tokens (call markers may be), less its end token."""
        start = episode.observed[-1][1] if episode.observed else 0
        ids = episode.tokens[start:]
        if finish == FINISH_STOP:
            ids = ids[:-1]
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    @staticmethod
    def _env_seed(group: _Group, episode: Episode) -> int:
        """What the episode's environment is reset with: the same on every resume."""
        return turn_seed(group.request.seed, episode.index, 0)

    @staticmethod
    def _id(episode: Episode) -> str:
        return f"{episode.group_id}/{episode.index}"


def _bounded(text: str) -> str:
    if len(text) <= MAX_OBSERVATION_CHARS:
        return text
    return f"{text[:MAX_OBSERVATION_CHARS]}\n[{len(text) - MAX_OBSERVATION_CHARS} more characters left out]"
