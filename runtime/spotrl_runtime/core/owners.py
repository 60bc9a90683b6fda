"""The owners of every prompt, and the only code that moves a prompt between them.

Every prompt the run has touched has exactly one owner at every instant: the loader (not
yet yielded), the spare pool, the ledger (RESERVED or ADMITTED), the replay buffer
(finished, waiting for its step), or the trained steps (the audit). :class:`Owners` holds
them all behind one lock. Each method below is one ownership move and runs entirely
inside the lock, so a cut (:meth:`Owners.capture`) sees every prompt exactly once.
Generation never takes the lock: only handing its results over does.

How a controller drives it. Every method is thread-safe and holds the lock for
microseconds; the exceptions are ``capture`` (the in-memory copy, which a cut makes) and
the waiting calls. From an asyncio loop, call the short methods directly and run
``wait_step_ready``, the optimizer step and ``CutWriter.write`` with ``asyncio.to_thread``::

    # start (spotrl_runtime.checkpoint): restore the newest committed cut, or begin
    loader = PromptLoader(dataset, collate, batch_size=B, shuffle=..., seed=...)
    run = start_or_restore(storage, config=config, dataset=dataset, collate=collate,
                           source=loader, expect_job=job)
    owners = run if isinstance(run, Owners) else run.owners   # run.trainer: weights,
                                                              #   optimizer, RNG to load
    limit = owners.config.prompt_limit                        # the cut's after a restore
    if limit is not None:                                     # prompts too long for it are
        owners.set_admission_filter(limit.filter(tokens_of))  #   filtered when admitted
    writer = CutWriter(storage, job=job, dataset=describe_dataset(spec.dataset, dataset),
                       keep=spec.checkpoint.keep)

    # generation side (any thread; many completions at once)
    for d in owners.pump():                          # after a restore: the ADMITTED groups
        send_to_generation(d)                        #   first (relaunch=True), then batches
                                                     #   admitted through the gate
    owners.add_rollout(group_id, rollout)            # one finished rollout; returns the
                                                     #   FinishedGroup when it was the last
    owners.finish_group(group_id, rollouts)          # or the group's missing rollouts at once
    for d in owners.drop_group(group_id, reason):    # given up on after retries; 'replace'
        send_to_generation(d)                        #   dispatches a spare
    owners.in_flight()                               # resend a lost worker's groups

    # trainer side (one thread)
    owners.wait_step_ready(timeout)                  # every group of the next step finished
    groups = owners.begin_step()                     # its FinishedGroups, in loader order
    ...optimizer step...
    record = owners.commit_step(weight_version)      # groups -> trained; an AuditRecord
    audit_store.write(record)                        # (owners.abort_step() if it failed)
    for d in owners.pump(): send_to_generation(d)    # the gate may have opened

    # cut side (any thread; periodic every N steps / T seconds, or a barrier)
    writer.write(owners, CutRequest.barrier(Deadline.after(seconds)), state_fn)
        # -> owners.capture(state_fn): waits for a running optimizer step to commit, copies
        #    every owner and calls state_fn() (snapshot_trainer(model.state_dict(),
        #    optimizer.state_dict())) under the lock; the files, the manifest (the commit)
        #    and the pointer are written after the lock is released.

Errors never half-apply: each method checks everything before it changes anything.
Nothing here discards a prompt; every path that would raises instead.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from spotrl_runtime.core.admission import MAX_MODEL_LEN, PROMPT_TOO_LONG, AdmissionFilter, PromptLimit, prompt_limit
from spotrl_runtime.core.audit import DROPPED, FILTERED, AuditLog, AuditRecord, DroppedPrompt
from spotrl_runtime.core.dynamic_sampling import without_signal
from spotrl_runtime.core.ledger import Ledger, LedgerRecord, Phase
from spotrl_runtime.core.orders import OrderSet
from spotrl_runtime.core.redo import RedoLog, RedoStep, StepFingerprint
from spotrl_runtime.core.replay_buffer import ReplayBuffer, ReplayEntry
from spotrl_runtime.core.sampler import LookaheadSampler
from spotrl_runtime.core.spare_pool import Spare, SparePool
from spotrl_runtime.core.types import EpisodeState, FinishedGroup, Prompt, Rollout

if TYPE_CHECKING:
    from spotrl_runtime.api.rljob import RLJobSpec

DropPolicy = Literal["shrink", "replace"]


# ---------------------------------------------------------------------------- errors


class OwnershipError(RuntimeError):
    """An ownership move that cannot happen; nothing was changed."""


class UnknownGroupError(OwnershipError):
    """A result for a group the ledger does not own (finished, dropped, or never dispatched)."""


class RolloutMismatchError(OwnershipError):
    """Rollouts that do not fit their group (wrong group, index out of range, duplicate)."""


class AdmissionIntoFinishedStepError(OwnershipError):
    """Admitting a batch into a step that already holds finished groups: a bug, never a drop."""


class StepTooSmallError(OwnershipError):
    """Dropping the prompt would leave its step below ``minStepFraction``: the run must stop."""


class StepNotReadyError(OwnershipError):
    """The trainer asked for a step whose groups are not all finished."""


class CutTimeoutError(OwnershipError):
    """A cut could not capture the owners before its deadline."""


# ---------------------------------------------------------------------------- values


@dataclass(frozen=True)
class RecoveryConfig:
    """The knobs of the recovery core, from ``spec.generation`` and ``spec.preemption``."""

    group_size: int
    prompts_per_step: int
    lookahead: int
    on_dropped_prompt: DropPolicy = "shrink"
    min_step_fraction: float = 0.5
    spare_pool_batches: int = 0
    audit_tail: int = 1024
    """Audit records kept in memory and written into each cut."""
    max_model_len: int | None = None
    """The context a prompt and ``max_new_tokens`` must fit (:class:`PromptLimit`); None: no
    prompt is filtered for its length. Kept in the cut, so a resume filters as its run did."""
    max_new_tokens: int = 0
    max_model_len_source: str = MAX_MODEL_LEN
    """Where ``max_model_len`` came from, for the filter's reason."""
    dynamic_max_rounds: int | None = None
    """Dynamic sampling (``spec.training.sampling.dynamic``): the refill rounds a step may take
    after its own batch; None: off. Kept in the cut, so a resume refills as its run did."""

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.prompts_per_step < 1 or self.lookahead < 0:
            raise ValueError(f"invalid recovery config {self}")
        if self.on_dropped_prompt not in ("shrink", "replace"):
            raise ValueError(f"on_dropped_prompt must be 'shrink' or 'replace', got {self.on_dropped_prompt!r}")
        if not 0 < self.min_step_fraction <= 1:
            raise ValueError(f"min_step_fraction must be in (0, 1], got {self.min_step_fraction}")
        if self.dynamic_max_rounds is not None and self.dynamic_max_rounds < 1:
            raise ValueError(f"dynamic_max_rounds must be at least 1, got {self.dynamic_max_rounds}")

    @classmethod
    def from_spec(cls, spec: RLJobSpec, *, model_positions: int | None = None) -> RecoveryConfig:
        """The config an RLJob spec asks for; ``model_positions``: the policy's
        ``max_position_embeddings``, the prompt limit where ``maxModelLen`` is unset."""
        gen = spec.generation
        limit = prompt_limit(gen.max_model_len, gen.max_new_tokens, model_positions)
        dynamic = spec.training.sampling.dynamic
        return cls(
            group_size=gen.group_size,
            prompts_per_step=gen.prompts_per_step,
            lookahead=gen.lookahead,
            on_dropped_prompt=spec.preemption.on_dropped_prompt,
            min_step_fraction=spec.preemption.min_step_fraction,
            spare_pool_batches=spec.preemption.spare_pool_batches,
            max_model_len=limit.max_model_len if limit else None,
            max_new_tokens=limit.max_new_tokens if limit else 0,
            max_model_len_source=limit.source if limit else MAX_MODEL_LEN,
            dynamic_max_rounds=dynamic.max_rounds if dynamic else None,
        )

    @property
    def prompt_limit(self) -> PromptLimit | None:
        """The length prompts are filtered by at admission, or None."""
        if self.max_model_len is None:
            return None
        return PromptLimit(self.max_model_len, self.max_new_tokens, self.max_model_len_source)

    @property
    def min_groups_per_step(self) -> int:
        """The fewest groups a step may train on."""
        return math.ceil(self.min_step_fraction * self.prompts_per_step - 1e-9)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "group_size": self.group_size,
            "prompts_per_step": self.prompts_per_step,
            "lookahead": self.lookahead,
            "on_dropped_prompt": self.on_dropped_prompt,
            "min_step_fraction": self.min_step_fraction,
            "spare_pool_batches": self.spare_pool_batches,
            "audit_tail": self.audit_tail,
        }
        # Each only where set: the cuts of runs without it stay byte for byte what they were.
        if self.max_model_len is not None:
            out |= {
                "max_model_len": self.max_model_len,
                "max_new_tokens": self.max_new_tokens,
                "max_model_len_source": self.max_model_len_source,
            }
        if self.dynamic_max_rounds is not None:
            out["dynamic_max_rounds"] = self.dynamic_max_rounds
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RecoveryConfig:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass
class _Fill:
    """How the places of ``places`` prompts given up on are filled (:meth:`Owners._fill_plan`):
    the spares that take them, and the spares filtered on the way (group id -> reason)."""

    places: int
    take: list[Spare] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def short(self) -> int:
        """Places no spare fills: the step shrinks by as many."""
        return self.places - len(self.take)


