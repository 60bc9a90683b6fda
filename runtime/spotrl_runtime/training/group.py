"""The trainer group: ``training.parallelism.ranks`` FSDP2 ranks as Ray actors, driven as one trainer.

The controller drives a :class:`TrainerGroup` exactly as it drives a single-process
:class:`~spotrl_runtime.training.trainer.Trainer`: ``train_step(groups)``, ``step``,
``policy_state_dict()`` for the generation workers, ``snapshot()`` for a cut and
``load_sharded(cut)`` on restore. Behind it:

- the ranks are actors in one placement group (a gang: all of them get a place, or none
  starts), one bundle per rank (``cpusPerRank``, ``gpusPerRank``, and with ``trainerPods``
  one unit of :data:`~spotrl_runtime.generation.cluster.TRAINER_RESOURCE`, which each trainer
  pod offers once);
- a step's rows are split among the ranks by whole groups (:func:`~spotrl_runtime.training.rows.split_rows`);
  the ranks' loss sums add up to the single process's metrics;
- a cut is captured on every rank between steps (a copy of its shards), then written by every
  rank through torch.distributed.checkpoint while training goes on; the cut's manifest lists
  each rank's files;
- a rank that dies (its process, pod or node) fails the step or the cut with
  :class:`RankLostError`: the group cannot go on without it, and the controller exits
  ``EXIT_RANK_LOST`` so that the next one restores from the last cut.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from spotrl_runtime.core.redo import StepFingerprint
from spotrl_runtime.core.types import FinishedGroup, RankLostError
from spotrl_runtime.models import lora
from spotrl_runtime.training.rows import (
    LossSums,
    Row,
    Scored,
    micro_batches,
    score_rows,
    scored_by_group,
    split_groups,
    split_rows,
    step_metrics,
    step_rows,
    step_updates,
)
from spotrl_runtime.training.trainer import TrainerConfig

log = logging.getLogger("spotrl.trainer")


class TrainerGroupError(RuntimeError):
    """The group could not start; the message says what to change."""


class CaptureRefusedError(RuntimeError):
    """A periodic capture was refused: a rank holds a barrier's capture not yet written, and a
    rank keeps one capture (its shards' copy), so the periodic one would replace it. The
    barrier's cut holds every step the periodic one would: skip it."""


class TrainerGroup:
    """See the module docstring. Start it with :meth:`start` (blocking until every rank is up)."""

    def __init__(
        self,
        policy: Any,
        config: TrainerConfig,
        *,
        ranks: int,
        device: str = "cpu",
        cpus_per_rank: float = 1.0,
        gpus_per_rank: int = 0,
        trainer_pods: bool = False,
        pad_token_id: int = 0,
        local_workers: int = 0,
    ) -> None:
        self.policy = policy
        self.config = config
        self.world = ranks
        self.device = "cuda" if gpus_per_rank else device
        self.cpus_per_rank = cpus_per_rank
        self.gpus_per_rank = gpus_per_rank
        self.trainer_pods = trainer_pods
        self.pad_token_id = pad_token_id
        self.local_workers = local_workers  # generation actors in this Ray beside the ranks
        self.step = 0
        self.pids: list[int] = []
        self.adapter: lora.AdapterIdentity | None = None
        """With ``policy.lora``: the adapter's identity, which the group's cuts record."""
        self._actors: list[Any] = []
        self._pg: Any = None
        self._lock = threading.Lock()

    @classmethod
    def from_rljob(cls, spec: Any, device: str, pad_token_id: int) -> TrainerGroup:
        par = spec.training.parallelism
        return cls(
            spec.policy,
            TrainerConfig.from_rljob(spec),
            ranks=par.ranks,
            device=device,
            cpus_per_rank=par.cpus_per_rank,
            gpus_per_rank=par.gpus_per_rank,
            trainer_pods=par.trainer_pods,
            pad_token_id=pad_token_id,
            local_workers=0 if spec.generation.worker_pods else spec.generation.workers,
        )

    # ------------------------------------------------------------------ start / stop

    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per rank."""
        from spotrl_runtime.generation.cluster import TRAINER_RESOURCE

        bundle: dict[str, float] = {"CPU": self.cpus_per_rank}
        if self.gpus_per_rank:
            bundle["GPU"] = float(self.gpus_per_rank)
        if self.trainer_pods:
            bundle[TRAINER_RESOURCE] = 1.0
        return [dict(bundle) for _ in range(self.world)]

    def start(self, timeout: float = 600.0, stop: threading.Event | None = None) -> None:
        """Places the ranks (waiting for trainer pods to join, up to ``timeout`` or ``stop``),
        forms the process group and shards the policy on every rank."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from spotrl_runtime.training.fsdp import TrainerRank

        if not self.trainer_pods:
            self._check_fits(ray.cluster_resources())
        self._pg = placement_group(self.bundles(), strategy="SPREAD" if self.trainer_pods else "PACK")
        waited = time.monotonic()
        while True:
            ready, _ = ray.wait([self._pg.ready()], timeout=1.0)
            if ready:
                break
            if (stop is not None and stop.is_set()) or time.monotonic() - waited > timeout:
                remove_placement_group(self._pg)
                self._pg = None
                where = (
                    "one trainer pod per rank to join (training.parallelism.trainerPods; see why they do not run: "
                    "kubectl describe pod <job>-trainer-...)"
                    if self.trainer_pods
                    else f"{self.world} x {self.bundles()[0]} in this controller's Ray (lower cpusPerRank, or "
                    "run the ranks in trainer pods)"
                )
                raise TrainerGroupError(f"the trainer group's {self.world} ranks found no place: waited for {where}")
        cls = ray.remote(TrainerRank)
        self._actors = [
            cls.options(
                num_cpus=self.cpus_per_rank,
                num_gpus=self.gpus_per_rank,
                max_concurrency=3,  # a step or a weight sync; a cut's write beside it; a sync's cancel
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=i
                ),
            ).remote(i, self.world, self.device, max(1, int(self.cpus_per_rank)))
            for i in range(self.world)
        ]
        master = self._get([self._actors[0].rendezvous.remote()])[0]
        started = self._get([a.start.remote(master, self.policy, self.config, self.pad_token_id) for a in self._actors])
        self.pids = [pid for pid, _, _ in started]
        # The ranks decided training.packing for the policy (auto): the driver plans as they pack.
        self.config = replace(self.config, packing=started[0][2])
        identity = started[0][1]  # rank 0's: its node's base files are the ones it loaded the weights from
        self.adapter = lora.AdapterIdentity(**{**identity, "targets": tuple(identity["targets"])}) if identity else None
        log.info("trainer group: %d FSDP2 ranks on %s (pids %s)", self.world, self.device, self.pids)

    def _check_fits(self, offered: Mapping[str, float]) -> None:
        """Ranks in the controller's own Ray: what they ask must be there now (no node joins
        later), beside the generation workers (Ray needs one CPU free to place each)."""
        asked: dict[str, float] = {"CPU": float(self.local_workers)}
        for bundle in self.bundles():
            for key, value in bundle.items():
                asked[key] = asked.get(key, 0.0) + value
        short = [
            f"{k} {v:g} (this Ray has {offered.get(k, 0.0):g})" for k, v in asked.items() if v > offered.get(k, 0.0)
        ]
        if short:
            raise TrainerGroupError(
                f"the trainer group's {self.world} ranks, beside {self.local_workers} generation worker(s), need "
                f"{', '.join(short)}: lower training.parallelism.cpusPerRank or ranks, or run the ranks in trainer "
                "pods (trainerPods: true)"
            )

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception as err:
                log.debug("killing a trainer rank: %s", err)
        self._actors = []
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception as err:
                log.debug("removing the trainer group's placement group: %s", err)
            self._pg = None

    # ------------------------------------------------------------------ the step

    def use_packing(self, packed: bool) -> None:
        """:meth:`~spotrl_runtime.training.trainer.Trainer.use_packing` on every rank, and in the plan."""
        self._get([a.use_packing.remote(packed) for a in self._actors])
        self.config = replace(self.config, packing="on" if packed else "off")

    def train_step(
        self, groups: Sequence[FinishedGroup], interrupted: Callable[[], bool] | None = None
    ) -> dict[str, float]:
        """One optimizer step over every rank; the metrics a single process would report.
        ``interrupted`` is not asked: the ranks must run the same passes, so a barrier waits
        for the group's step to end (the single process's stops between micro-batches)."""
        started = time.monotonic()
        scored = self.score_groups(groups) if self.config.objective.reward_kl else None
        plan = step_rows(groups, self.config.objective, scored)
        per_rank: list[list[tuple[list[Row], int, int]]] = [[] for _ in range(self.world)]
        for update in step_updates(groups, plan, self.config.objective, self.config.mini_batches):
            shares = split_rows(update, self.world)
            passes = micro_batches(
                shares, self.config.micro_batch_size, self.config.micro_batch_tokens, self.config.packed
            )
            for rank, share in enumerate(shares):
                per_rank[rank].append((share, update.tokens, passes))
        results = self._get(
            [a.train.remote(updates, self.step) for a, updates in zip(self._actors, per_rank, strict=True)]
        )
        sums = LossSums.total([r[0] for r in results])
        self.step += 1
        metrics = step_metrics(plan, sums, epochs=self.config.epochs)
        metrics.update(
            grad_norm=results[0][1],
            learning_rate=results[0][2],
            step=float(self.step),
            seconds=time.monotonic() - started,
        )
        return metrics

    def score_groups(self, groups: Sequence[FinishedGroup]) -> list[list[Scored]]:
        """Every rollout of ``groups`` scored over the ranks (whole groups to each, as a step's
        rows are split), per group, per rollout: ``training.kl.inReward``'s pass."""
        by_group = score_rows(groups)
        owners = split_groups(by_group, self.world)
        shares = [[r for i in share for r in by_group[i]] for share in owners]
        passes = micro_batches(shares, self.config.micro_batch_size, self.config.micro_batch_tokens, self.config.packed)
        results = self._get(
            [a.score.remote(share, passes, self.step) for a, share in zip(self._actors, shares, strict=True)]
        )
        found: dict[int, list[Scored]] = {}
        for share, values in zip(owners, results, strict=True):
            flat = iter(values)
            found |= {i: [next(flat) for _ in by_group[i]] for i in share}
        return scored_by_group(groups, [s for i in range(len(by_group)) for s in found[i]])

    def fingerprint(self, metrics: Mapping[str, float]) -> StepFingerprint:
        """The fingerprint of the step just taken: its loss and gradient norm over every rank. No
        parameter digest: each rank holds a shard, and another rank count shards otherwise, so a
        group's steps are redone within :data:`~spotrl_runtime.core.redo.RELATIVE_TOLERANCE`."""
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        return StepFingerprint(loss, grad_norm, "", f"{self.device}/{self.world}", self.config.layout)

    def weight_sender(self, bucket_bytes: int, timeout: float, transport: str = "gloo") -> GroupSender:
        """The weight channel's sender: rank 0 serves it over ``transport`` and sends, out of the
        ranks' shards."""
        endpoint, plan = self._get([self._actors[0].open_channel.remote(bucket_bytes, timeout, transport)])[0]
        return GroupSender(self, endpoint, plan)

    def policy_state_dict(self) -> dict[str, Any]:
        """The whole policy on this process's CPU (gathered from the shards): what a resume
        keeps of an older version its relaunched groups ask for."""
        states = self._get([a.full_state.remote() for a in self._actors])
        state = states[0]
        assert state is not None
        return state

    # ------------------------------------------------------------------ cuts

    def _adapter_meta(self) -> dict[str, Any]:
        return {"adapter": self.adapter.to_json()} if self.adapter is not None else {}

    def snapshot(self, meta: Mapping[str, Any], *, last: bool = False) -> Any:
        """Captures every rank's shards now (call it between steps, under the cut's lock); the
        returned snapshot's ``write`` has every rank write them, later, into the cut's folder.
        Every rank copies its shards either way; ``last`` (a barrier) marks the copy as one no
        periodic capture may replace before it is written (:class:`CaptureRefusedError`)."""
        from spotrl_runtime.checkpoint.sharded import DCP_FORMAT
        from spotrl_runtime.checkpoint.trainer_state import ShardedTrainerSnapshot

        try:
            tokens = self._get([a.capture.remote(last) for a in self._actors])
        except Exception as err:
            cause = getattr(err, "cause", None)  # a rank's exception arrives wrapped by Ray
            if isinstance(cause, CaptureRefusedError):
                raise CaptureRefusedError(str(cause)) from None
            raise
        actors = list(self._actors)

        def write(storage: Any, folder: str, deadline: Any) -> list[Any]:
            left = None if deadline is None else max(0.0, deadline.remaining())
            parts = self._get(
                [a.save.remote(t, storage.uri, folder, left) for a, t in zip(actors, tokens, strict=True)],
                timeout=None if left is None else left + 5.0,
            )
            return [f for part in parts for f in part]

        return ShardedTrainerSnapshot(
            meta={**dict(meta), **self._adapter_meta(), "trainer_step": self.step, "world_size": self.world},
            write=write,
            format_name=DCP_FORMAT,
        )

    def load_sharded(self, cut: Any) -> None:
        """Loads a ``dcp/v1`` cut into the ranks, whatever number of ranks wrote it."""
        step = int(cut.meta["trainer_step"])
        self._get([a.load.remote(cut.storage_uri, cut.folder, dict(cut.files), step) for a in self._actors])
        self.step = step

    # ------------------------------------------------------------------ Ray

    def _get(self, refs: list[Any], timeout: float | None = None) -> list[Any]:
        """Results of calls on every rank, in order. A rank that died fails the whole call at once
        (the others would wait in a collective for it)."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

        pending = list(refs)
        until = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if until is None else max(0.0, until - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                raise GetTimeoutError(f"the trainer ranks did not answer within {timeout:.0f} s")
            try:
                ray.get(done[0])
            except (RayActorError, ActorDiedError, ActorUnavailableError) as err:
                raise RankLostError(f"a trainer rank was lost: {str(err).splitlines()[0][:300]}") from None
            except Exception:
                # A rank whose peer died fails its collective ("Connection reset by peer")
                # before Ray reports the death: the death is the cause.
                lost = _lost_rank(pending)
                if lost:
                    raise RankLostError(f"a trainer rank was lost: {lost}") from None
                raise
        return list(ray.get(refs))


def _lost_rank(pending: list[Any], grace: float = 5.0) -> str:
    """Why a rank of ``pending`` died, if one did within ``grace`` s; else empty."""
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    deadline = time.monotonic() + grace
    while pending and time.monotonic() < deadline:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in done:
            try:
                ray.get(ref)
            except (RayActorError, ActorDiedError, ActorUnavailableError) as err:
                return str(err).splitlines()[0][:300]
            except Exception:
                continue
    return ""


class GroupSender:
    """The trainer group's end of the weight channel, as the generation pool drives it: rank 0
    serves ``channel`` and sends; every rank gathers its shards for it."""

    def __init__(self, group: TrainerGroup, channel: Any, plan: Mapping[str, Any]) -> None:
        from spotrl_runtime.generation.weights import SyncPlan

        self.group = group
        self.channel = channel
        self.plan = SyncPlan.from_dict(plan)
        self._plan_dict = dict(plan)

    def send(self, epoch: int, world: int, version: int, cancelled: Callable[[], bool] | None = None) -> int:
        """See :meth:`~spotrl_runtime.generation.weights.WeightSender.send`: rank 0's error (a
        member lost, a timeout, a cancel) is raised here as it was raised there."""
        import ray

        from spotrl_runtime.generation.weights import WeightSyncCancelledError, WeightSyncError

        actors = self.group._actors
        refs = [a.send_weights.remote(self._plan_dict, epoch, world, version) for a in actors]
        told = False
        while True:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.05)
            if len(done) == len(refs):
                break
            if cancelled is not None and cancelled() and not told:
                for actor in actors:
                    actor.cancel_sync.remote()
                told = True
        try:
            return int(self.group._get(refs)[0])
        except RankLostError:
            raise
        except Exception as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, WeightSyncCancelledError):
                raise WeightSyncCancelledError(str(cause)) from None
            if isinstance(cause, WeightSyncError):
                raise WeightSyncError(str(cause)) from None
            raise
