"""The controller: one process per job, read top to bottom.

It ties the recovery core (:class:`~spotrl_runtime.core.owners.Owners`) to generation
workers (Ray actors) and the GRPO trainer, with three threads:

- the **trainer** (the caller's thread, :meth:`Controller.run`): waits until every group of
  the next step is in the replay buffer, trains on them, commits the step (the groups
  become "trained" and the step is audited), asks for a periodic cut every N steps or T
  seconds, and sends the new weights to the workers over the weight channel when their turn
  comes (:meth:`~spotrl_runtime.generation.pool.GenerationPool.sync`: they never pass
  through this process unless it is the trainer), and to any worker that joined meanwhile;
- the **dispatcher**: moves prompts from the loader through the lookahead gate to the
  workers (``owners.pump``), and each result back ("group finished" is one move into the
  replay buffer); retries failed groups, drops them after ``maxRetries`` (the
  ``onDroppedPrompt`` policy), and redispatches groups whose worker died;
- the **cut writer**: takes periodic cuts and barrier cuts, one at a time, through the one
  :class:`~spotrl_runtime.checkpoint.writer.CutWriter`. Only the in-memory capture holds
  the ownership lock; generation keeps running while the files are written.

Everything it drives (storage, owners, trainer, workers, cut writer) is built and restored
before it exists, by :func:`~spotrl_runtime.controller.assemble.assemble`; where the workers
run is :mod:`spotrl_runtime.generation.cluster`'s business.

A barrier (:meth:`Controller.request_barrier`, from SIGTERM or SIGINT, the HTTP endpoint or the
Kubernetes bridge) parks the controller: nothing more is admitted or trained, the cut is
taken, and the process waits to be stopped. Exit codes: 0 every step trained, 143 stopped
by SIGTERM and 130 by SIGINT (after its barrier cut), 3 refused (the run cannot start from its storage: another
job's store, a cut that fails the validation chain), 4 fenced (a newer controller claimed the
job; this one stopped before auditing or cutting anything more), 5 a trainer rank lost, 1 an
error (the message names it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field, fields, replace
from typing import Any

from spotrl_runtime.api.rljob import EXIT_RANK_LOST, EXIT_REFUSED, RLJob
from spotrl_runtime.api.times import Deadline
from spotrl_runtime.checkpoint.fence import FencedError
from spotrl_runtime.checkpoint.writer import CutConflictError, CutForm, CutRequest
from spotrl_runtime.controller.assemble import ControllerError, ControllerOptions, Parts
from spotrl_runtime.controller.control import BarrierFailed, CutInfo
from spotrl_runtime.controller.tensorboard import TensorBoardLog
from spotrl_runtime.controller.validation import Validator
from spotrl_runtime.core.cut_estimate import CutEstimator, barrier_form
from spotrl_runtime.core.cut_schedule import CutSchedule
from spotrl_runtime.core.dynamic_sampling import sampling_stats
from spotrl_runtime.core.owners import Dispatch, OwnershipError, OwnersSnapshot, UnknownGroupError
from spotrl_runtime.core.step_stats import LearningSignal, idle_shares, rollout_stats
from spotrl_runtime.core.types import FinishedGroup, Rollout
from spotrl_runtime.failpoints import failpoint
from spotrl_runtime.generation import GroupFailed, GroupGenerated, GroupLost, TurnsFinished
from spotrl_runtime.generation.pool import SyncResult
from spotrl_runtime.generation.rollouts import make_request, score_group
from spotrl_runtime.generation.types import EpisodeCounts, WorkerReport
from spotrl_runtime.generation.weights import WeightSyncCancelledError
from spotrl_runtime.rewards.runner import RewardFailure
from spotrl_runtime.rollouts.transcripts import transcripts
from spotrl_runtime.training.group import CaptureRefusedError, TrainerGroup
from spotrl_runtime.training.rows import ROLLOUT_GAP_METRICS, STALE_GAP_METRICS
from spotrl_runtime.training.trainer import StepInterruptedError

log = logging.getLogger("spotrl.controller")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_TERMINATED = 143
EXIT_FENCED = 4
"""Another controller owns the job (a newer attempt claimed it): this one wrote nothing more."""


def _refill_round(pumped: Sequence[Dispatch]) -> None:
    """Logs the refill round among what the gate let through (a relaunched group is the cut's)."""
    refills = [d for d in pumped if d.round and not d.relaunch]
    if refills:
        failpoint("dispatch.refill", refills[0].target_step)
        log.info(
            "dynamic sampling: step %d's refill round %d generates %d group(s) in place of those without signal",
            refills[0].target_step,
            refills[0].round,
            len(refills),
        )


SHAPING_STATS = ("overlong_filtered", "overlong_penalty_mean", "reward_kl_penalty_mean")
"""The trainer's metrics of ``training.overlong`` and ``training.kl.inReward``, kept where they are set."""

TRAINER_STATS = (
    "kl",
    "entropy",
    "clip_fraction",
    "grad_norm",
    "learning_rate",
    "is_weight_mean",
    "is_weight_max",
    "is_capped_fraction",
    "outside_nucleus_fraction",
    "padding_share",
)
"""The trainer's step metrics the audit and /metrics keep (``clip_fraction``: PPO's, the tokens
whose ratio the clip bounded; ``kl``: to the reference policy, 0 without one; ``entropy``: the
policy's, per trained token, in nats; ``is_weight_*``: the off-policy correction's importance
weight; ``outside_nucleus_fraction``: the trained tokens outside the trainer's top-p nucleus,
left out of the loss; ``padding_share``: the share of the positions computed that were padding)."""
STATS = (
    "groups_generated",
    "groups_retried",
    "groups_lost_redispatched",
    "prompts_dropped",
    "tokens_generated",
    "version_mismatches",
    "turns_kept",
    "turns_resumed",
    "episodes_restarted",
    "tool_calls",
    "tool_errors",
    "environment_seconds",
)
"""What :attr:`Controller.stats` counts (``turns_kept``: an episode's finished turns the ledger
took; ``turns_resumed``: finished turns a resumed episode went on from, not generated again;
``episodes_restarted``: episodes with finished turns that started again from turn 0, their
environment having not replayed; ``tool_calls``, ``tool_errors``, ``environment_seconds``: what
the episodes' environments answered, how many of the answers were errors, and how long the
episodes waited on them)."""


@dataclass
class _CutJob:
    """A cut waiting for the cut-writer thread, and the future its asker waits on."""

    request: CutRequest
    snapshot: OwnersSnapshot | None = None
    """Periodic cuts: captured on the trainer thread at the step boundary."""
    done: Future[CutInfo] = field(default_factory=Future)


def _newest_full_then_delta(pending: list[_CutJob]) -> list[_CutJob]:
    """Of periodic snapshots waiting, in capture order: the newest full one, then the newest
    delta captured after it (either may be absent)."""
    fulls = [i for i, j in enumerate(pending) if j.request.form == "full"]
    start = fulls[-1] if fulls else 0
    deltas = [j for j in pending[start:] if j.request.form == "delta"]
    return ([pending[start]] if fulls else []) + deltas[-1:]


class Controller:
    """Runs one job to completion, or until it is stopped; see the module docstring."""

    def __init__(self, job: RLJob, options: ControllerOptions, parts: Parts, stop: threading.Event | None = None):
        """``stop``: the event a SIGTERM set while the parts were assembled (it carries over)."""
        self.job = job
        self.spec = job.spec
        self.options = options
        self.parts = parts
        self.owners = parts.owners
        self.trainer = parts.trainer
        self.resumed_from = parts.resumed_from
        self.target_steps = min(self.spec.training.total_steps, options.max_steps or self.spec.training.total_steps)
        self._parked = threading.Event()
        """Set by a barrier: no more admissions and no more optimizer steps."""
        self._stop = stop or threading.Event()
        self._training = threading.Event()
        """Set when the dispatcher and cut writer start: from then on a SIGTERM cuts."""
        self._failure: BaseException | None = None
        self._terminated = False
        self._stop_deadline: Deadline | None = None
        """Set by a stop signal: when the grace period it started runs out (--sigterm-deadline)."""
        self._barrier_lock = threading.Lock()
        self._barrier_cut: CutInfo | None = None
        self._cuts: queue.Queue[_CutJob | None] = queue.Queue()
        self._weights: queue.Queue[int] = queue.Queue()
        """Weight versions for the dispatcher to give the pool, every one in order (none is
        skipped), after the groups it pumped first; the trainer thread then sends each."""
        self._newest_cut: _CutJob | None = None
        """The newest periodic cut taken: the next step's commit waits for it (:meth:`_wait_for_cut`)."""
        self._last_sync: SyncResult | None = None
        """The newest sync of the weights a step starts from, for that step's record."""
        self._wake = threading.Event()
        """The dispatcher's doorbell: rung when a step is committed (the gate may open, new
        weights wait), on a barrier and on stop. With no call in flight the dispatcher sleeps
        on it instead of spinning (which took a core and the GIL from the trainer)."""
        checkpoint = self.spec.checkpoint
        now = time.monotonic()
        self._schedule = CutSchedule(
            every_steps=checkpoint.every_steps,
            every_seconds=checkpoint.every_seconds,
            delta_every_steps=checkpoint.delta_every_steps,
            delta_every_seconds=checkpoint.delta_every_seconds,
            last_full_at=now,
            last_cut_at=now,
            last_cut_step=parts.owners.trainer_step,
            based=parts.writer.base is not None,
        )
        """When the periodic cuts are taken (:mod:`spotrl_runtime.core.cut_schedule`)."""
        self.stats: dict[str, float] = dict.fromkeys(STATS, 0.0)
        self._signal = LearningSignal()
        self._reward_errors: dict[str, int] = {}
        """Completions the reward failed on, by group, until the group is trained (in memory: a
        group finished before a restore counts none)."""
        self._version_mismatches: set[str] = set()
        """Groups generated with other weights than their admission version, until trained."""
        self.history: list[dict[str, Any]] = []
        """One entry per step this process trained: step, reward, seconds ..."""
        self._last_step_at = time.monotonic()
        self._last_generated = 0.0
        self.tensorboard = TensorBoardLog(parts.storage, parts.owners.attempt)
        """The event file of this attempt, next to the cuts (a status sink like the others)."""
        self.options.sinks.append(self.tensorboard)
        self.cuts: list[CutInfo] = []
        self.validator = Validator(self.spec, parts.encode, parts.reward) if self.spec.validation else None
        """Scores the held-out split every validation.everySteps (on the dispatcher thread)."""
        self.cut_estimator = CutEstimator(waits_for_step=isinstance(self.trainer, TrainerGroup))
        """A barrier cut's seconds, estimated from this controller's committed cuts (with a
        trainer group, the step a barrier waits for)."""

    # ================================================================== run

    def run(self) -> int:
        """Trains until every step is done or the process is stopped. Returns the exit code."""
        for sink in self.options.sinks:
            sink.on_started(self.resumed_from, self.parts.skipped)
        if self.resumed_from is not None:
            failpoint("run.resumed", self.resumed_from.step)  # a test holds a resumed run before it trains
        for hook in self.options.on_ready:
            hook(self)
        threads = [
            threading.Thread(target=self._guard(self._dispatch_loop), name="dispatcher", daemon=True),
            threading.Thread(target=self._guard(self._cut_loop), name="cut-writer", daemon=True),
        ]
        self._training.set()
        for t in threads:
            t.start()
        try:
            finished = self._train_loop()
            final = self._periodic_cut("final") if finished else None
            if final is not None:
                if not self._final_committed(final):
                    return EXIT_TERMINATED
                for sink in self.options.sinks:
                    sink.on_finished(self.owners.trainer_step)
                return EXIT_OK
            # Parked by a barrier or asked to stop: wait for SIGTERM (or the stop it caused).
            self._stop.wait()
            if self._failure is not None:
                raise self._failure
            return EXIT_TERMINATED
        finally:
            self._stop.set()
            self._wake.set()
            self._cuts.put(None)
            # After a SIGTERM the grace period is running out: a thread stuck in storage (a
            # periodic cut's stalled upload) is not waited for long; it is a daemon.
            for t in threads:
                t.join(timeout=5 if self._terminated else 30)
            self.tensorboard.close()
            self.parts.shutdown()

    def _final_committed(self, final: _CutJob) -> bool:
        """Waits for the final cut (the trained policy, safe in storage). After a stop signal,
        no longer than its deadline: the grace period is running out, and the kubelet would kill
        the process in the middle of the write. False then; the last committed cut stands, and
        the next attempt trains the steps after it again."""
        while True:
            try:
                final.done.result(timeout=0.2)
                return True
            except FutureTimeoutError:
                deadline = self._stop_deadline
                if deadline is not None and deadline.remaining() <= 0:
                    log.error(
                        "stopped: the final cut did not commit within --sigterm-deadline "
                        "(the last committed cut stands; the steps after it are trained again)"
                    )
                    return False

    def _train_loop(self) -> bool:
        """The trainer thread. True when every step is trained."""
        owners, trainer, schedule = self.owners, self.trainer, self._schedule
        for i, (older, version) in enumerate(self.parts.weights_to_give):
            if i:  # the first was given to the pool before the relaunched groups were pumped
                self._weights.put(version)
                self._wake.set()
            sender = self.parts.sender if older is None else self._older_sender(older)
            self._sync_weights(version, sender)
        while owners.trainer_step < self.target_steps:
            self._raise_failure()
            if self._parked.is_set() or self._stop.is_set():
                return False
            self._serve_joiners()
            self._cut_by_the_clock()
            if not owners.wait_step_ready(timeout=0.2):
                continue
            why = schedule.at_ready()
            if why is not None and not self._parked.is_set():
                self._periodic_cut(why, "full")
            if self._parked.is_set():  # a barrier came, maybe while the periodic cut was captured
                return False
            t0 = time.monotonic()
            trained = self._train_step()
            if trained is None:
                return False
            self._report_step(*trained, seconds=time.monotonic() - t0)
            # Not once a barrier was asked for while this step trained: the barrier's cut holds
            # it (and should one be captured after this check, a trainer group refuses the
            # periodic capture rather than replace the barrier's).
            why = schedule.after_step(owners.trainer_step)
            if why is not None and owners.trainer_step < self.target_steps and not self._parked.is_set():
                self._periodic_cut(why, "delta")
            if owners.trainer_step < self.target_steps:
                self._weights.put(trainer.step)
                self._wake.set()
                self._sync_weights(trainer.step, self.parts.sender)
        return True

    def _train_step(self) -> tuple[Any, list[FinishedGroup], dict[str, float], float] | None:
        """Trains the step whose groups are ready and commits it: (its audit record, its groups,
        the trainer's metrics, the seconds it waited for the last cut); None if a barrier
        interrupted it (its groups stay in the replay buffer)."""
        owners, trainer = self.owners, self.trainer
        holding = self._newest_cut  # the cut of the step before this one, if any was taken
        groups = owners.begin_step()
        try:
            failpoint("train.step", owners.trainer_step)
            # A barrier interrupts the step (between micro-batches: it waits for one, not
            # for the whole step); the step's groups stay in the replay buffer, in the cut.
            metrics = trainer.train_step(groups, interrupted=self._parked.is_set)
        except StepInterruptedError as err:
            owners.abort_step()
            log.info("%s: a barrier came; its groups stay in the replay buffer", err)
            return None
        except Exception:
            owners.abort_step()
            raise
        cut_wait = self._wait_for_cut(holding)
        record = owners.commit_step(weight_version=trainer.step, fingerprint=self._fingerprint(metrics))
        # A fenced controller (a newer attempt claimed the job, or a cut found a newer
        # writer) stops here: the step it just trained is never audited.
        self._raise_failure()
        self.parts.fence.check()
        self._wake.set()
        return record, groups, metrics, cut_wait

    def _report_step(
        self, record: Any, groups: list[FinishedGroup], metrics: dict[str, float], cut_wait: float, *, seconds: float
    ) -> None:
        """A trained step's statistics to the audit, the history and every sink (TensorBoard,
        /metrics, the console)."""
        reward, step_stats = self._step_stats(record, groups, metrics, cut_wait, seconds)
        entry = {
            "step": record.step,
            "attempt": record.attempt,
            "reward": reward,
            "seconds": seconds,
            "loss": metrics.get("loss", 0.0),
            "tokens": metrics.get("tokens", 0.0),
            **step_stats,
        }
        # The generator's mismatch with the trainer (training/rows.py: step_metrics), where measured.
        gap = {k: metrics[k] for k in (*ROLLOUT_GAP_METRICS, *STALE_GAP_METRICS) if k in metrics}
        entry.update(gap)
        self.parts.audit.write(record, reward=reward, seconds=round(seconds, 4), **step_stats, **gap)
        if self.job.spec.environment is not None:
            self.parts.audit.write_episodes(record, transcripts(groups, self._decode))
        self.history.append(entry)
        for sink in self.options.sinks:
            sink.on_step(self.owners.trainer_step, entry)

    def _step_stats(
        self, record: Any, groups: list[FinishedGroup], metrics: dict[str, float], cut_wait: float, seconds: float
    ) -> tuple[float, dict[str, float]]:
        """(the mean reward, the step's statistics as its audit record keeps them)."""
        stats = rollout_stats(groups)
        stats["reward_errors"] = float(sum(self._reward_errors.pop(g.group_id, 0) for g in groups))
        mismatched = {g.group_id for g in groups} & self._version_mismatches
        self._version_mismatches -= mismatched
        stats["version_mismatches"] = float(len(mismatched))
        if self._signal.observe(stats["frac_reward_zero_std"]):
            log.warning(
                "no learning signal: in each of the last %d steps every group's rollouts had equal rewards, so "
                "nothing was trained (mean reward %.3f); check the reward, the dataset's answerField, and that "
                "the policy can solve some of the prompts",
                self._signal.streak,
                stats["reward_mean"],
            )
        stats["steps_without_signal"] = float(self._signal.streak)
        sync, self._last_sync = self._last_sync, None
        stats["weight_sync_seconds"] = sync.seconds if sync is not None else 0.0
        stats["weight_sync_bytes"] = float(sync.bytes) if sync is not None else 0.0
        stats["cut_wait_seconds"] = cut_wait
        for validated in self.validator.finished() if self.validator is not None else []:
            stats.update(validated)  # the newest pass finished since the last step
        reward = stats["reward_mean"]
        # Generation's pace since the last step: what the workers produced meanwhile.
        now, generated = time.monotonic(), self.stats["tokens_generated"]
        since = now - self._last_step_at
        gen_tps = (generated - self._last_generated) / since if since > 0 else 0.0
        # And the share of that time each worker did not generate (the pool's timestamps).
        idle, idlest = idle_shares(self.parts.pool.busy_seconds(self._last_step_at, now).values(), since)
        self._last_step_at, self._last_generated = now, generated
        learned = {k: round(float(metrics.get(k, 0.0)), 6) for k in TRAINER_STATS}
        learned |= {k: round(float(metrics[k]), 6) for k in SHAPING_STATS if k in metrics}
        learned |= sampling_stats(record) if self.owners.config.dynamic_max_rounds is not None else {}
        step_stats = {
            **{k: round(v, 6) for k, v in stats.items() if k != "reward_mean"},
            **learned,
            "train_tokens_per_second": round(metrics.get("tokens", 0.0) / seconds, 2) if seconds > 0 else 0.0,
            "generation_tokens_per_second": round(gen_tps, 2),
            "generation_idle_share": round(idle, 4),
            "generation_idle_share_max": round(idlest, 4),
        }
        return reward, step_stats

    def _sync_weights(self, version: int, sender: Any) -> None:
        """Sends weight ``version`` to the workers when its turn comes (the dispatcher gives it
        to the pool after the groups it pumped first). The trainer's weights must not change
        meanwhile, so it runs on this thread, between steps. A barrier cancels it at once: the
        weights would never be used."""
        try:
            result = self.parts.pool.sync(version, sender, cancelled=self._ending, waiting=self._cut_by_the_clock)
        except WeightSyncCancelledError:
            why = "the run stopping" if self._failure is not None else "a barrier"
            log.info("the sync of weight version %d was cancelled by %s", version, why)
            return
        self._last_sync = result
        log.debug(
            "weight version %d: %d bytes to %d worker(s) in %.3f s",
            version,
            result.bytes,
            result.members,
            result.seconds,
        )
        self._serve_joiners()

    def _ending(self) -> bool:
        """A barrier parked the run, or it is stopping (a failed thread, SIGTERM): a sync then
        ends at once."""
        return self._parked.is_set() or self._stop.is_set()

    def _cut_by_the_clock(self) -> None:
        """A delta cut while the trainer waits (for its step's groups, or for its weights' turn
        to be sent), when ``deltaEverySeconds`` says one is due."""
        why = self._schedule.while_waiting(time.monotonic())
        if why is not None and not self._parked.is_set():
            self._periodic_cut(why, "delta")

    def _serve_joiners(self) -> None:
        """Gives the trainer's current weights to workers that started or restarted since the
        last sync (or whose receive failed): they take no group before."""
        try:
            result = self.parts.pool.sync_joiners(self.parts.sender, self.trainer.step, cancelled=self._ending)
        except WeightSyncCancelledError:
            return
        if result is not None and result.failed:
            log.warning("a joining worker's weight sync failed: %s", result.failed)

    def _older_sender(self, weights: dict[str, Any]) -> Any:
        """A sender of an older version a resume rebuilt (its relaunched groups ask for it)."""
        from spotrl_runtime.generation.weights import ChannelHost, WeightSender, channel_host_address

        current = self.parts.sender
        channel = ChannelHost(channel_host_address(), timeout=current.channel.timeout)
        bucket = max(b.nbytes for b in current.plan.buckets)
        return WeightSender(lambda: weights, current.plan.tensors[0].dtype, channel, bucket)

    def _decode(self, ids: list[int]) -> str:
        """Token ids as text, the chat template's markers kept (a transcript shows them)."""
        return str(self.parts.tokenizer.decode(ids, skip_special_tokens=False))

    def _fingerprint(self, metrics: dict[str, float]) -> Any:
        """The step's fingerprint for the redo log, when delta cuts may be taken (periodic ones,
        or ``checkpoint.barrier`` auto or delta); None keeps no redo log."""
        if self.spec.checkpoint.barrier == "full" and not self._schedule.deltas:
            return None
        return self.trainer.fingerprint(metrics)

    def _barrier_form(self, remaining: float) -> CutForm:
        """``full`` or ``delta``: what this barrier cut holds (see
        :func:`~spotrl_runtime.core.cut_estimate.barrier_form`)."""
        why_not = None
        base = self.parts.writer.base
        if base is None:
            why_not = "no full cut to extend yet"
        else:
            steps = [s.step for s in self.owners.redo_steps() if s.step >= base.trainer_step]
            if steps != list(range(base.trainer_step, self.owners.trainer_step)):
                why_not = f"the redo log does not hold every step since full cut {base.cut_id}"
        form, why = barrier_form(
            self.spec.checkpoint.barrier, self.cut_estimator.estimate(), remaining, delta_possible=why_not
        )
        log.info("barrier cut: %s (%s)", form, why)
        return form

    # ================================================================== generation

    def _dispatch_loop(self) -> None:
        """The dispatcher thread: loader → gate → workers → replay buffer."""
        owners, pool, gen = self.owners, self.parts.pool, self.spec.generation
        inflight: dict[str, Dispatch] = {}
        tries: dict[str, int] = {}

        def send(dispatches: Sequence[Dispatch]) -> None:
            reqs = []
            for d in dispatches:
                inflight[d.group_id] = d
                ids = self.parts.encode(d.prompt)
                req = make_request(
                    d.group_id, ids, gen, run_seed=self.spec.training.seed, attempt=tries.get(d.group_id, 0)
                )
                reqs.append(
                    replace(
                        req,
                        n=d.generations,
                        weight_version=d.weight_version,
                        indexes=d.rollout_indexes,
                        resume=d.resume,
                    )
                )
            if reqs:
                pool.submit(reqs)

        validator = self.validator
        if validator is not None:
            pool.submit(validator.due(pool.version()))  # the weights the run starts from
        while not self._stop.is_set():
            # Cleared before the state is read: a ring from here on ends the wait below.
            self._wake.clear()
            if self._parked.is_set():
                # A barrier is this controller's last word: nothing generated from now on can
                # reach a cut (the cut holds the groups in flight as ADMITTED, to be sent again
                # after the resume). Pausing the workers now gives their CPUs (a weight load,
                # a generation) to the barrier's writer; they are killed when the run stops.
                if validator is not None:
                    validator.abandon()  # never waited for, never in a cut
                paused = pool.freeze()
                log.info(
                    "parked: generation paused (%d local worker(s) stopped; %d groups in flight stay in the ledger)",
                    len(paused),
                    len(inflight),
                )
                return
            # What the gate lets through first, then the trainer's new weights, every version in
            # order: a group asks for the version it was admitted with, and the pool sends each
            # version only after the groups that ask for an older one.
            pumped = owners.pump()
            _refill_round(pumped)
            send(pumped)
            while not self._weights.empty() and not self._parked.is_set():
                version = self._weights.get_nowait()
                pool.give(version)
                if validator is not None:
                    pool.submit(validator.due(version))
            outcomes = pool.poll(timeout=0.05)
            if not outcomes and not pool.calls_in_flight():
                # poll came back at once (nothing to wait on): the gate is closed until the
                # trainer commits a step. Sleep until then, at most 50 ms.
                self._wake.wait(0.05)
            for outcome in outcomes:
                self._take(outcome, inflight, tries, send)

    def _take(
        self,
        outcome: WorkerReport,
        inflight: dict[str, Dispatch],
        tries: dict[str, int],
        send: Callable[[Sequence[Dispatch]], None],
    ) -> None:
        """One report of the pool: a finished turn goes to the ledger; a group generated to the
        replay buffer; a group lost is sent again (its episodes' finished turns with it); a
        group failed is retried from its first turn (new seeds), then dropped."""
        owners, validator = self.owners, self.validator
        if isinstance(outcome, TurnsFinished):
            if outcome.group_id in inflight and not self._parked.is_set():
                self.stats["turns_kept"] += int(owners.keep_turns(outcome.episode))
            return
        if validator is not None and validator.owns(outcome.group_id):
            if not self._parked.is_set():
                self.parts.pool.submit(validator.take(outcome))
            return
        d = inflight.pop(outcome.group_id, None)
        if d is None or self._parked.is_set():
            return  # after a barrier nothing moves; the cut holds this group as ADMITTED
        if isinstance(outcome, GroupGenerated):
            send(self._finish(d, outcome))
        elif isinstance(outcome, GroupLost):
            self.stats["groups_lost_redispatched"] += 1
            log.warning("group %s lost with its worker (%s); redispatching", d.group_id, outcome.reason)
            again = owners.dispatch_again(d.group_id)
            send([replace(again, relaunch=d.relaunch)] if again is not None else [])
        elif isinstance(outcome, GroupFailed):
            tries[d.group_id] = tries.get(d.group_id, 0) + 1
            owners.forget_turns(d.group_id)  # the retry's episodes start again, with its own seeds
            if tries[d.group_id] <= self.spec.generation.max_retries:
                self.stats["groups_retried"] += 1
                send([replace(d, resume=())])
            else:
                send(self._drop(d, f"generation failed: {outcome.error}"))

    def _drop(self, d: Dispatch, reason: str) -> list[Dispatch]:
        """Gives up on a group (``reason`` goes to the log and the step's audit record), by the
        run's ``onDroppedPrompt``; returns the spare to dispatch in its place, if any."""
        self.stats["prompts_dropped"] += 1
        log.warning("dropping group %s: %s", d.group_id, reason)
        try:
            return self.owners.drop_group(d.group_id, reason)
        except UnknownGroupError:
            return []  # dropped or finished meanwhile

    def _finish(self, d: Dispatch, generated: Any) -> list[Dispatch]:
        """Scores a generated group and hands it to the replay buffer; a reward that failed on
        one of its rollouts drops the group (the audit keeps why). Returns what to dispatch."""
        failpoint("dispatch.finish", d.target_step)
        reward = self.spec.reward
        drop = reward.on_error == "drop"
        scores = self.parts.reward.score(d.prompt, [s.text for s in generated.samples], stop_at_failure=drop)
        failed = [(i, s) for i, s in enumerate(scores) if isinstance(s, RewardFailure)]
        if failed and drop:
            return self._drop(d, f"reward failed on rollout {failed[0][0]}: {failed[0][1].message}")
        if failed:
            log.warning(
                "group %s: the reward failed on %d of %d rollouts (scored %g): %s",
                d.group_id,
                len(failed),
                len(scores),
                reward.error_score,
                failed[0][1].message,
            )
            scores = [reward.error_score if isinstance(s, RewardFailure) else s for s in scores]
        scored = score_group(generated, d.prompt, scores, d.target_step)  # type: ignore[arg-type]
        rollouts = [
            Rollout(**{**r.__dict__, "index": d.rollout_indexes[i]})
            for i, r in enumerate(scored.rollouts[: len(d.rollout_indexes)])
        ]
        try:
            self.owners.finish_group(d.group_id, rollouts, partial_ok=True)
        except UnknownGroupError:
            return []  # a late duplicate (e.g. the group was dropped meanwhile)
        if failed:  # counted once the group is the replay buffer's: a late duplicate counts nothing
            self._reward_errors[d.group_id] = len(failed)
        if generated.weight_version != d.weight_version:
            # Its admission version had left the workers (a group redispatched after its worker
            # died, or relaunched from a cut that cannot rebuild it): trained all the same, the
            # importance weight correcting for the difference.
            self._version_mismatches.add(d.group_id)
            self.stats["version_mismatches"] += 1
            log.warning(
                "group %s was generated with weights %d, not %d (its admission version)",
                d.group_id,
                generated.weight_version,
                d.weight_version,
            )
        self.stats["groups_generated"] += 1
        self._count_episodes(d.group_id, generated.episodes)
        self.stats["tokens_generated"] += sum(len(r.completion_token_ids) for r in rollouts)
        return []

    def _count_episodes(self, group_id: str, counts: EpisodeCounts) -> None:
        for f in fields(counts):
            self.stats[f.name] += getattr(counts, f.name)
        if counts.turns_resumed or counts.episodes_restarted:
            log.info(
                "group %s: %d finished turn(s) resumed, %d episode(s) restarted from turn 0 (did not replay)",
                group_id,
                counts.turns_resumed,
                counts.episodes_restarted,
            )

    # ================================================================== cuts

    def _trainer_state(self, last: bool = False) -> Any:
        """The cut's state function: runs under the ownership lock, between optimizer steps.
        Takes the trainer's tensors by reference: the trainer waits for them only at its next
        optimizer step (a periodic cut's background copy is done by then). ``last`` (a
        barrier: no step follows): nothing is copied, the writer reads the live tensors."""
        return self.trainer.snapshot({"model": self.spec.policy.model}, last=last)

    def _periodic_cut(self, reason: str, form: CutForm = "full") -> _CutJob | None:
        """Captures now, on the trainer thread, so the cut lands exactly on this step boundary;
        the cut-writer thread writes the files while training goes on. A delta captures the
        owners only (their redo log holds the steps since the newest full cut). None when a
        trainer group refused it: a barrier captured since holds this step (and is the last word)."""
        failpoint("cut.periodic", self.owners.trainer_step)
        try:
            snapshot = self.owners.capture(self._trainer_state if form == "full" else None)
        except CaptureRefusedError as err:
            log.info("periodic cut (%s) not taken: %s", reason, err)
            return None
        job = _CutJob(replace(CutRequest.periodic(reason), form=form), snapshot=snapshot)
        self._schedule.taken(form, self.owners.trainer_step, time.monotonic())
        self._newest_cut = job
        self._cuts.put(job)
        return job

    def _wait_for_cut(self, job: _CutJob | None) -> float:
        """With delta cuts on, a step commits only once the cut holding the step before it has
        (committed or failed): a cut writer slower than a step slows training, by the seconds
        returned, rather than let a loss without notice cost more than the step in progress
        and the one whose cut is being written. A barrier or a stop ends the wait (the barrier's
        cut holds this step); a failed thread raises."""
        if job is None or job.done.done() or not self._schedule.deltas:
            return 0.0
        t0 = time.monotonic()
        while not job.done.done() and not self._ending():
            self._raise_failure()
            wait([job.done], timeout=0.2)
        seconds = time.monotonic() - t0
        if seconds >= 1.0:
            log.info("step %d waited %.1f s for the cut of the step before it", self.owners.trainer_step, seconds)
        return round(seconds, 4)

    def _cut_loop(self) -> None:
        """The cut-writer thread. A barrier supersedes periodic snapshots still waiting (it is
        captured later, so it holds everything they hold). Of several waiting periodic snapshots
        the newest full one is written, then the newest delta captured after it: cut ids must
        grow with the state they hold, and a delta must not leave its base unwritten."""
        while True:
            job = self._cuts.get()
            if job is None:
                return
            pending = [job]
            while not self._cuts.empty():
                nxt = self._cuts.get_nowait()
                if nxt is None:
                    self._cuts.put(None)
                    break
                pending.append(nxt)
            barriers = [j for j in pending if j.request.kind == "barrier"]
            last_word = next((c for c in reversed(self.cuts) if c.kind == "barrier"), None)
            if last_word is not None and not barriers:
                # A committed barrier is this controller's last word: a periodic snapshot
                # captured before it must not become a newer (but older) cut.
                for j in pending:
                    j.done.set_result(last_word)
                continue
            chosen = barriers[:1] if barriers else _newest_full_then_delta(pending)
            info = None
            for j in chosen:
                info = self._write_cut(j)
            for j in pending:
                if j in chosen:
                    continue
                if info is not None:
                    j.done.set_result(info)
                else:
                    j.done.set_exception(RuntimeError(f"superseded by a {chosen[-1].request.kind} cut that failed"))

    def _write_cut(self, job: _CutJob) -> CutInfo | None:
        request = job.request
        t0 = time.monotonic()
        try:
            if job.snapshot is None and request.form == "delta":
                committed = self.parts.writer.write(self.owners, request)
            elif job.snapshot is None:
                last = request.kind == "barrier"
                committed = self.parts.writer.write(self.owners, request, lambda: self._trainer_state(last))
            else:
                committed = self.parts.writer.write_snapshot(job.snapshot, request)
        except Exception as err:
            log.error("%s cut (%s) failed: %s", request.kind, request.reason, err)
            job.done.set_exception(err)
            if isinstance(err, (CutConflictError, FencedError)):
                # Another controller owns the job: stop at once, write nothing more.
                self._fail(err)
            return None
        seconds = time.monotonic() - t0 + (job.snapshot.capture_seconds if job.snapshot else 0.0)
        committed_at = time.time()
        if committed.manifest.is_delta:
            estimate = self.cut_estimator.estimate()  # what a full cut would take: a delta tells nothing of it
        else:
            self.owners.trim_redo(committed.manifest.trainer_step)
            estimate = self.cut_estimator.add_cut(
                kind=request.kind,
                bytes=committed.bytes_written,
                seconds=seconds,
                timings=committed.timings,
                step=committed.manifest.trainer_step,
                at=committed_at,
            )
        if estimate is not None:
            log.info(
                "barrier cut estimate: %.2f s (%d bytes at %.0f bytes/s + %.2f s fixed, from %d cuts)",
                estimate.seconds,
                estimate.bytes,
                estimate.bytes_per_second,
                estimate.overhead_seconds,
                estimate.based_on_cuts,
            )
        info = CutInfo(
            cut_id=committed.cut_id,
            step=committed.manifest.trainer_step,
            uri=committed.uri,
            kind=request.kind,
            committed_at=committed_at,
            seconds=seconds,
            bytes=committed.bytes_written,
            timings=dict(committed.timings),
            estimate=estimate,
            form=committed.manifest.form,
        )
        self.cuts.append(info)
        for sink in self.options.sinks:
            sink.on_cut(info)
        job.done.set_result(info)
        return info

    # ================================================================== barrier

    def request_barrier(self, reason: str, deadline: Deadline) -> CutInfo:
        """See :class:`~spotrl_runtime.controller.control.Controllable`. Idempotent."""
        with self._barrier_lock:
            if self._barrier_cut is not None:
                return self._barrier_cut
            self._parked.set()
            self._wake.set()
            remaining = deadline.remaining()
            if remaining <= 0:
                raise BarrierFailed(f"barrier ({reason}) arrived after its deadline")
            job = _CutJob(CutRequest.barrier(deadline, reason, self._barrier_form(remaining)))
            self._cuts.put(job)
            try:
                info = job.done.result(timeout=remaining + 5)
            except FutureTimeoutError:
                raise BarrierFailed(
                    f"barrier cut ({reason}) missed its deadline: not committed within {remaining:.1f} s "
                    "(an earlier cut still held the cut writer)"
                ) from None
            except Exception as err:
                raise BarrierFailed(f"barrier cut ({reason}) did not commit: {err}") from err
            self._barrier_cut = info
            log.info("barrier cut %s committed at step %d in %.2f s (%s)", info.cut_id, info.step, info.seconds, reason)
            return info

    def on_stop_signal(self, name: str = "SIGTERM") -> None:
        """SIGTERM or SIGINT (``name``, the barrier's reason): take a barrier cut within the
        deadline (unless one exists), then stop. Returns at once; the cut runs on a thread.
        What further signals do: :mod:`spotrl_runtime.controller.signals`."""
        if self._terminated:
            return
        self._terminated = True
        deadline = self._stop_deadline = Deadline.after(self.options.sigterm_deadline)

        def cut_then_stop() -> None:
            try:
                if not self._training.is_set():
                    # Still starting (restoring, waiting for workers): nothing happened since
                    # the cut it restores from, and no cut writer runs yet.
                    return
                if not (self.owners.trainer_step >= self.target_steps and not self._parked.is_set()):
                    self.request_barrier(name, deadline)
            except BarrierFailed as err:
                # Missed or failed: said, and the process still stops as the signal asked (143
                # or 130); the last committed cut stands, and no torn cut is left.
                log.error("%s: %s; stopping without a barrier cut (the last committed cut stands)", name, err)
            except Exception as err:
                self._failure = err
            finally:
                self._stop.set()

        threading.Thread(target=cut_then_stop, name="sigterm", daemon=True).start()

    # ================================================================== plumbing

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        """A background thread's failure stops the run with that error."""

        def run() -> None:
            try:
                fn()
            except BaseException as err:
                if not self._stop.is_set():
                    log.error("%s failed: %s", threading.current_thread().name, err)
                    self._fail(err)

        return run

    def _fail(self, err: BaseException) -> None:
        """Stops the run with ``err``: nothing more is admitted, trained or audited."""
        if self._failure is None:
            self._failure = err
        self._parked.set()
        self._stop.set()
        self._wake.set()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    @property
    def parked(self) -> bool:
        """A barrier was asked for: nothing more is admitted or trained."""
        return self._parked.is_set()


__all__ = ["EXIT_RANK_LOST", "EXIT_REFUSED", "Controller", "ControllerError", "ControllerOptions", "OwnershipError"]