class PromptSource(Protocol):
    """The loader as the owners see it (see :class:`spotrl_runtime.data.loader.PromptLoader`)."""

    def next_batch(self) -> list[Prompt]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Dispatch:
    """Work for generation: produce ``rollout_indexes`` of ``group_id``'s prompt."""

    group_id: str
    prompt: Prompt
    target_step: int
    rollout_indexes: tuple[int, ...]
    """The rollouts still missing (all G unless finished siblings were kept)."""
    weight_version: int
    relaunch: bool = False
    """True for a group that was in flight when the cut it was restored from was taken."""
    round: int = 0
    """Dynamic sampling: the refill round the group belongs to (0: its step's own batch)."""
    resume: tuple[EpisodeState, ...] = ()
    """Finished turns of its unfinished episodes (multi-turn jobs): they continue from there."""

    @property
    def generations(self) -> int:
        """How many rollouts to generate."""
        return len(self.rollout_indexes)


@dataclass
class RecoveryCounters:
    """Telemetry of this attempt. ``groups_discarded`` must stay 0: every discard path raises."""

    groups_found: int = 0
    """Ledger groups in the cut this attempt restored from."""
    finished_found: int = 0
    """Finished groups (replay buffer) in that cut; they train without generation."""
    groups_relaunched: int = 0
    """Restored ledger groups dispatched again (ADMITTED at once, RESERVED through the gate)."""
    groups_discarded: int = 0
    rollouts_reused: int = 0
    """Finished sibling rollouts of restored ADMITTED groups that were kept, not regenerated."""
    turns_found: int = 0
    """Finished turns of unfinished episodes in that cut (they resume, not regenerated)."""
    prompts_dropped: int = 0
    prompts_filtered: int = 0
    """Prompts the admission filter refused (:mod:`spotrl_runtime.core.admission`)."""
    borrows: int = 0
    replace_fallbacks: int = 0
    """Drops under 'replace' that found the spare pool empty and shrank the step instead."""


