"""The controller's link to its RLJob when it runs in a pod: barrier requests in, status out.

The controller's half of the barrier protocol (told once, in
docs/concepts/barriers-and-notices.md): the bridge watches its own RLJob (a field selector on its name: the
runtime's Role allows nothing else), calls :meth:`Controllable.request_barrier` on a thread
for each ``Requested`` barrier it has not answered, and answers with one JSON patch that
first **tests** ``requestId`` and ``state == Requested``, so a stale answer never lands.

As a :class:`StatusSink` it reports ``step``/``stepAttempt`` and ``lastCut``; every one of
those patches first tests ``status.attempt`` against this controller's attempt, so a
controller that is being replaced can never write over its successor.

With ``spec.generation.workerPods`` or ``spec.training.parallelism.trainerPods`` it also
announces the controller's Ray head (:meth:`KubeBridge.publish_ray_head`: ``status.rayHead``
with the address, the attempt and the number of worker and trainer pods), under the same
test of ``status.attempt``; the operator then starts the pods that join it.

It ignores a request made for another attempt (``barrier.attempt``, or ``status.attempt``
when the request carries none): the operator clears ``status.barrier`` when it starts a
new controller, and a terminating predecessor still watching must not cut for it.

Threads, not asyncio: the training loop is synchronous, and so is the Kubernetes client.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from spotrl_runtime.api import rljob as api
from spotrl_runtime.api import times
from spotrl_runtime.api.lenient import ignoring_unknown
from spotrl_runtime.api.times import Deadline
from spotrl_runtime.controller.control import BarrierFailed, Controllable, CutInfo
from spotrl_runtime.core.cut_estimate import CutEstimate
from spotrl_runtime.core.step_stats import NO_SIGNAL_STEPS
from spotrl_runtime.kube import JSON_PATCH, Kube, KubeError, path

if TYPE_CHECKING:
    from spotrl_runtime.checkpoint.resume import SkippedCut
    from spotrl_runtime.controller.assemble import StartTimes
    from spotrl_runtime.controller.audit_store import AuditStore
    from spotrl_runtime.core.accounting import RestoreRecord

log = logging.getLogger("spotrl.kube_bridge")
Obj = dict[str, Any]

WATCH_SECONDS = 30
REACH_SECONDS = 60.0
"""How long a controller starting up keeps trying to reach the API server before it gives up."""
ANSWER_RETRY_SECONDS = 30.0
MIN_WRITE_INTERVAL = 0.2


class StaleError(Exception):
    """A JSON patch's test failed: the status moved on (a newer request or attempt)."""


class _Api:
    """The few requests the bridge makes: its own RLJob, read, watched and status-patched."""

    def __init__(self, kube: Kube, namespace: str, name: str):
        self.kube = kube
        self.collection = path(api.API_VERSION, api.PLURAL, namespace)
        self.url = path(api.API_VERSION, api.PLURAL, namespace, name)
        self.selector = f"metadata.name={name}"

    def get_job(self) -> Obj:
        return self.kube.get(self.url)

    def list_job(self) -> Obj:
        return self.kube.get(self.collection, fieldSelector=self.selector)

    def watch(self, resource_version: str) -> Any:
        return self.kube.stream(
            self.collection,
            (10, WATCH_SECONDS + 15),
            fieldSelector=self.selector,
            watch="true",
            resourceVersion=resource_version,
            allowWatchBookmarks="true",
            timeoutSeconds=str(WATCH_SECONDS),
        )

    def json_patch(self, ops: list[Obj]) -> None:
        try:
            self.kube.patch(f"{self.url}/status", ops, content_type=JSON_PATCH)
        except KubeError as err:
            # A failed "test" op is a 422 with a generic message. Our patches are otherwise
            # well-formed, and a 422 would not pass on a retry anyway.
            if err.status == 422:
                raise StaleError(err.message) from None
            raise


