"""The controller: one process per job, read top to bottom.

It ties the recovery core (:class:`~spotrl_runtime.core.owners.Owners`) to generation
workers (Ray actors) and the GRPO trainer, with three threads:

- the **trainer** (the caller's thread, :meth:`Controller.run`): waits until every group of
  the next step is in the replay buffer, trains on them, commits the step (the groups
  become "trained" and the step is audited), sends the new weights to the workers, and
  asks for a periodic cut every N steps or T seconds;
- the **dispatcher**: moves prompts from the loader through the lookahead gate to the
  workers (``owners.pump``), and each result back ("group finished" is one move into the
  replay buffer); retries failed groups, drops them after ``maxRetries`` (the
  ``onDroppedPrompt`` policy), and redispatches groups whose worker died;
- the **cut writer**: takes periodic cuts and barrier cuts, one at a time, through the one
  :class:`~spotrl_runtime.checkpoint.writer.CutWriter`. Only the in-memory capture holds
  the ownership lock; generation keeps running while the files are written.

Generation workers run as Ray actors in this process's Ray instance, or, with
``remote_workers`` (``spec.generation.workerPods`` on Kubernetes), on Ray nodes that join it
(``spotrl worker --address``, one per worker pod): Ray starts as a head that other nodes can
reach on this pod's address, the controller announces the head's address (``on_ray_head``:
the RLJob's ``status.rayHead``), and each worker actor asks for the custom resource
:data:`WORKER_RESOURCE` that only those nodes offer. Training starts once one worker is up;
the others join when they come. A lost worker (its pod went away) only sends its groups back
for redispatch; the operator replaces the pod and the pool the actor.

A barrier (:meth:`Controller.request_barrier`, from SIGTERM, the HTTP endpoint or the
Kubernetes bridge) parks the controller: nothing more is admitted or trained, the cut is
taken, and the process waits to be stopped. Exit codes: 0 every step trained, 143 stopped
by SIGTERM (after its barrier cut), 1 an error (the message names it).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from spotrl_runtime.api.rljob import RLJob
from spotrl_runtime.controller.audit_store import AuditStore
from spotrl_runtime.controller.control import BarrierFailed, CutInfo, StatusSink
from spotrl_runtime.core.owners import (
    Dispatch,
    Owners,
    OwnershipError,
    OwnersSnapshot,
    RecoveryConfig,
    UnknownGroupError,
)
from spotrl_runtime.core.types import Rollout
from spotrl_runtime.failpoints import failpoint
from spotrl_runtime.generation.pool import GenerationPoolError

log = logging.getLogger("spotrl.controller")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_TERMINATED = 143

WORKER_RESOURCE = "spotrl.dev/worker"
"""The Ray resource a worker node offers (one unit) and each worker actor asks for."""


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
    """Serve /metrics, /status and POST /barrier here (0: any free port; None: off)."""
    ray_num_cpus: int | None = None
    remote_workers: bool = False
    """Generation workers on Ray nodes that join this controller's Ray head (worker pods),
    not in this process's Ray; the head listens on ``http_host``."""
    worker_wait_seconds: float = 900.0
    """With remote workers: how long to wait for the first one to join before giving up."""
    on_ray_head: list[Callable[[str, int], object]] = field(default_factory=list)
    """With remote workers: called with the head's address and the number of workers once
    Ray runs, before the controller waits for them (e.g. to write ``status.rayHead``)."""
    device: str = "cpu"
    sinks: list[StatusSink] = field(default_factory=list)
    on_ready: list[Callable[[Controller], object]] = field(default_factory=list)
    """Called once the run is restored and generation is up, before training starts (e.g.
    to start the Kubernetes bridge, which may ask for a barrier at once)."""


@dataclass
class _CutJob:
    kind: str
    reason: str
    deadline: float | None = None
    """Unix time (barrier cuts only)."""
    snapshot: OwnersSnapshot | None = None
    """Periodic cuts: captured on the trainer thread at the step boundary."""
    done: Future[CutInfo] = field(default_factory=Future)


