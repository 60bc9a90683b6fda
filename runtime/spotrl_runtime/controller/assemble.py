"""The controller's composition root: everything a :class:`~spotrl_runtime.controller.loop.Controller`
drives, built and restored before it exists (:func:`assemble`), so that the controller has
every part from its first line on.

Order matters for start-up time: Ray and the generation workers start first (a process each,
importing torch and loading the policy; with ``options.prestart`` already on a thread, beside
this process's imports: :mod:`~spotrl_runtime.controller.prestart`) while this process opens
the storage, loads the policy for training and restores the cut, then warms the trainer up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spotrl_runtime.api import times
from spotrl_runtime.api.rljob import RLJob
from spotrl_runtime.checkpoint.fence import Fence
from spotrl_runtime.checkpoint.restore import RestoredRun
from spotrl_runtime.checkpoint.resume import SkippedCut, resume_or_start
from spotrl_runtime.checkpoint.writer import CutWriter
from spotrl_runtime.controller.audit_store import AuditStore
from spotrl_runtime.controller.control import CutInfo, StatusSink
from spotrl_runtime.controller.prestart import Prestart, process_started_at
from spotrl_runtime.core.accounting import RestoreRecord
from spotrl_runtime.core.admission import AdmissionFilter, PromptLimit
from spotrl_runtime.core.identity import JobIdentity
from spotrl_runtime.core.owners import Owners, RecoveryConfig
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.data import DatasetError, check_fields, collate_for, describe_dataset, open_dataset
from spotrl_runtime.data.loader import PromptLoader
from spotrl_runtime.failpoints import failpoint
from spotrl_runtime.generation.cluster import (
    RayRuntime,
    controller_ray_gpus,
    generation_pool,
    start_ray,
    trainer_device,
    weight_transport,
)
from spotrl_runtime.generation.pool import GenerationPool, GenerationPoolError
from spotrl_runtime.generation.rollouts import PromptFormatError, prompt_encoder
from spotrl_runtime.generation.transport import TransportError
from spotrl_runtime.models import PolicyError, load_tokenizer, lora
from spotrl_runtime.rewards.isolation import RewardIsolation
from spotrl_runtime.rewards.runner import RewardRunner
from spotrl_runtime.storage import Storage, open_storage
from spotrl_runtime.training import Trainer, TrainerConfig
from spotrl_runtime.training.group import TrainerGroup

if TYPE_CHECKING:
    from spotrl_runtime.controller.loop import Controller

log = logging.getLogger("spotrl.controller")


class ControllerError(RuntimeError):
    """The run cannot go on; the message says why and what to do."""


@dataclass
class ControllerOptions:
    """How this process runs the job (the RLJob says what to train)."""

    storage_uri: str
    resume: str = "auto"
    """``auto``: the newest committed cut if there is one; ``never``: a new run (the storage
    must hold no cut); else the id of the cut to resume from."""
    attempt: int | None = None
    """This controller's incarnation; the operator numbers them. Default: the cut's + 1."""
    max_steps: int | None = None
    """Stop after this many trained steps (at most spec.training.totalSteps)."""
    sigterm_deadline: float = 25.0
    """Seconds a barrier cut on SIGTERM may take (keep it inside the pod's grace period)."""
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    """The private listener: /metrics, /status and POST /barrier (0: any free port; None: off).
    Loopback unless asked otherwise: whoever reaches it can park the run."""
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    """The public listener: GET /metrics and /healthz only (in a pod: on its IP, for Prometheus)."""
    ray_host: str = "127.0.0.1"
    """The address Ray binds to; with remote workers, the one they join at."""
    ray_num_cpus: int | None = None
    remote_workers: bool = False
    """Generation workers on Ray nodes that join this controller's Ray head (worker pods),
    not in this process's Ray; the head listens on ``ray_host``."""
    worker_wait_seconds: float = 900.0
    """With remote workers: how long to wait for the first one to join before giving up."""
    on_ray_head: list[Callable[[str, int, int], object]] = field(default_factory=list)
    """With remote workers or trainer pods: called with the head's address, the number of
    worker nodes and the number of trainer nodes wanted, once Ray runs, before the controller
    waits for them (e.g. to write ``status.rayHead``)."""
    device: str = "cpu"
    prestart: Prestart | None = None
    """Ray and the generation pool, begun before the controller's imports (taken if its
    settings still match these, else stopped and started again)."""
    policy: tuple[Any, Any] | None = None
    """The policy and its tokenizer, loaded already (a standby loads them while it waits);
    used once, in place of loading ``spec.policy`` for training."""
    started_at: float | None = None
    """When this controller's start counts from (a standby: when its attempt came); default:
    when the process started."""
    sinks: list[StatusSink] = field(default_factory=list)
    on_ready: list[Callable[[Controller], object]] = field(default_factory=list)
    """Called once the run is restored and generation is up, before training starts (e.g.
    to start the Kubernetes bridge, which may ask for a barrier at once)."""


@dataclass(frozen=True)
class StartTimes:
    """When this controller reached each point of its start (Unix seconds)."""

    started_at: float
    """The process started."""
    restored_at: float
    """The run was restored from its cut (or started from scratch)."""
    ready_at: float
    """Generation was up with the policy's weights: ready to train."""
    cut_form: str | None = None
    """What the cut it resumed from held (``full``, ``delta``; None: a new run)."""
    steps_redone: int = 0
    """A delta's steps trained again while restoring."""


@dataclass
class Parts:
    """What the controller drives, ready to train."""

    storage: Storage
    audit: AuditStore
    tokenizer: Any
    reward: RewardRunner
    encode: Callable[[Prompt], tuple[int, ...]]
    """A prompt's token ids as ``spec.dataset.promptFormat`` renders them (generation and restore share it)."""
    trainer: Trainer | TrainerGroup
    owners: Owners
    writer: CutWriter
    pool: GenerationPool
    ray: RayRuntime
    resumed_from: CutInfo | None
    """The cut this run resumed from (None: a new run)."""
    fence: Fence
    """This controller's claim on the job: checked before every audit record and cut."""
    skipped: tuple[SkippedCut, ...] = ()
    """Newer cuts ``--resume auto`` passed over as damaged."""
    times: StartTimes | None = None
    """When this controller started, restored and was ready."""
    sender: Any = None
    """The weight channel's sender of the trainer's live weights (:mod:`~spotrl_runtime.generation.weights`)."""
    weights_to_give: tuple[tuple[dict[str, Any] | None, int], ...] = ()
    """Weight versions the workers get before the first step, in order (the first already given
    to the pool): a resumed run's older versions its relaunched groups ask for (their weights),
    then the trainer's own (None: the sender's live weights)."""

    def shutdown(self) -> None:
        """Stops the trainer ranks, the generation workers, the reward's process and the Ray
        this process started."""
        self.reward.close()
        if isinstance(self.trainer, TrainerGroup):
            try:
                self.trainer.shutdown()
            except Exception as err:
                log.warning("trainer group shutdown: %s", err)
        try:
            self.pool.shutdown()
        except Exception as err:
            log.warning("generation pool shutdown: %s", err)
        self.ray.shutdown()


def assemble(job: RLJob, options: ControllerOptions, stop: threading.Event) -> Parts:
    """Starts generation, restores or starts the run, and waits for the workers (``stop``, set
    by a SIGTERM, ends that wait early). Stops what it started if anything fails."""
    spec = job.spec
    try:  # before anything starts: a placement whose workers no transport reaches is refused
        transport = weight_transport(spec, options.device, options.remote_workers)
    except TransportError as err:
        if options.prestart is not None:
            options.prestart.close()
        raise ControllerError(str(err)) from None
    ray, pool = _ray_and_pool(spec, options)
    trainer: Trainer | TrainerGroup | None = None
    reward: RewardRunner | None = None
    try:
        if pool is None:
            pool = generation_pool(spec, options.device, options.remote_workers)
        _announce_head(spec, options, ray)
        # The reward's process loads the reward while the policy loads here (ready() below).
        reward = _reward_runner(spec)
        storage = open_storage(options.storage_uri)
        audit = AuditStore(storage)
        dataset, collate, loader = _prompt_source(spec)
        trainer, tokenizer = _trainer(spec, options, stop)
        try:
            encode = prompt_encoder(tokenizer, spec.dataset)
        except PromptFormatError as err:
            raise ControllerError(str(err)) from None
        reward.ready()
        start = resume_or_start(
            storage,
            job=JobIdentity.of(job.metadata),
            config=RecoveryConfig.from_spec(spec, model_positions=_model_positions(spec)),
            dataset=dataset,
            collate=collate,
            loader=loader,
            trainer=trainer,
            resume=options.resume,
            attempt=options.attempt,
            latest_audited_attempt=audit.latest_attempt,
            dataset_description=describe_dataset(spec.dataset, dataset),
            encode=encode,
            stop=stop.is_set,
        )
        restored_at = time.time()
        # The limit is the config's: this run's, or after a restore the cut's (so a resume filters
        # exactly the prompts its run would have).
        limit = start.owners.config.prompt_limit
        if limit is not None:
            start.owners.set_admission_filter(_length_filter(limit, encode))
        writer = _cut_writer(job, storage, dataset, start)
        gen = spec.generation
        sender = trainer.weight_sender(gen.weight_bucket_mi_b << 20, gen.weight_sync_timeout_seconds, transport)
        versions: list[tuple[dict[str, Any] | None, int]] = [*start.older_weights, (None, trainer.step)]
        pool.give(versions[0][1])  # the rest go after the relaunched groups that ask for it
        if isinstance(trainer, Trainer):
            # While the workers start (their own processes): the first pass's one-time costs.
            log.info("trainer warmed up in %.2f s while the generation workers start", trainer.warm_up())
        _wait_for_workers(job, options, pool, stop)
        start_times = _start_times(options, start.restored, restored_at)
        if start.restored is not None:
            _record_restore(audit, start.restored, start.owners.attempt, start_times)
    except BaseException:
        if reward is not None:
            reward.close()
        if isinstance(trainer, TrainerGroup):
            trainer.shutdown()
        if pool is not None:
            pool.shutdown()
        ray.shutdown()
        raise
    resumed_from = _resumed_from(start.restored, storage) if start.restored is not None else None
    return Parts(
        storage,
        audit,
        tokenizer,
        reward,
        encode,
        trainer,
        start.owners,
        writer,
        pool,
        ray,
        resumed_from,
        start.fence,
        start.skipped,
        start_times,
        sender,
        tuple(versions),
    )


def _ray_and_pool(spec: Any, options: ControllerOptions) -> tuple[Any, GenerationPool | None]:
    """The Ray head, and the generation pool where a prestart already made both for this
    placement (else None: made once the head is up)."""
    prestart = options.prestart
    if prestart is not None and prestart.matches(options.ray_host, options.remote_workers, options.ray_num_cpus):
        return prestart.take()
    if prestart is not None:
        prestart.close()
    ray = start_ray(
        options.ray_host,
        options.remote_workers,
        options.ray_num_cpus,
        remote_nodes=spec.training.parallelism.trainer_pods,
        num_gpus=controller_ray_gpus(spec, options.device),
    )
    return ray, None


def _announce_head(spec: Any, options: ControllerOptions, ray: Any) -> None:
    """Tells the hooks where the Ray head is, when worker or trainer pods are to join it."""
    par = spec.training.parallelism
    if not (options.remote_workers or par.trainer_pods):
        return
    workers = spec.generation.workers if options.remote_workers else 0
    trainers = par.ranks if par.trainer_pods else 0
    log.info(
        "Ray head at %s: waiting for %d generation worker node(s) and %d trainer node(s) to join",
        ray.address,
        workers,
        trainers,
    )
    for hook in options.on_ray_head:
        hook(ray.address, workers, trainers)


def _reward_runner(spec: Any) -> RewardRunner:
    return RewardRunner(
        spec.reward,
        timeout=spec.reward.timeout_seconds,
        batched=spec.reward.batched,
        isolation=RewardIsolation.of(os.environ, (e.name for e in spec.runtime_env)),
        workers=spec.reward.workers,
    )


def _prompt_source(spec: Any) -> tuple[Any, Any, PromptLoader]:
    """The dataset (its fields checked), its collate, and the loader over it."""
    dataset, collate = open_dataset(spec.dataset), collate_for(spec.dataset)
    try:
        check_fields(dataset, spec.dataset, answers=spec.reward.name != "format_only")
    except DatasetError as err:
        raise ControllerError(f"spec.dataset.uri {spec.dataset.uri!r}: {err}") from None
    loader = PromptLoader(
        dataset,
        collate,
        batch_size=spec.generation.prompts_per_step,
        shuffle=spec.dataset.shuffle,
        seed=spec.dataset.seed,
    )
    return dataset, collate, loader


def _trainer(spec: Any, options: ControllerOptions, stop: threading.Event) -> tuple[Trainer | TrainerGroup, Any]:
    """The trainer (in this process, or FSDP ranks of their own) and the policy's tokenizer."""
    if spec.training.parallelism.strategy == "fsdp":
        # The ranks load and shard the policy; this process needs its tokenizer only.
        tokenizer = load_tokenizer(spec.policy.model)
        group = TrainerGroup.from_rljob(spec, options.device, pad_token_id=tokenizer.pad_token_id or 0)
        group.start(timeout=options.worker_wait_seconds, stop=stop)
        return group, tokenizer
    device = trainer_device(spec, options.device)
    try:
        model, tokenizer, adapter = lora.load_trainable(
            spec.policy, device, seed=spec.training.seed, loaded=options.policy
        )
    except PolicyError as err:
        raise ControllerError(str(err)) from None
    options.policy = None
    config = TrainerConfig.from_rljob(spec)
    return Trainer(model, config, pad_token_id=tokenizer.pad_token_id or 0, adapter=adapter), tokenizer


def _cut_writer(job: RLJob, storage: Storage, dataset: Any, start: Any) -> CutWriter:
    writer = CutWriter(
        storage,
        job=job.name,
        dataset=describe_dataset(job.spec.dataset, dataset),
        keep=job.spec.checkpoint.keep,
        progress=lambda phase, step: failpoint(f"cut.{phase}", step),
        fence=start.fence,
    )
    if start.restored is not None:
        writer.base = start.restored.base  # the full cut the next delta cuts extend
    return writer


def _start_times(options: ControllerOptions, restored: RestoredRun | None, restored_at: float) -> StartTimes:
    return StartTimes(
        options.started_at or process_started_at(),
        restored_at,
        time.time(),
        restored.manifest.form if restored is not None else None,
        len(restored.redo) if restored is not None else 0,
    )


def _model_positions(spec: Any) -> int | None:
    """The policy's own context, the prompt limit where ``generation.maxModelLen`` is unset."""
    from spotrl_runtime.models.loading import max_positions

    return None if spec.generation.max_model_len is not None else max_positions(spec.policy.model)


def _length_filter(limit: PromptLimit, encode: Callable[[Prompt], tuple[int, ...]]) -> AdmissionFilter:
    """The admission filter of ``limit`` over the encoder generation uses; says each prompt it
    filters in the log."""
    log.info(
        "prompts longer than %d tokens (%s %d - maxNewTokens %d) are filtered at admission",
        limit.max_model_len - limit.max_new_tokens,
        limit.source,
        limit.max_model_len,
        limit.max_new_tokens,
    )

    def refusal(prompt: Prompt) -> str | None:
        why = limit.refusal(len(encode(prompt)))
        if why is not None:
            log.warning("filtered the prompt of row idx %d (%s): %s", prompt.idx, prompt.task_name, why)
        return why

    return refusal


def _record_restore(audit: AuditStore, restored: RestoredRun, attempt: int, at: StartTimes) -> None:
    """What this attempt found in its cut (the restore's counters), for the run's accounting
    (``status.accounting``, ``spotrl audit --summary``). A failed write costs the numbers, not
    the run."""
    counters = restored.owners.counters
    record = RestoreRecord(
        attempt=attempt,
        cut_id=restored.cut_id,
        cut_step=restored.owners.trainer_step,
        cut_committed_at=times.unix(restored.manifest.created_at),
        groups_redispatched=counters.groups_found,
        siblings_reused=counters.rollouts_reused,
        turns_restored=counters.turns_found,
        finished_found=counters.finished_found,
        started_at=round(at.started_at, 3),
        restored_at=round(at.restored_at, 3),
        ready_at=round(at.ready_at, 3),
        cut_form=restored.manifest.form,
        steps_redone=len(restored.redo),
    )
    try:
        audit.write_restore(record)
    except Exception as err:
        log.warning("restore record of attempt %d not written: %s", attempt, err)


def _resumed_from(restored: RestoredRun, storage: Storage) -> CutInfo:
    return CutInfo(
        cut_id=restored.cut_id,
        step=restored.owners.trainer_step,
        uri=f"{storage.uri.rstrip('/')}/cuts/{restored.cut_id}",
        kind="barrier" if restored.manifest.kind == "barrier" else "periodic",
        committed_at=times.unix(restored.manifest.created_at) or 0.0,
        seconds=0.0,
    )


def _wait_for_workers(job: RLJob, options: ControllerOptions, pool: GenerationPool, stop: threading.Event) -> None:
    if not options.remote_workers:
        pool.wait_ready()
        return
    try:
        # A SIGTERM while waiting ends the wait (the controller then stops without training).
        pool.wait_ready(timeout=options.worker_wait_seconds, min_ready=1, stop=stop)
    except GenerationPoolError as err:
        raise ControllerError(
            f"no generation worker joined: {err}. With spec.generation.workerPods the operator starts "
            f"one pod per worker ({job.name}-worker-<attempt>-<i>); see why they do not run "
            "(kubectl describe pod), e.g. generation.resources that no node offers"
        ) from None