class KubeBridge:
    """Barrier requests from the RLJob's status to the controller, and the controller's
    progress back into it. Use :meth:`from_env` in a pod, then :meth:`start`."""

    def __init__(self, job: str, namespace: str, attempt: int, api_client: Any = None):
        """``api_client``: the official client's ApiClient (default: kubeconfig, else in-cluster)."""
        self.job = job
        self.namespace = namespace
        self.attempt = attempt
        self._api = _Api(Kube(api_client) if api_client is not None else Kube.connect(), namespace, job)
        self._controllable: Controllable | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._answered: set[str] = set()
        self._lock = threading.Condition()
        self._want: Obj = {}
        self._wanted_version = 0
        self._written_version = 0
        self._best_cut: tuple[int, str] | None = None
        self._times: api.AttemptTimes | None = None
        self._audit_docs: dict[tuple[int, int], Obj] = {}
        self._audit_read = False
        self._restores: list[RestoreRecord] = []

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> KubeBridge | None:
        """The bridge for this pod (``SPOTRL_JOB``, ``SPOTRL_NAMESPACE``, ``SPOTRL_ATTEMPT``, as
        the operator sets them), or None outside a cluster."""
        env = os.environ if environ is None else environ
        job, attempt = env.get("SPOTRL_JOB"), env.get("SPOTRL_ATTEMPT")
        if not job or not attempt:
            return None
        return cls(job, env.get("SPOTRL_NAMESPACE") or "default", int(attempt))

    def read_job(self, wait: float = REACH_SECONDS) -> Obj:
        """The RLJob this controller runs, as the API server has it. An API server it cannot
        reach yet (a node given back routes to it seconds after it says Ready; an API server
        restarting) is tried again for up to ``wait`` seconds; a refusal (403, 404) is not."""
        deadline, backoff = time.monotonic() + wait, 0.5
        while True:
            try:
                return self._api.get_job()
            except KubeError as err:
                passing = err.status == 0 or err.status == 429 or err.status >= 500
                if not passing or time.monotonic() + backoff > deadline:
                    raise
                log.warning("reading RLJob %s/%s: %s; again in %.1f s", self.namespace, self.job, err, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    # ------------------------------------------------------------------ lifecycle
    def start(self, controllable: Controllable) -> KubeBridge:
        """Starts watching for barrier requests and writing status."""
        self._controllable = controllable
        for target, name in ((self._watch_loop, "kube-bridge-watch"), (self._write_loop, "kube-bridge-status")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Writes what is pending (up to ``timeout``) and stops the threads."""
        self.flush(timeout)
        self._stop.set()
        with self._lock:
            self._lock.notify_all()

    # ------------------------------------------------------------------ barrier requests
    def _watch_loop(self) -> None:
        for rljob in self._states():
            try:
                self.handle(rljob)
            except Exception as err:  # one state it cannot act on: the next may do
                log.warning("RLJob %s/%s: %s", self.namespace, self.job, err)

    def _states(self) -> Iterator[Obj]:
        """Every state of the RLJob as the API server shows it: listed, then watched (listed
        again after a 410), until :meth:`stop`. Network trouble and API restarts: it watches again."""
        from kubernetes.watch.watch import iter_resp_lines

        rv: str | None = None
        backoff = 0.5
        while not self._stop.is_set():
            try:
                if rv is None:
                    listing = self._api.list_job()
                    yield from listing.get("items") or []
                    rv = str((listing.get("metadata") or {}).get("resourceVersion") or "0")
                resp = self._api.watch(rv)
                try:
                    for line in iter_resp_lines(resp):
                        if self._stop.is_set():
                            return
                        event = json.loads(line)
                        obj = event.get("object") or {}
                        if event.get("type") == "ERROR":
                            if obj.get("code") == 410:  # too old: list again
                                rv = None
                            break
                        rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                        if event.get("type") in ("ADDED", "MODIFIED"):
                            yield obj
                finally:
                    resp.release_conn()
                backoff = 0.5
            except Exception as err:  # network trouble, API restarts: watch again
                if getattr(err, "status", None) == 410:
                    rv = None
                log.warning("watching RLJob %s/%s: %s; again in %.1f s", self.namespace, self.job, err, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def wait_for_attempt(self) -> Obj:
        """A standby's wait (``spec.standby``): returns the RLJob once ``status.attempt`` reaches
        this controller's attempt, which the operator writes when this pod is to take over.
        Until then this controller claims nothing and writes nothing."""
        from spotrl_runtime.controller.standby import status_attempt

        for rljob in self._states():
            if status_attempt(rljob) >= self.attempt:
                return rljob
        raise RuntimeError("the bridge was stopped while waiting for its attempt")

    def handle(self, rljob: Obj) -> bool:
        """Looks at one observed state of the RLJob; starts answering a new request addressed
        to this attempt. Returns True when it started one."""
        status = rljob.get("status") or {}
        barrier = _read_barrier(status.get("barrier"))
        if barrier is None or barrier.state != "Requested" or barrier.request_id in self._answered:
            return False
        request_id = barrier.request_id
        target = barrier.attempt if barrier.attempt is not None else status.get("attempt")
        if target != self.attempt or status.get("attempt") != self.attempt:
            log.info(
                "barrier %s is for attempt %s, not for this controller (%d): ignored", request_id, target, self.attempt
            )
            self._answered.add(request_id)
            return False
        self._answered.add(request_id)
        # The deadline enters the controller here, once, as a monotonic instant.
        try:
            when = times.unix(barrier.deadline)
        except ValueError:
            when = None
        deadline = Deadline.at_unix(when) if when is not None else Deadline.after(60)
        reason = barrier.reason or "operator request"
        t = threading.Thread(
            target=self._answer, args=(request_id, reason, deadline), name=f"barrier-{request_id}", daemon=True
        )
        t.start()
        self._threads.append(t)
        return True

    def _answer(self, request_id: str, reason: str, deadline: Deadline) -> None:
        assert self._controllable is not None
        log.info("barrier %s requested (%s), deadline %s", request_id, reason, times.rfc3339(deadline.unix()))
        tests = [
            {"op": "test", "path": "/status/barrier/requestId", "value": request_id},
            {"op": "test", "path": "/status/barrier/state", "value": "Requested"},
        ]
        try:
            cut = self._controllable.request_barrier(reason, deadline)
        except Exception as err:  # BarrierFailed, or anything else: the operator must hear it
            message = str(err) if isinstance(err, BarrierFailed) else f"{type(err).__name__}: {err}"
            log.warning("barrier %s failed: %s", request_id, message)
            ops = [*tests, _add("/status/barrier/state", "Failed"), _add("/status/barrier/message", message[:1024])]
        else:
            log.info("barrier %s committed cut %s at step %d", request_id, cut.cut_id, cut.step)
            self._note_cut(cut)
            ops = [
                *tests,
                _add("/status/barrier/state", "Committed"),
                _add("/status/barrier/cutId", cut.cut_id),
                _add("/status/barrier/committedAt", times.rfc3339_micro(_utc(cut.committed_at))),
                _add("/status/lastCut", _doc(cut.ref())),
            ]
        self._patch_retrying(ops, f"answer to barrier {request_id}")

    def _patch_retrying(self, ops: list[Obj], what: str) -> bool:
        """Sends a JSON patch, retrying transient errors for a while. False if it is stale."""
        until = time.monotonic() + ANSWER_RETRY_SECONDS
        delay = 0.2
        while True:
            try:
                self._api.json_patch(ops)
                return True
            except StaleError:
                log.warning("%s not written: the RLJob's status moved on", what)
                return False
            except Exception as err:
                if time.monotonic() > until or self._stop.is_set():
                    log.error("%s not written: %s", what, err)
                    return False
                log.warning("%s: %s; retrying", what, err)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    # ------------------------------------------------------------------ the Ray head
    def publish_ray_head(self, address: str, workers: int, trainers: int = 0) -> bool:
        """Writes ``status.rayHead`` for this attempt (``workers`` generation worker pods and
        ``trainers`` trainer pods to join it), before the controller waits for them (so it
        does not wait for :meth:`start`). False if the status moved on to another attempt,
        or the write did not get through."""
        head = api.RayHead(address=address, attempt=self.attempt, workers=workers, trainers=trainers)
        ops = [
            {"op": "test", "path": "/status/attempt", "value": self.attempt},
            _add("/status/rayHead", _doc(head)),
        ]
        written = self._patch_retrying(ops, f"Ray head of attempt {self.attempt}")
        if written:
            log.info(
                "Ray head %s published for attempt %d (%d worker pods, %d trainer pods)",
                address,
                self.attempt,
                workers,
                trainers,
            )
        return written

    # ------------------------------------------------------------------ status (StatusSink)
    def on_started(self, resumed_from: CutInfo | None, skipped: Sequence[SkippedCut] = ()) -> None:
        if resumed_from is not None:
            log.info("attempt %d resumes from cut %s (step %d)", self.attempt, resumed_from.cut_id, resumed_from.step)
        else:
            log.info("attempt %d starts from scratch", self.attempt)
        resume = api.ResumeStatus(
            attempt=self.attempt,
            cut_id=resumed_from.cut_id if resumed_from else None,
            skipped=[api.SkippedCut(id=s.cut_id, check=s.check, message=s.message[:2048]) for s in skipped[:64]],
        )
        self._set(resume=_doc(resume))

    def note_start(self, start: StartTimes | None, audit: AuditStore | None = None) -> None:
        """This attempt's start, phase by phase (``status.attemptTimes``; the first step's time
        is added at the first step), and, with ``audit``, ``status.accounting`` from the run's
        audit and restore records, read once here (on a thread) and kept up to date from
        each record this controller writes."""
        with self._lock:
            self._times = api.AttemptTimes(
                attempt=self.attempt,
                started_at=times.rfc3339_micro(_utc(start.started_at)) if start else None,
                restored_at=times.rfc3339_micro(_utc(start.restored_at)) if start else None,
                ready_at=times.rfc3339_micro(_utc(start.ready_at)) if start else None,
                cut_form=start.cut_form if start else None,
                steps_redone=start.steps_redone if start else 0,
            )
            timeline = _doc(self._times)
        self._set(attemptTimes=timeline)
        if audit is not None:
            audit.listeners.append(self._audited)
            t = threading.Thread(target=self._read_audit, args=(audit,), name="kube-bridge-audit", daemon=True)
            t.start()

    def _read_audit(self, audit: AuditStore) -> None:
        try:
            docs, restores = audit.documents(), audit.restores()
        except Exception as err:  # the accounting is a report: the run goes on without it
            log.warning("reading the audit for status.accounting: %s", err)
            return
        with self._lock:
            known = {(int(d["step"]), int(d["attempt"])): d for d in docs}
            known.update(self._audit_docs)  # written by this controller while reading
            self._audit_docs, self._restores, self._audit_read = known, restores, True
        self._set_accounting()

    def _audited(self, doc: Obj) -> None:
        with self._lock:
            self._audit_docs[(int(doc["step"]), int(doc["attempt"]))] = doc
            ready = self._audit_read  # until the whole audit is read, a partial count would mislead
        if ready:
            self._set_accounting()

    def _set_accounting(self) -> None:
        from spotrl_runtime.core.accounting import summarize

        with self._lock:
            docs, restores = list(self._audit_docs.values()), list(self._restores)
        try:
            acc = summarize(docs, restores)
        except Exception as err:
            log.warning("status.accounting not computed: %s", err)
            return
        self._set(accounting=_doc(api.Accounting.model_validate(acc.as_dict())))

    def on_step(self, step: int, metrics: dict[str, Any]) -> None:
        with self._lock:
            first = self._times is not None and self._times.first_step_at is None
            if first and self._times is not None:
                self._times = self._times.model_copy(update={"first_step_at": times.rfc3339_micro()})
            timeline = _doc(self._times) if first else None
        fields: dict[str, Any] = {"step": step}
        if timeline is not None:
            fields["attemptTimes"] = timeline
        if "steps_without_signal" in metrics:
            signal = api.LearningSignalStatus(
                steps_without_signal=int(metrics["steps_without_signal"]),
                threshold=NO_SIGNAL_STEPS,
                step=step,
                reward_mean=float(metrics.get("reward", 0.0)),
            )
            fields["learningSignal"] = _doc(signal)
        self._set(**fields)

    def on_cut(self, cut: CutInfo) -> None:
        if self._note_cut(cut):
            self._set(lastCut=_doc(cut.ref()))
        if cut.estimate is not None:
            self._set(cutEstimate=_doc(_cut_estimate(cut.estimate, self.attempt)))

    def on_finished(self, steps: int) -> None:
        """Writes the final step count before returning: the operator calls a job Succeeded
        only when the exited controller's steps reach totalSteps."""
        self._set(step=steps)
        if not self.flush(15.0):
            log.error("the final step count (%d) did not reach the RLJob's status", steps)

    def _note_cut(self, cut: CutInfo) -> bool:
        """Remembers the newest cut; False for one older than a cut already reported."""
        key = (cut.step, cut.cut_id)
        with self._lock:
            if self._best_cut is not None and key < self._best_cut:
                return False
            self._best_cut = key
            return True

    def _set(self, **fields: Any) -> None:
        with self._lock:
            self._want.update(fields)
            self._wanted_version += 1
            self._lock.notify_all()

    def flush(self, timeout: float) -> bool:
        """Waits until everything set so far is written (or given up). True if written."""
        until = time.monotonic() + timeout
        with self._lock:
            target = self._wanted_version
            while self._written_version < target:
                left = until - time.monotonic()
                if left <= 0 or not any(t.is_alive() for t in self._threads):
                    return False
                self._lock.wait(left)
            return True

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while self._written_version >= self._wanted_version and not self._stop.is_set():
                    self._lock.wait()
                if self._stop.is_set() and self._written_version >= self._wanted_version:
                    return
                want, version = dict(self._want), self._wanted_version
            ops: list[Obj] = [{"op": "test", "path": "/status/attempt", "value": self.attempt}]
            if "step" in want:
                ops += [_add("/status/step", want["step"]), _add("/status/stepAttempt", self.attempt)]
            if "lastCut" in want:
                ops.append(_add("/status/lastCut", want["lastCut"]))
            if "resume" in want:
                ops.append(_add("/status/resume", want["resume"]))
            if "attemptTimes" in want:
                ops.append(_add("/status/attemptTimes", want["attemptTimes"]))
            if "accounting" in want:
                ops.append(_add("/status/accounting", want["accounting"]))
            if "cutEstimate" in want:
                ops.append(_add("/status/cutEstimate", want["cutEstimate"]))
            if "learningSignal" in want:
                ops.append(_add("/status/learningSignal", want["learningSignal"]))
            self._patch_retrying(ops, f"status of attempt {self.attempt}")
            with self._lock:
                self._written_version = max(self._written_version, version)
                self._lock.notify_all()
            time.sleep(MIN_WRITE_INTERVAL)


def _doc(model: Any) -> Obj:
    """An API model as the API server stores it (camelCase, unset fields absent)."""
    out: Obj = model.model_dump(by_alias=True, exclude_none=True, mode="json")
    return out


def _utc(unix: float) -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(unix, UTC)


def _add(path: str, value: Any) -> Obj:
    return {"op": "add", "path": path, "value": value}


def _read_barrier(doc: Any) -> api.BarrierStatus | None:
    """The barrier request as this version reads it. A newer operator's fields are skipped (each
    barrier would otherwise be ignored); a request this version cannot read at all (a state it
    does not know) is no request: answering it could overwrite what it means."""
    if not isinstance(doc, dict) or not doc:
        return None
    try:
        barrier, skipped = ignoring_unknown(api.BarrierStatus, doc)
    except ValueError as err:
        log.warning("status.barrier cannot be read by this version, ignored: %s", err)
        return None
    if skipped:
        log.warning("status.barrier: skipped fields this version does not know: %s", ", ".join(skipped))
    return barrier


def _cut_estimate(e: CutEstimate, attempt: int) -> api.CutEstimateStatus:
    """``status.cutEstimate``: the operator compares it with the shortest barrier window."""
    return api.CutEstimateStatus(
        seconds=e.seconds,
        bytes=e.bytes,
        bytes_per_second=e.bytes_per_second,
        overhead_seconds=e.overhead_seconds,
        based_on_cuts=e.based_on_cuts,
        step_seconds=e.step_seconds,
        attempt=attempt,
    )