class Controller:
    """Runs one job to completion, or until it is stopped; see the module docstring."""

    def __init__(self, job: RLJob, options: ControllerOptions):
        self.job = job
        self.spec = job.spec
        self.options = options
        self.target_steps = min(self.spec.training.total_steps, options.max_steps or self.spec.training.total_steps)
        self._parked = threading.Event()
        """Set by a barrier: no more admissions and no more optimizer steps."""
        self._stop = threading.Event()
        self._training = threading.Event()
        """Set when the dispatcher and cut writer start: from then on a SIGTERM cuts."""
        self._failure: BaseException | None = None
        self._terminated = False
        self._barrier_lock = threading.Lock()
        self._barrier_cut: CutInfo | None = None
        self._cuts: queue.Queue[_CutJob | None] = queue.Queue()
        self._weights: queue.Queue[tuple[dict[str, Any], int]] = queue.Queue()
        self._last_cut_time = time.monotonic()
        self._ray_dir: str | None = None
        self._signals_installed = False
        self.resumed_from: CutInfo | None = None
        self.stats: dict[str, float] = {
            "groups_generated": 0,
            "groups_retried": 0,
            "groups_lost_redispatched": 0,
            "prompts_dropped": 0,
            "tokens_generated": 0,
        }
        self.history: list[dict[str, Any]] = []
        """One entry per step this process trained: step, reward, seconds ..."""
        self.cuts: list[CutInfo] = []

    # ================================================================== setup

    def _setup(self) -> None:
        from spotrl_runtime.checkpoint.layout import newest_committed
        from spotrl_runtime.checkpoint.restore import restore_cut
        from spotrl_runtime.checkpoint.writer import CutWriter
        from spotrl_runtime.core.validation import Expectations
        from spotrl_runtime.data import collate_for, describe_dataset, open_dataset
        from spotrl_runtime.data.loader import PromptLoader
        from spotrl_runtime.models import load_policy
        from spotrl_runtime.rewards import load_reward
        from spotrl_runtime.storage import open_storage
        from spotrl_runtime.training import Trainer, TrainerConfig

        spec, opts = self.spec, self.options
        # Workers start (a process each, importing torch and loading the policy) while this
        # process loads the trainer and restores the cut.
        self._start_generation()
        self.storage = open_storage(opts.storage_uri)
        self.audit = AuditStore(self.storage)
        dataset = open_dataset(spec.dataset)
        collate = collate_for(spec.dataset)
        loader = PromptLoader(
            dataset,
            collate,
            batch_size=spec.generation.prompts_per_step,
            shuffle=spec.dataset.shuffle,
            seed=spec.dataset.seed,
        )
        config = RecoveryConfig.from_spec(spec)
        model, self.tokenizer = load_policy(spec.policy, opts.device)
        self.trainer = Trainer(model, TrainerConfig.from_rljob(spec), pad_token_id=self.tokenizer.pad_token_id or 0)
        self.reward = load_reward(spec.reward)

        newest = newest_committed(self.storage)
        if opts.resume == "never" and newest is not None:
            raise ControllerError(
                f"{self.storage.uri} already holds cuts of a run (newest: {newest}); "
                "resume it with --resume auto, or give a fresh --storage"
            )
        cut_id = None if opts.resume in ("auto", "never") else opts.resume
        attempt = opts.attempt
        if attempt is None and newest is not None:
            # Locally nobody numbers the incarnations: one past every attempt that left a
            # trace (an incarnation killed before its first cut still audited its steps).
            import json

            from spotrl_runtime.checkpoint.layout import manifest_key

            cut_attempt = json.loads(self.storage.get_bytes(manifest_key(newest))).get("attempt")
            seen = [a for a in (self.audit.latest_attempt(), cut_attempt) if isinstance(a, int)]
            attempt = max(seen) + 1 if seen else None
        if cut_id is not None or (opts.resume == "auto" and newest is not None):
            restored = restore_cut(
                self.storage,
                dataset=dataset,
                collate=collate,
                source=loader,
                cut_id=cut_id,
                expect=Expectations(job=self.job.name, config=config),
                attempt=attempt,
            )
            self.owners = restored.owners
            if restored.trainer is not None:
                _load_trainer(self.trainer, restored.trainer)
            m = restored.manifest
            self.resumed_from = CutInfo(
                cut_id=restored.cut_id,
                step=self.owners.trainer_step,
                uri=f"{self.storage.uri.rstrip('/')}/cuts/{restored.cut_id}",
                kind="barrier" if m.kind == "barrier" else "periodic",
                committed_at=_unix_time(m.created_at),
                seconds=0.0,
            )
            if self.trainer.step != self.owners.trainer_step:
                raise ControllerError(
                    f"cut {restored.cut_id}: the trainer state is at step {self.trainer.step} but the owners at "
                    f"{self.owners.trainer_step}; the cut is inconsistent, resume from an older one with --resume CUT"
                )
        else:
            self.owners = Owners(config, loader, attempt=opts.attempt or 0)
        self.writer = CutWriter(
            self.storage,
            job=self.job.name,
            dataset=describe_dataset(spec.dataset, dataset),
            keep=spec.checkpoint.keep,
            progress=lambda phase: failpoint(f"cut.{phase}"),
        )
        self.pool.update_weights(self.trainer.policy_state_dict(), self.trainer.step)
        if opts.remote_workers:
            try:
                # A SIGTERM while waiting ends the wait (run() then stops without training).
                self.pool.wait_ready(timeout=opts.worker_wait_seconds, min_ready=1, stop=self._stop)
            except GenerationPoolError as err:
                raise ControllerError(
                    f"no generation worker joined: {err}. With spec.generation.workerPods the operator starts "
                    f"one pod per worker ({self.job.name}-worker-<attempt>-<i>); see why they do not run "
                    "(kubectl describe pod), e.g. generation.resources that no node offers"
                ) from None
        else:
            self.pool.wait_ready()

    def _start_generation(self) -> None:
        import ray

        from spotrl_runtime.generation import BackendSpec
        from spotrl_runtime.generation.pool import GenerationPool

        opts = self.options
        remote = opts.remote_workers
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if not ray.is_initialized():
            # A short private folder: Ray's unix sockets must fit in 107 bytes.
            self._ray_dir = tempfile.mkdtemp(prefix="ray-", dir=os.environ.get("SPOTRL_RAY_TMP", "/tmp"))
            host = opts.http_host if opts.http_host not in ("0.0.0.0", "") else None
            if remote and host is None:
                raise ControllerError(
                    "remote generation workers need an address the workers can reach: set SPOTRL_POD_IP "
                    "(the operator sets it from status.podIP)"
                )
            ray.init(
                # The head runs no generation actor when the workers are remote.
                num_cpus=0 if remote else opts.ray_num_cpus or max(1, os.cpu_count() or 1),
                include_dashboard=False,
                _temp_dir=self._ray_dir,
                _node_ip_address=host,
                log_to_driver=False,
                configure_logging=False,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
            )
            if self._signals_installed:
                self.install_signal_handlers()  # ray.init installs its own SIGTERM handler
        workers = self.spec.generation.workers
        actor_options: dict[str, Any] = {}
        max_restarts: int | None = 3
        if remote:
            # Only worker nodes offer the resource, so no actor lands on the controller. A worker
            # node's GPU (vLLM, or transformers when generation.resources asks for one) is its own.
            gen = self.spec.generation
            device = "cuda" if gen.backend == "vllm" or gen.resources.gpu > 0 else "cpu"
            backend = BackendSpec.from_rljob(self.spec, device=device)
            actor_options = {"resources": {WORKER_RESOURCE: 1}}
            if backend.kind == "transformers" and device == "cuda":
                actor_options["num_gpus"] = gen.resources.gpu
            max_restarts = None  # pods come and go; the operator replaces them, the pool their actors
        else:
            backend = BackendSpec.from_rljob(self.spec, device=opts.device)
            if backend.kind == "transformers" and opts.device.startswith("cuda"):
                # Ray hides GPUs from actors that ask for none; the trainer keeps half of the GPU.
                actor_options = {"num_gpus": round(0.5 / workers, 4)}
        self.pool = GenerationPool(backend, workers, actor_options=actor_options, max_restarts=max_restarts)
        if remote:
            address = ray.get_runtime_context().gcs_address
            log.info("Ray head at %s: waiting for %d generation worker node(s) to join", address, workers)
            for hook in opts.on_ray_head:
                hook(address, workers)

    # ================================================================== run

    def run(self) -> int:
        """Trains until every step is done or the process is stopped. Returns the exit code."""
        try:
            self._setup()
        except Exception as err:
            log.error("cannot start: %s", err)
            self._shutdown()
            raise
        for sink in self.options.sinks:
            sink.on_started(self.resumed_from)
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
            if finished:
                self._periodic_cut("final").done.result()  # the trained policy, safe in storage
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
            self._cuts.put(None)
            for t in threads:
                t.join(timeout=30)
            self._shutdown()

    def _train_loop(self) -> bool:
        """The trainer thread. True when every step is trained."""
        owners, trainer = self.owners, self.trainer
        every_steps = self.spec.checkpoint.every_steps
        every_seconds = self.spec.checkpoint.every_seconds
        while owners.trainer_step < self.target_steps:
            self._raise_failure()
            if self._parked.is_set() or self._stop.is_set():
                return False
            if every_seconds and time.monotonic() - self._last_cut_time >= every_seconds:
                self._periodic_cut(f"every {every_seconds} s")
            if not owners.wait_step_ready(timeout=0.2):
                continue
            if self._parked.is_set():
                return False
            t0 = time.monotonic()
            groups = owners.begin_step()
            try:
                failpoint("train.step", owners.trainer_step)
                metrics = trainer.train_step(groups)
            except Exception:
                owners.abort_step()
                raise
            record = owners.commit_step(weight_version=trainer.step)
            self._weights.put((trainer.policy_state_dict(), trainer.step))
            seconds = time.monotonic() - t0
            rewards = [r.reward for g in groups for r in g.rollouts]
            reward = sum(rewards) / len(rewards) if rewards else 0.0
            entry = {
                "step": record.step,
                "attempt": record.attempt,
                "reward": reward,
                "seconds": seconds,
                "loss": metrics.get("loss", 0.0),
                "kl": metrics.get("kl", 0.0),
                "tokens": metrics.get("tokens", 0.0),
            }
            self.audit.write(record, reward=reward, seconds=round(seconds, 4))
            self.history.append(entry)
            for sink in self.options.sinks:
                sink.on_step(owners.trainer_step, entry)
            if every_steps and owners.trainer_step % every_steps == 0 and owners.trainer_step < self.target_steps:
                self._periodic_cut(f"every {every_steps} steps")
        return True

    # ================================================================== generation

    def _dispatch_loop(self) -> None:
        """The dispatcher thread: loader → gate → workers → replay buffer."""
        from spotrl_runtime.generation import GroupFailed, GroupGenerated, GroupLost
        from spotrl_runtime.generation.rollouts import encode_prompt, make_request

        owners, pool, gen = self.owners, self.pool, self.spec.generation
        inflight: dict[str, Dispatch] = {}
        tries: dict[str, int] = {}
        version = self.trainer.step

        def send(dispatches: Sequence[Dispatch]) -> None:
            reqs = []
            for d in dispatches:
                inflight[d.group_id] = d
                ids = encode_prompt(self.tokenizer, d.prompt)
                req = make_request(
                    d.group_id, ids, gen, run_seed=self.spec.training.seed, attempt=tries.get(d.group_id, 0)
                )
                reqs.append(replace(req, n=d.generations))
            if reqs:
                pool.submit(reqs)

        while not self._stop.is_set():
            latest = None
            while not self._weights.empty():
                latest = self._weights.get_nowait()
            if latest is not None:
                version = latest[1]
                pool.update_weights(latest[0], version, wait=False)
            if not self._parked.is_set():
                send(owners.pump(weight_version=version))
            for outcome in pool.poll(timeout=0.05):
                d = inflight.pop(outcome.group_id, None)
                if d is None or self._parked.is_set():
                    continue  # after a barrier nothing moves; the cut holds this group as ADMITTED
                if isinstance(outcome, GroupGenerated):
                    self._finish(d, outcome)
                elif isinstance(outcome, GroupLost):
                    self.stats["groups_lost_redispatched"] += 1
                    log.warning("group %s lost with its worker (%s); redispatching", d.group_id, outcome.reason)
                    send([d])
                elif isinstance(outcome, GroupFailed):
                    tries[d.group_id] = tries.get(d.group_id, 0) + 1
                    if tries[d.group_id] <= gen.max_retries:
                        self.stats["groups_retried"] += 1
                        send([d])
                    else:
                        self.stats["prompts_dropped"] += 1
                        log.warning(
                            "dropping group %s after %d tries: %s", d.group_id, tries[d.group_id], outcome.error
                        )
                        send(owners.drop_group(d.group_id, f"generation failed: {outcome.error}"))

    def _finish(self, d: Dispatch, generated: Any) -> None:
        from spotrl_runtime.generation.rollouts import score_group

        failpoint("dispatch.finish", d.target_step)
        scored = score_group(generated, d.prompt, self.reward, d.target_step)
        rollouts = [
            Rollout(**{**r.__dict__, "index": d.rollout_indexes[i]})
            for i, r in enumerate(scored.rollouts[: len(d.rollout_indexes)])
        ]
        try:
            self.owners.finish_group(d.group_id, rollouts, partial_ok=True)
        except UnknownGroupError:
            return  # a late duplicate (e.g. the group was dropped meanwhile)
        self.stats["groups_generated"] += 1
        self.stats["tokens_generated"] += sum(len(r.completion_token_ids) for r in rollouts)

    # ================================================================== cuts

    def _trainer_state(self) -> Any:
        """The cut's state function: runs under the ownership lock, between optimizer steps."""
        from spotrl_runtime.checkpoint.trainer_state import snapshot_trainer

        trainer = self.trainer
        return snapshot_trainer(
            trainer.model.state_dict(),
            trainer.optimizer.state_dict(),
            meta={"trainer_step": trainer.step, "model": self.spec.policy.model},
        )

    def _periodic_cut(self, reason: str) -> _CutJob:
        """Captures now, on the trainer thread, so the cut lands exactly on this step boundary;
        the cut-writer thread writes the files while training goes on."""
        job = _CutJob("periodic", reason, snapshot=self.owners.capture(self._trainer_state))
        self._last_cut_time = time.monotonic()
        self._cuts.put(job)
        return job

    def _cut_loop(self) -> None:
        """The cut-writer thread. A barrier supersedes periodic snapshots still waiting (it is
        captured later, so it holds everything they hold), and of several waiting periodic
        snapshots only the newest is written: cut ids must grow with the state they hold."""
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
            barriers = [j for j in pending if j.kind == "barrier"]
            chosen = barriers[0] if barriers else pending[-1]
            last_word = next((c for c in reversed(self.cuts) if c.kind == "barrier"), None)
            if last_word is not None and chosen.kind != "barrier":
                # A committed barrier is this controller's last word: a periodic snapshot
                # captured before it must not become a newer (but older) cut.
                for j in pending:
                    j.done.set_result(last_word)
                continue
            info = self._write_cut(chosen)
            for j in pending:
                if j is chosen:
                    continue
                if info is not None:
                    j.done.set_result(info)
                else:
                    j.done.set_exception(RuntimeError(f"superseded by a {chosen.kind} cut that failed"))

    def _write_cut(self, job: _CutJob) -> CutInfo | None:
        from spotrl_runtime.checkpoint.writer import CutRequest

        t0 = time.monotonic()
        try:
            if job.kind == "barrier":
                assert job.deadline is not None
                request = CutRequest.barrier(job.deadline - time.time(), job.reason)
                committed = self.writer.write(self.owners, request, self._trainer_state)
            else:
                assert job.snapshot is not None
                committed = self.writer.write_snapshot(job.snapshot, CutRequest.periodic(job.reason))
        except Exception as err:
            log.error("%s cut (%s) failed: %s", job.kind, job.reason, err)
            job.done.set_exception(err)
            return None
        info = CutInfo(
            cut_id=committed.cut_id,
            step=committed.manifest.trainer_step,
            uri=committed.uri,
            kind="barrier" if job.kind == "barrier" else "periodic",
            committed_at=time.time(),
            seconds=time.monotonic() - t0 + (job.snapshot.capture_seconds if job.snapshot else 0.0),
        )
        self.cuts.append(info)
        for sink in self.options.sinks:
            sink.on_cut(info)
        job.done.set_result(info)
        return info

    # ================================================================== barrier

    def request_barrier(self, reason: str, deadline: float) -> CutInfo:
        """See :class:`~spotrl_runtime.controller.control.Controllable`. Idempotent."""
        with self._barrier_lock:
            if self._barrier_cut is not None:
                return self._barrier_cut
            self._parked.set()
            remaining = deadline - time.time()
            if remaining <= 0:
                raise BarrierFailed(f"barrier ({reason}) arrived after its deadline")
            job = _CutJob("barrier", reason, deadline)
            self._cuts.put(job)
            try:
                info = job.done.result(timeout=remaining + 5)
            except Exception as err:
                raise BarrierFailed(f"barrier cut ({reason}) did not commit: {err}") from err
            self._barrier_cut = info
            log.info("barrier cut %s committed at step %d in %.2f s (%s)", info.cut_id, info.step, info.seconds, reason)
            return info

    def on_sigterm(self) -> None:
        """SIGTERM: take a barrier cut within the deadline (unless one exists), then stop."""
        if self._terminated:
            return
        self._terminated = True

        def cut_then_stop() -> None:
            try:
                if not self._training.is_set():
                    # Still starting (restoring, waiting for workers): nothing happened since
                    # the cut it restores from, and no cut writer runs yet.
                    return
                if not (self.owners.trainer_step >= self.target_steps and not self._parked.is_set()):
                    self.request_barrier("SIGTERM", time.time() + self.options.sigterm_deadline)
            except Exception as err:
                self._failure = err
            finally:
                self._stop.set()

        threading.Thread(target=cut_then_stop, name="sigterm", daemon=True).start()

    def install_signal_handlers(self) -> None:
        """SIGTERM takes a barrier cut. Call from the main thread; Ray's own handler is
        replaced again once Ray has started."""
        self._signals_installed = True
        signal.signal(signal.SIGTERM, lambda *_: self.on_sigterm())

    # ================================================================== status

    def status(self) -> dict[str, Any]:
        """What /status shows: where the run is and who owns what."""
        owners = self.owners
        return {
            "job": self.job.name,
            "attempt": owners.attempt,
            "step": owners.trainer_step,
            "target_steps": self.target_steps,
            "dispatch_index": owners.dispatch_index,
            "parked": self._parked.is_set(),
            "in_flight": len(owners.in_flight()),
            "last_cut": self.cuts[-1].__dict__ if self.cuts else None,
            "resumed_from": self.resumed_from.__dict__ if self.resumed_from else None,
            "counters": owners.counters.__dict__,
            "stats": dict(self.stats),
        }

    # ================================================================== plumbing

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        """A background thread's failure stops the run with that error."""

        def run() -> None:
            try:
                fn()
            except BaseException as err:
                if not self._stop.is_set():
                    log.error("%s failed: %s", threading.current_thread().name, err)
                    self._failure = err
                    self._stop.set()
                    self._parked.set()

        return run

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _shutdown(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            try:
                pool.shutdown()
            except Exception as err:
                log.warning("generation pool shutdown: %s", err)
        if self._ray_dir is not None:
            import ray

            ray.shutdown()
            shutil.rmtree(self._ray_dir, ignore_errors=True)
            self._ray_dir = None


def _unix_time(rfc3339: str) -> float:
    from datetime import datetime

    try:
        return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _load_trainer(trainer: Any, snap: Any) -> None:
    """Puts a cut's trainer snapshot (weights, optimizer, RNG, step) back into the trainer."""
    from spotrl_runtime.checkpoint.trainer_state import restore_rng

    trainer.model.load_state_dict(snap.weights, strict=True)
    if snap.optimizer is not None:
        trainer.optimizer.load_state_dict(snap.optimizer)
    if snap.rng is not None:
        restore_rng(snap.rng)
    trainer.step = int(snap.meta["trainer_step"])


__all__ = ["Controller", "ControllerError", "ControllerOptions", "OwnershipError"]