@dataclass(frozen=True)
class OwnersSnapshot:
    """Every owner at one instant: what a cut writes and what a restore rebuilds from.

    ``prompts`` holds the live prompt of each ledger group and spare. A cut writes only their
    locators; a restore fills it with prompts rebuilt from ``dataset[idx]``.
    """

    config: RecoveryConfig
    attempt: int
    trainer_step: int
    dispatch_index: int
    next_order: int
    next_admission: int
    loader_state: dict[str, Any]
    ledger: tuple[LedgerRecord, ...]
    partial: Mapping[str, tuple[Rollout, ...]]
    spares: tuple[Spare, ...]
    replay: tuple[ReplayEntry, ...]
    shortfall: Mapping[int, int]
    dropped: Mapping[int, tuple[DroppedPrompt, ...]]
    audit_tail: tuple[AuditRecord, ...]
    retired: OrderSet = field(default_factory=OrderSet)
    redo: tuple[RedoStep, ...] = ()
    """The steps trained since the newest committed full cut (what a delta cut holds)."""
    """Orders that left every live owner: trained, or dropped."""
    prompts: Mapping[str, Prompt] = field(default_factory=dict)
    episodes: Mapping[str, tuple[EpisodeState, ...]] = field(default_factory=dict)
    """The finished turns of the ledger groups' unfinished episodes."""
    extra: Any = None
    """What the cut's state function returned under the lock (trainer state, RNG); opaque here."""
    captured_at: float = 0.0
    capture_seconds: float = 0.0
    """How long the lock was held for the in-memory copy."""


# ---------------------------------------------------------------------------- owners


class Owners:
    """All owners of a run's prompts and the moves between them, under one lock."""

    def __init__(
        self,
        config: RecoveryConfig,
        source: PromptSource,
        *,
        attempt: int = 0,
        admission_filter: AdmissionFilter | None = None,
    ):
        """``admission_filter``: see :meth:`set_admission_filter`."""
        self.config = config
        self._filter = admission_filter
        self.attempt = attempt
        self._source = source
        self._cond = threading.Condition(threading.Lock())
        self._trainer_step = 0
        self._sampler = LookaheadSampler(config.lookahead)
        self._ledger = Ledger()
        self._spares = SparePool()
        self._buffer = ReplayBuffer()
        self._shortfall: dict[int, int] = {}
        self._dropped: dict[int, list[DroppedPrompt]] = {}
        self._audit = AuditLog(config.audit_tail)
        self._redo = RedoLog()
        self._retired = OrderSet()
        self._next_order = 0
        self._next_admission = 0
        self._training: int | None = None
        self._cuts_waiting = 0
        self._redispatch: list[str] = []
        self._restored_reserved: set[str] = set()
        self.counters = RecoveryCounters()

    # ------------------------------------------------------------------ reading

    @property
    def trainer_step(self) -> int:
        """The next step to train (= steps trained so far)."""
        return self._trainer_step

    @property
    def dispatch_index(self) -> int:
        """The sampler cursor: the last step stamped (-1 before the first admission)."""
        return self._sampler.dispatch_index

    def in_flight(self) -> list[Dispatch]:
        """Dispatches for every ADMITTED group, e.g. to resend the work of a lost worker."""
        with self._cond:
            return [self._dispatch(r) for r in self._ledger.records() if r.phase is Phase.ADMITTED]

    def dispatch_again(self, group_id: str) -> Dispatch | None:
        """The dispatch of an ADMITTED group as the ledger holds it now (its finished siblings
        left out, its episodes' finished turns to resume), to send again after its worker was
        lost; None if it is no longer in flight."""
        with self._cond:
            rec = self._ledger.get(group_id)
            return self._dispatch(rec) if rec is not None and rec.phase is Phase.ADMITTED else None

    def census(self) -> dict[str, int]:
        """Groups per owner right now (the loader's unread rows are not counted)."""
        with self._cond:
            records = self._ledger.records()
            reserved = sum(1 for r in records if r.phase is Phase.RESERVED)
            return {
                "spare_pool": len(self._spares),
                "ledger_reserved": reserved,
                "ledger_admitted": len(records) - reserved,
                "replay_buffer": len(self._buffer),
            }

    def step_ready(self) -> bool:
        """Whether :meth:`begin_step` would succeed now."""
        with self._cond:
            return self._training is None and self._ready_problem() is None

    def wait_step_ready(self, timeout: float | None = None) -> bool:
        """Blocks until the next step can begin (or ``timeout`` seconds pass)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._training is None and self._ready_problem() is None, timeout)

    # ------------------------------------------------------------- loader side

    def pump(self) -> list[Dispatch]:
        """Everything that may be dispatched now, in the order it must go.

        First (once, after a restore) the groups that were ADMITTED at the cut, with their
        saved ``group_id`` and ``target_step``. Then, while the gate is open: top up the spare
        pool, admit the oldest RESERVED batch (its prompts the admission filter refuses are
        filtered, their places filled as ``onDroppedPrompt`` says), take the next batch. One
        batch is always left RESERVED at the gate, so the next admission needs no loader read.
        Last, under dynamic sampling, the refill round of the next step to train, when it is due
        (:meth:`_refill`).
        """
        with self._cond:
            out: list[Dispatch] = []
            if self._redispatch:
                for gid in self._redispatch:
                    rec = self._ledger.get(gid)
                    if rec is not None and rec.phase is Phase.ADMITTED:
                        out.append(replace(self._dispatch(rec), relaunch=True))
                self.counters.groups_relaunched += len(out)
                self._redispatch = []
            while True:
                if not self._ledger.has_reserved():
                    self._take_batch()
                batch = self._admissible()
                if batch is None:
                    return out + self._refill()
                # The pool is topped up before the admission (the same loader reads, in the same
                # order, as after it): the batch's filtered prompts may need spares.
                self._top_up_spares()
                out.extend(self._admit(batch))

    def versions_wanted(self) -> set[int]:
        """The weight versions older than the trainer's that the next groups dispatched will ask
        for: the ADMITTED groups' (a restore relaunches them) and those of the batches the gate
        admits before the trainer's next step. A restore that can rebuild them (a delta's redo
        passes through them) gives them to the pool first, so every group is generated by its
        admission weights."""
        with self._cond:
            admitted = {
                r.weight_version
                for r in self._ledger.records()
                if r.phase is Phase.ADMITTED and r.weight_version is not None
            }
            upcoming = range(self._sampler.next_stamp, self._trainer_step + self.config.lookahead + 1)
            gated = {self._sampler.admission_version(t) for t in upcoming}
            return {v for v in admitted | gated if v < self._trainer_step}

    def _take_batch(self) -> list[str]:
        prompts = self._source.next_batch()
        admission = self._new_admission_id()
        ids = []
        for prompt in prompts:
            gid, order = self._new_group_id()
            record = LedgerRecord(
                group_id=gid,
                admission_id=admission,
                order=order,
                idx=prompt.idx,
                task_name=prompt.task_name,
                phase=Phase.RESERVED,
                target_step=None,
                expected_generations=self.config.group_size,
                fingerprint=prompt.fingerprint,
            )
            self._ledger.put(record, prompt)
            ids.append(gid)
        return ids

    def _top_up_spares(self) -> int:
        if self.config.on_dropped_prompt != "replace":
            return 0
        batch = self.config.prompts_per_step
        taken = 0
        while len(self._spares) + batch <= self.config.spare_pool_batches * batch:
            self._read_spares()
            taken += 1
        return taken

    def _read_spares(self) -> None:
        """The loader's next batch into the spare pool."""
        batch_id = self._new_admission_id()
        for prompt in self._source.next_batch():
            gid, order = self._new_group_id()
            self._spares.add(Spare(gid, batch_id, order, prompt.idx, prompt.task_name, prompt.fingerprint), prompt)

    def _admissible(self) -> list[LedgerRecord] | None:
        """The oldest RESERVED batch if the gate lets it through now, else None."""
        batch = self._ledger.oldest_reserved()
        if batch is None or not self._sampler.gate_open(self._trainer_step):
            return None
        step = self._sampler.next_stamp
        if self._buffer.count(step) or self._ledger.count_stamped(step) or self._shortfall.get(step):
            # The cursor is below stamps already given out: admitting would mix two batches
            # into one step (and the old code's answer, dropping prompts, loses data).
            raise AdmissionIntoFinishedStepError(
                f"admitting {batch[0].admission_id} would stamp it {step}, but step {step} already holds "
                f"{self._buffer.count(step)} finished and {self._ledger.count_stamped(step)} in-flight groups; "
                f"the sampler cursor ({self._sampler.dispatch_index}) is behind the stamps; this is a bug, "
                "not a recoverable state"
            )
        return batch

    def _admit(self, batch: list[LedgerRecord]) -> list[Dispatch]:
        """Stamps ``batch`` with the next step: the prompts the filter refuses are filtered and
        their places filled (spares) or given up (shrink); the rest are dispatched."""
        step = self._sampler.next_stamp
        # The weights a step's groups are generated with are a function of the step alone, never
        # of timing: the version the gate opened at (lookahead L: step t is generated by the
        # weights of step t - L). The pool holds a group until that version reaches it.
        version = self._sampler.admission_version(step)
        refused = {r.group_id: why for r in batch if (why := self._refusal(self._ledger.prompt(r.group_id)))}
        fill = self._fill_plan(len(refused))
        if fill.short:
            first = next(r for r in batch if r.group_id in refused)
            self._check_room(step, fill.short, first, refused[first.group_id], FILTERED)
        self._sampler.stamp()  # nothing below raises
        out = []
        for rec in batch:
            restored = rec.group_id in self._restored_reserved
            self._restored_reserved.discard(rec.group_id)
            if rec.group_id in refused:
                self._leave(rec, step, refused[rec.group_id], FILTERED)
                continue
            admitted = rec.admitted(step, version)
            self._ledger.restamp(admitted)
            out.append(self._dispatch(admitted))
            self.counters.groups_relaunched += restored
        out += self._take_spares(fill, step, step, version)
        if fill.short:
            self._shortfall[step] = self._shortfall.get(step, 0) + fill.short
        return out

    def set_admission_filter(self, admission_filter: AdmissionFilter | None) -> None:
        """The filter every prompt passes when admitted (:mod:`~spotrl_runtime.core.admission`):
        the controller builds it from ``config.prompt_limit`` (this run's, or the cut's after a
        restore) and the encoder generation uses."""
        with self._cond:
            self._filter = admission_filter

    def _refusal(self, prompt: Prompt) -> str | None:
        if self._filter is None:
            if self.config.max_model_len is not None:
                raise OwnershipError(
                    f"the run filters prompts longer than {self.config.max_model_len} - {self.config.max_new_tokens} "
                    "tokens, but no admission filter was set (Owners.set_admission_filter); this is a bug"
                )
            return None
        return self._filter(prompt)

    def _fill_plan(self, places: int, *, refill: bool = False) -> _Fill:
        """Which spares fill ``places`` places under ``replace`` (or in a ``refill`` round of
        dynamic sampling): the oldest that the filter admits, and those it refuses on the way
        (filtered in turn). Changes nothing."""
        fill = _Fill(places)
        if self.config.on_dropped_prompt != "replace" and not refill:
            return fill
        for spare, prompt in self._spares.items():
            if len(fill.take) == places:
                break
            why = self._refusal(prompt)
            if why is None:
                fill.take.append(spare)
            else:
                fill.refused[spare.group_id] = why
        return fill

    def _take_spares(
        self, fill: _Fill, filtered_at: int, stamp: int, version: int, rounds: Sequence[int] = ()
    ) -> list[Dispatch]:
        """Carries out ``fill``: pops the spares it looked at, oldest first; each refused one is
        filtered at step ``filtered_at``, each taken one is admitted with ``stamp``, ``version``
        and the next of ``rounds`` (dynamic sampling's round of the place it fills; 0 past them)."""
        out = []
        round_of = iter(rounds)
        for _ in range(len(fill.take) + len(fill.refused)):
            spare, prompt = self._spares.pop()
            why = fill.refused.get(spare.group_id)
            if why is not None:
                self._retired.add(spare.order)
                left = DroppedPrompt(spare.group_id, spare.idx, spare.task_name, why, FILTERED)
                self._dropped.setdefault(filtered_at, []).append(left)
                self.counters.prompts_filtered += 1
                continue
            record = LedgerRecord(
                group_id=spare.group_id,
                admission_id=self._new_admission_id(),
                order=spare.order,
                idx=spare.idx,
                task_name=spare.task_name,
                phase=Phase.ADMITTED,
                target_step=stamp,
                expected_generations=self.config.group_size,
                weight_version=version,
                fingerprint=spare.fingerprint,
                round=next(round_of, 0),
            )
            self._ledger.put(record, prompt)
            out.append(self._dispatch(record))
        return out

    def _leave(self, rec: LedgerRecord, step: int, reason: str, state: str) -> None:
        """``rec`` leaves the ledger untrained (dropped or filtered) at ``step``, its reason kept."""
        self._ledger.remove(rec.group_id)
        self._retired.add(rec.order)
        self._dropped.setdefault(step, []).append(DroppedPrompt(rec.group_id, rec.idx, rec.task_name, reason, state))
        if state == FILTERED:
            self.counters.prompts_filtered += 1
        else:
            self.counters.prompts_dropped += 1

    def _check_room(self, step: int, short: int, rec: LedgerRecord, reason: str, state: str) -> None:
        """Raises :class:`StepTooSmallError` if ``short`` more places given up would leave
        ``step`` below ``minStepFraction``."""
        remaining = self.config.prompts_per_step - self._shortfall.get(step, 0) - short
        if remaining >= self.config.min_groups_per_step:
            return
        if state == FILTERED:
            fix = "lower spec.preemption.minStepFraction" + (
                ", raise spec.generation.maxModelLen or lower maxNewTokens, or take such prompts out of the dataset"
                if reason.startswith(PROMPT_TOO_LONG)
                else ""
            )
        else:
            fix = "fix generation or lower spec.preemption.minStepFraction"
        verb = "filtering" if state == FILTERED else "dropping"
        raise StepTooSmallError(
            f"{verb} group {rec.group_id} (idx {rec.idx}, {reason})"
            + (f" and {short - 1} more" if short > 1 else "")
            + f" would leave step {step} with {remaining} of {self.config.prompts_per_step} groups, below "
            f"minStepFraction {self.config.min_step_fraction}; {fix}"
            + ("; the spare pool is empty" if self.config.on_dropped_prompt == "replace" else "")
        )

    # --------------------------------------------------------- generation side

    def keep_turns(self, episode: EpisodeState) -> bool:
        """An unfinished episode of an ADMITTED group finished a turn: the ledger keeps its state
        (the newest of each episode), so that no cut after this loses the turn. False for a
        group or episode that is not in flight (a late report), which changes nothing."""
        with self._cond:
            rec = self._ledger.get(episode.group_id)
            if rec is None or rec.phase is not Phase.ADMITTED or not 0 <= episode.index < rec.expected_generations:
                return False
            if episode.index in self._ledger.partial(episode.group_id):
                return False
            kept = self._ledger.episodes(episode.group_id)
            if episode.index in kept and kept[episode.index].turns >= episode.turns:
                return False
            kept[episode.index] = episode
            return True

    def forget_turns(self, group_id: str) -> None:
        """Lets go of the finished turns kept for a group's episodes (its generation is retried
        from the first turn, with other seeds)."""
        with self._cond:
            if self._ledger.get(group_id) is not None:
                self._ledger.episodes(group_id).clear()

    def add_rollout(self, group_id: str, rollout: Rollout) -> FinishedGroup | None:
        """One rollout of an ADMITTED group finished. The last one finishes the group (see below)."""
        return self.finish_group(group_id, [rollout], partial_ok=True)

    def finish_group(
        self, group_id: str, rollouts: Iterable[Rollout], *, partial_ok: bool = False
    ) -> FinishedGroup | None:
        """Rollouts of an ADMITTED group finished.

        When the group then has all G rollouts, this is the "group finished" move, as one
        mutation: the group enters the replay buffer with its rows and leaves the ledger.
        With ``partial_ok=False`` the rollouts must complete the group.
        """
        new = list(rollouts)
        with self._cond:
            rec = self._ledger.get(group_id)
            if rec is None or rec.phase is not Phase.ADMITTED:
                where = "is RESERVED (not dispatched yet)" if rec is not None else "is not in the ledger"
                raise UnknownGroupError(
                    f"rollouts for group {group_id}, which {where}; a late or duplicate result must be ignored"
                )
            have = self._ledger.partial(group_id)
            seen: set[int] = set()
            for r in new:
                if r.group_id != group_id:
                    raise RolloutMismatchError(f"a rollout of group {r.group_id} was handed in for group {group_id}")
                if not 0 <= r.index < rec.expected_generations:
                    raise RolloutMismatchError(
                        f"rollout index {r.index} of group {group_id} is outside 0..{rec.expected_generations - 1}"
                    )
                if r.index in have or r.index in seen:
                    raise RolloutMismatchError(f"rollout {r.index} of group {group_id} was handed in twice")
                seen.add(r.index)
            total = len(have) + len(new)
            if total < rec.expected_generations and not partial_ok:
                raise RolloutMismatchError(
                    f"group {group_id} would have {total} of {rec.expected_generations} rollouts; "
                    "hand in the missing ones or use add_rollout"
                )
            for r in new:
                have[r.index] = r
                self._ledger.episodes(group_id).pop(r.index, None)
            if total < rec.expected_generations:
                return None
            _, prompt, rows = self._ledger.remove(group_id)
            assert rec.target_step is not None
            group = FinishedGroup(group_id=group_id, prompt=prompt, target_step=rec.target_step, rollouts=rows)
            self._buffer.add(ReplayEntry(group, rec.admission_id, rec.order, rec.weight_version, rec.round))
            self._cond.notify_all()
            return group

    def drop_group(self, group_id: str, reason: str) -> list[Dispatch]:
        """Gives up on an ADMITTED group, by the run's ``onDroppedPrompt`` policy.

        ``shrink``: the step trains on one group fewer; the shortfall is kept (and cut) per
        step; below ``minStepFraction`` this raises :class:`StepTooSmallError` instead.
        ``replace``: the oldest spare the admission filter admits replaces it (older spares
        it refuses are filtered on the way). If a later step holds a finished group, the
        furthest such step lends its first group to the short step (re-stamped) and the
        spare is dispatched with the lender's stamp, so no step waits on new generation;
        otherwise the spare takes the dropped group's stamp. Borrow, spare reservation and
        ledger change are one mutation. Returns the spare's dispatch (if any); with no spare
        left, ``replace`` shrinks the step.
        """
        return self._give_up(group_id, reason, DROPPED)

    def filter_group(self, group_id: str, reason: str) -> list[Dispatch]:
        """Filters an ADMITTED group for ``reason`` (about the prompt, not a failure: e.g. a
        dynamic-sampling filter after its rollouts): as :meth:`drop_group`, but it ends
        ``filtered`` in the audit and in ``promptsFiltered``."""
        return self._give_up(group_id, reason, FILTERED)

    def _give_up(self, group_id: str, reason: str, state: str) -> list[Dispatch]:
        with self._cond:
            rec = self._ledger.get(group_id)
            if rec is None or rec.phase is not Phase.ADMITTED or rec.target_step is None:
                verb = "filter" if state == FILTERED else "drop"
                raise UnknownGroupError(f"cannot {verb} group {group_id}: it is not an ADMITTED ledger group")
            step = rec.target_step
            fill = self._fill_plan(1)
            if fill.short:
                self._check_room(step, 1, rec, reason, state)
            # Nothing below raises.
            self._leave(rec, step, reason, state)
            out = self._replace_dropped(step, fill, rec.round) if fill.take else self._take_spares(fill, step, step, 0)
            if fill.short:
                self._shortfall[step] = self._shortfall.get(step, 0) + 1
                if self.config.on_dropped_prompt == "replace":
                    self.counters.replace_fallbacks += 1
            self._cond.notify_all()
            return out

    def _replace_dropped(self, step: int, fill: _Fill, round: int) -> list[Dispatch]:
        """``replace``: the spare ``fill`` takes fills the dropped group's place, after the
        furthest later step lends the short step a finished group if one can."""
        lenders = [s for s in self._buffer.steps() if s > step]
        lender_step = lenders[-1] if lenders else None
        borrowed = self._buffer.groups(lender_step)[0] if lender_step is not None else None
        if borrowed is not None:
            self._buffer.restamp(borrowed.group_id, step)
            self.counters.borrows += 1
        spare_step = lender_step if lender_step is not None else step
        return self._take_spares(fill, step, spare_step, self._trainer_step, (round,))

    # ------------------------------------------------------------ trainer side

    def _ready_problem(self) -> str | None:
        step = self._trainer_step
        if self._sampler.dispatch_index < step:
            return f"step {step} has not been admitted yet (cursor {self._sampler.dispatch_index})"
        in_flight = self._ledger.count_stamped(step)
        if in_flight:
            return f"step {step} still has {in_flight} groups generating"
        expected = self.config.prompts_per_step - self._shortfall.get(step, 0)
        have = self._buffer.count(step)
        if have != expected:
            return f"step {step} holds {have} finished groups, expected {expected}"
        if self._spent(step):
            return f"step {step} holds groups without signal that a refill round replaces (dynamic sampling)"
        return None

    # ---------------------------------------------------------- dynamic sampling

    def _spent(self, step: int) -> list[ReplayEntry]:
        """The finished groups of ``step`` that dynamic sampling filters: no signal, rounds left."""
        rounds = self.config.dynamic_max_rounds
        if rounds is None:
            return []
        return [e for e in self._buffer.groups(step) if e.round < rounds and without_signal(e.group)]

    def _refill(self) -> list[Dispatch]:
        """Dynamic sampling's refill round of the next step to train, once all its groups have
        finished: those without signal leave filtered, and as many spares (loader batches read
        into the pool as needed), one round on, take their places with the trainer's weights.

        Due only between optimizer steps and after the gate's admissions (the end of
        :meth:`pump`), and decided over the whole round, never group by group: which groups a
        step trains, and the loader's reads, are then the same whatever order the groups finish
        in, and a resume from any cut refills as the run would have."""
        step = self._trainer_step
        if self._training is not None or self._ledger.count_stamped(step):
            return []
        spent = self._spent(step)
        if not spent:
            return []
        fill = self._refill_plan(len(spent))
        taken = spent[: len(fill.take)]
        assert self.config.dynamic_max_rounds is not None
        for e in spent[len(fill.take) :]:  # no spare the filter admits: trained as they are
            self._buffer.remove(e.group_id)
            self._buffer.add(replace(e, round=self.config.dynamic_max_rounds))
        for e in taken:
            self._buffer.remove(e.group_id)
            self._retired.add(e.order)
            prompt = e.group.prompt
            why = without_signal(e.group)
            assert why is not None
            self._dropped.setdefault(step, []).append(
                DroppedPrompt(e.group_id, prompt.idx, prompt.task_name, why, FILTERED)
            )
            self.counters.prompts_filtered += 1
        return self._take_spares(fill, step, step, self._trainer_step, [e.round + 1 for e in taken])

    def _refill_plan(self, places: int) -> _Fill:
        """The spares a refill round takes, loader batches read into the pool while it is short
        (at most ``places`` + 1: an admission filter that refuses batch after batch leaves the
        remaining places to the groups that hold them)."""
        fill = self._fill_plan(places, refill=True)
        for _ in range(places + 1):
            if not fill.short:
                break
            self._read_spares()
            fill = self._fill_plan(places, refill=True)
        return fill

    def begin_step(self) -> list[FinishedGroup]:
        """The next step's finished groups, in loader order. They stay owned by the replay
        buffer until :meth:`commit_step`; a cut waits for that commit."""
        with self._cond:
            self._cond.wait_for(lambda: self._cuts_waiting == 0)
            if self._training is not None:
                raise StepNotReadyError(f"step {self._training} is already being trained")
            problem = self._ready_problem()
            if problem is not None:
                raise StepNotReadyError(problem)
            self._training = self._trainer_step
            return [e.group for e in self._buffer.groups(self._trainer_step)]

    def commit_step(self, weight_version: int | None = None, fingerprint: StepFingerprint | None = None) -> AuditRecord:
        """The optimizer step is done: its groups move to trained (and, with the step's
        ``fingerprint``, to the redo log); returns the audit record. A step without a
        fingerprint empties the redo log: no delta cut can cover it, only a full cut."""
        with self._cond:
            step = self._training
            if step is None:
                raise StepNotReadyError("commit_step without begin_step")
            entries = self._buffer.take(step)
            # A delta's redo steps must each have an audit record in the cut's audit tail: a log
            # longer than the tail could never be cut, so it is dropped rather than grow.
            if fingerprint is None or len(self._redo) >= self.config.audit_tail:
                self._redo = RedoLog()
            if fingerprint is not None:
                if len(self._redo) and self._redo.steps()[-1].step != step - 1:
                    self._redo = RedoLog()
                self._redo.append(RedoStep(step, tuple(entries), fingerprint))
            for e in entries:
                self._retired.add(e.order)
            record = AuditRecord(
                step=step,
                attempt=self.attempt,
                weight_version=step + 1 if weight_version is None else weight_version,
                group_ids=tuple(e.group_id for e in entries),
                idxs=tuple(e.group.prompt.idx for e in entries),
                task_names=tuple(e.group.prompt.task_name for e in entries),
                dropped=tuple(self._dropped.pop(step, ())),
                rounds=max((e.round for e in entries), default=0),
            )
            self._shortfall.pop(step, None)
            self._audit.append(record)
            self._trainer_step = step + 1
            self._training = None
            self._cond.notify_all()
            return record

    def trim_redo(self, before: int) -> int:
        """A full cut at trainer step ``before`` committed: the redo log drops the steps it holds."""
        with self._cond:
            return self._redo.trim(before)

    def redo_steps(self) -> tuple[RedoStep, ...]:
        with self._cond:
            return self._redo.steps()

    def abort_step(self) -> None:
        """The optimizer step failed: its groups stay in the replay buffer for a retry."""
        with self._cond:
            self._training = None
            self._cond.notify_all()

    # -------------------------------------------------------------------- cut

    def capture(self, state_fn: Callable[[], Any] | None = None, *, timeout: float | None = None) -> OwnersSnapshot:
        """Copies every owner at one instant (the in-memory half of a cut).

        Waits (up to ``timeout`` seconds, else :class:`CutTimeoutError`) for a running
        optimizer step to commit, and keeps the next one from starting; generation results
        wait only for the copy itself. ``state_fn`` runs under the lock too: it returns the
        trainer's state (weights, optimizer, RNG) consistent with ``trainer_step``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._cond.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise CutTimeoutError(f"could not take the owners' lock within {timeout} s")
        try:
            self._cuts_waiting += 1
            try:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._cond.wait_for(lambda: self._training is None, remaining):
                    raise CutTimeoutError(
                        f"step {self._training} was still training when the cut's deadline passed ({timeout} s)"
                    )
                t0 = time.perf_counter()
                records = self._ledger.records()
                snapshot = OwnersSnapshot(
                    config=self.config,
                    attempt=self.attempt,
                    trainer_step=self._trainer_step,
                    dispatch_index=self._sampler.dispatch_index,
                    next_order=self._next_order,
                    next_admission=self._next_admission,
                    loader_state=copy.deepcopy(self._source.state_dict()),
                    ledger=tuple(records),
                    partial={
                        r.group_id: tuple(sorted(self._ledger.partial(r.group_id).values(), key=lambda x: x.index))
                        for r in records
                        if self._ledger.partial(r.group_id)
                    },
                    episodes={
                        r.group_id: tuple(v for _, v in sorted(self._ledger.episodes(r.group_id).items()))
                        for r in records
                        if self._ledger.episodes(r.group_id)
                    },
                    spares=tuple(self._spares.spares()),
                    replay=tuple(self._buffer.entries()),
                    shortfall=dict(self._shortfall),
                    dropped={s: tuple(d) for s, d in self._dropped.items()},
                    audit_tail=self._audit.tail(),
                    retired=OrderSet(self._retired.intervals()),
                    redo=self._redo.steps(),
                    prompts={
                        **{r.group_id: self._ledger.prompt(r.group_id) for r in records},
                        **{s.group_id: p for s, p in self._spares.items()},
                    },
                    extra=state_fn() if state_fn is not None else None,
                    captured_at=time.time(),
                )
                return replace(snapshot, capture_seconds=time.perf_counter() - t0)
            finally:
                self._cuts_waiting -= 1
                self._cond.notify_all()
        finally:
            self._cond.release()

    # ---------------------------------------------------------------- restore

    @classmethod
    def restore(cls, snapshot: OwnersSnapshot, source: PromptSource, *, attempt: int) -> Owners:
        """Owners rebuilt from a validated snapshot; the loader resumes at the saved position.

        The saved cursor is used as is. The first :meth:`pump` sends the ADMITTED groups
        again (same ``group_id`` and ``target_step``, finished siblings kept); RESERVED
        batches then pass the gate again in admission order.
        """
        owners = cls(snapshot.config, source, attempt=attempt)
        source.load_state_dict(copy.deepcopy(snapshot.loader_state))
        owners._trainer_step = snapshot.trainer_step
        owners._sampler = LookaheadSampler(snapshot.config.lookahead, snapshot.dispatch_index)
        owners._next_order = snapshot.next_order
        owners._next_admission = snapshot.next_admission
        for rec in sorted(snapshot.ledger, key=lambda r: r.order):
            partial = tuple(snapshot.partial.get(rec.group_id, ()))
            episodes = tuple(snapshot.episodes.get(rec.group_id, ()))
            owners._ledger.put(rec, snapshot.prompts[rec.group_id], partial, episodes)
            if rec.phase is Phase.ADMITTED:
                owners._redispatch.append(rec.group_id)
                owners.counters.rollouts_reused += len(partial)
                owners.counters.turns_found += sum(e.turns for e in episodes)
            else:
                owners._restored_reserved.add(rec.group_id)
        for spare in snapshot.spares:
            owners._spares.add(spare, snapshot.prompts[spare.group_id])
        for entry in snapshot.replay:
            owners._buffer.add(entry)
        owners._shortfall = dict(snapshot.shortfall)
        owners._dropped = {s: list(d) for s, d in snapshot.dropped.items()}
        owners._audit = AuditLog(snapshot.config.audit_tail, snapshot.audit_tail)
        owners._retired = OrderSet(snapshot.retired.intervals())
        owners._redo = RedoLog(snapshot.redo)
        owners.counters.groups_found = len(snapshot.ledger)
        owners.counters.finished_found = len(snapshot.replay)
        return owners

    # ---------------------------------------------------------------- helpers

    def _new_group_id(self) -> tuple[str, int]:
        order = self._next_order
        self._next_order += 1
        return f"g{order}", order

    def _new_admission_id(self) -> str:
        aid = f"a{self._next_admission}"
        self._next_admission += 1
        return aid

    def _dispatch(self, rec: LedgerRecord) -> Dispatch:
        assert rec.target_step is not None
        assert rec.weight_version is not None
        have = self._ledger.partial(rec.group_id)
        missing = tuple(i for i in range(rec.expected_generations) if i not in have)
        prompt = self._ledger.prompt(rec.group_id)
        kept = self._ledger.episodes(rec.group_id)
        resume = tuple(kept[i] for i in missing if i in kept)
        return Dispatch(
            rec.group_id, prompt, rec.target_step, missing, rec.weight_version, round=rec.round, resume=resume
        )
