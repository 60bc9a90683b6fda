"""Where the generation workers run: the controller's Ray instance and how the worker actors
are placed in it.

Workers run as Ray actors in the controller's own Ray, or, with remote workers
(``spec.generation.workerPods`` on Kubernetes; ``spotrl run --worker-nodes``), on Ray nodes
that join it (``spotrl worker --address``, one per worker pod): Ray then starts as a head that
other nodes reach on this pod's address, and each worker actor asks for the custom resource
:data:`WORKER_RESOURCE` that only those nodes offer, so no actor lands on the controller.

Ray is imported inside the functions that use it: importing this module (for
:data:`WORKER_RESOURCE`, say) must not cost Ray's import.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotrl_runtime.api.placement import ray_gpus, worker_gpus
from spotrl_runtime.api.rljob import RLJobSpec
from spotrl_runtime.cpus import CGROUP, pod_cpus
from spotrl_runtime.generation.backend import BackendSpec
from spotrl_runtime.generation.pool import GenerationPool
from spotrl_runtime.reaper import Reaper

log = logging.getLogger("spotrl.generation")

WORKER_RESOURCE = "spotrl.dev/worker"
"""The Ray resource a worker node offers (one unit) and each remote worker actor asks for."""

TRAINER_RESOURCE = "spotrl.dev/trainer"
"""The Ray resource a trainer node (``training.parallelism.trainerPods``) offers (one unit) and
each trainer rank's bundle asks for: one rank per trainer pod."""


class RayStartError(RuntimeError):
    """Ray cannot start as asked; the message says what to set."""


@dataclass
class RayRuntime:
    """The Ray instance this process started (its private folder), to stop at the end."""

    folder: str | None
    """None: Ray was already running (a test's), and is left alone."""

    reaper: Reaper | None = None
    """Stops Ray's processes and removes the folder if this process dies first."""

    @property
    def address(self) -> str:
        """The head's GCS address, for worker nodes to join."""
        import ray

        return str(ray.get_runtime_context().gcs_address)

    def shutdown(self) -> None:
        if self.folder is None:
            return
        import ray

        ray.shutdown()
        shutil.rmtree(self.folder, ignore_errors=True)
        _RAY_FOLDERS.discard(self.folder)
        self.folder = None
        if self.reaper is not None:
            self.reaper.close()
            self.reaper = None


_RAY_FOLDERS: set[str] = set()
"""The private folders of the Ray instances this process started and has not stopped."""


def remove_ray_folders() -> None:
    """Removes the folders of :data:`_RAY_FOLDERS`: for a process that stops at once, without
    ``ray.shutdown`` (an abort, once it has killed Ray's processes)."""
    for folder in list(_RAY_FOLDERS):
        shutil.rmtree(folder, ignore_errors=True)
        _RAY_FOLDERS.discard(folder)


class _KeepsOurSigterm(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


_KEEPS_OUR_SIGTERM = _KeepsOurSigterm()


@contextlib.contextmanager
def _replaced(owner: Any, values: dict[str, Any]) -> Iterator[None]:
    """While it lasts, ``owner``'s attributes named in ``values`` are those values; then they
    are what they were. For the places where Ray (pinned by constraints.txt) has no setting."""
    saved = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def _ray_processes_in_sessions_of_their_own(started: Callable[[int], None]) -> Iterator[None]:
    """While it lasts, each process ``ray.init`` starts (the GCS, the raylet, Ray's monitors)
    begins a session of its own, and the raylet's children (its agents, the generation
    workers, the trainer ranks) are in the raylet's. A signal to the controller's process
    group (Ctrl-C in its terminal, ``kill -- -PGID``) then reaches the controller alone, which
    takes its barrier cut with Ray and the ranks alive and stops them after it. They still die
    with the controller: Ray starts each with a parent-death signal (SIGKILL), and the
    raylet's children go with the raylet, or else with the :class:`Reaper` that ``started``
    tells of each new session (its leader's pid) as it starts.

    Ray offers no setting for this: its one spawner, ``ray._private.services.ConsolePopen``
    (Ray is pinned by constraints.txt), is given ``start_new_session`` for the duration."""
    from ray._private import services

    spawner = getattr(services, "ConsolePopen", None)
    if spawner is None:  # pragma: no cover - another Ray: say so, and go on without
        log.warning("Ray's processes share this process's group: a signal to the group reaches them too")
        yield
        return

    class InSessionOfItsOwn(spawner):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)
            started(self.pid)

    with _replaced(services, {"ConsolePopen": InSessionOfItsOwn}):
        yield


_UNUSED_HEAD_SERVICES = ("start_api_server", "start_monitor", "start_log_monitor")
"""What ``ray.init`` starts on a head that the controller never uses: the dashboard's API
server (started even with ``include_dashboard=False``, for usage statistics, and waited for),
the autoscaler's monitor (the operator, not Ray, decides what runs where), and the log monitor
(``log_to_driver=False``: workers' logs stay in their files). Three Python processes that each
import Ray, which ``ray.init`` waits for and ``ray.shutdown`` stops: on a small machine, much of
the time of both (docs/benchmarks.md)."""


@contextlib.contextmanager
def _without_unused_head_services() -> Iterator[None]:
    """While it lasts, a head that ``ray.init`` starts leaves out :data:`_UNUSED_HEAD_SERVICES`.
    Ray offers no setting for them (``ray start`` has ``--no-monitor`` only): the methods of its
    ``Node`` that start them (Ray is pinned by constraints.txt) do nothing for the duration."""
    from ray._private import node

    if not all(name in node.Node.__dict__ for name in _UNUSED_HEAD_SERVICES):  # pragma: no cover
        log.warning("Ray's head starts its dashboard, monitor and log monitor (this Ray has other names for them)")
        yield
        return

    def left_out(self: Any, **_: Any) -> None:
        return None

    with _replaced(node.Node, dict.fromkeys(_UNUSED_HEAD_SERVICES, left_out)):
        yield


def start_ray(
    host: str | None,
    remote_workers: bool,
    num_cpus: int | None,
    *,
    remote_nodes: bool = False,
    num_gpus: int | None = None,
) -> RayRuntime:
    """Starts Ray for the controller (unless it runs already). With remote workers it is a head
    bound to ``host`` with no CPUs of its own (no generation actor runs beside the trainer);
    with other remote nodes only (trainer pods, ``remote_nodes``) it is bound to ``host`` and
    keeps its CPUs for the generation workers. Keeps the caller's SIGTERM handler: ``ray.init``
    installs its own."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return RayRuntime(None)
    bind = host if host not in ("0.0.0.0", "", None) else None
    if (remote_workers or remote_nodes) and bind is None:
        raise RayStartError(
            "remote generation workers and trainer pods need an address they can reach: set SPOTRL_POD_IP "
            "(the operator sets it from status.podIP)"
        )
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    if not main:
        # Started early on a thread (controller.prestart): Ray then leaves SIGTERM to us, which
        # is what we want, and says so in a warning that would reach every run's terminal.
        logging.getLogger("ray._private.worker").addFilter(_KEEPS_OUR_SIGTERM)
    # A short private folder: Ray's unix sockets must fit in 107 bytes.
    folder = tempfile.mkdtemp(prefix="ray-", dir=os.environ.get("SPOTRL_RAY_TMP", "/tmp"))
    _RAY_FOLDERS.add(folder)
    reaper = Reaper()
    reaper.folder(folder)
    try:
        with _ray_processes_in_sessions_of_their_own(reaper.session), _without_unused_head_services():
            ray.init(
                num_cpus=controller_ray_cpus(remote_workers, num_cpus),
                num_gpus=num_gpus,
                include_dashboard=False,
                _temp_dir=folder,
                _node_ip_address=bind,
                log_to_driver=False,
                configure_logging=False,
                # No job-wide runtime_env: with one, the generation actor could not take one of
                # the workers Ray prestarts for the first driver (their env differs) and waited
                # for a process of its own, which delayed the pool (docs/benchmarks.md). Ray
                # gives each actor OMP_NUM_THREADS = its CPUs (1 for a generation worker)
                # unless the environment sets it.
            )
    except BaseException:
        reaper.close()  # what started of Ray goes with it
        raise
    if main and handler is not None:
        signal.signal(signal.SIGTERM, handler)
    return RayRuntime(folder, reaper)


def controller_ray_cpus(remote_workers: bool, num_cpus: int | None, cgroup: Path = CGROUP) -> int:
    """The CPUs the controller's Ray offers: none with remote workers (no generation actor runs
    beside the trainer), else ``num_cpus``, else the pod's (its CPU limit and affinity, read
    from ``cgroup``). Not the node's CPUs: Ray starts a worker process for each CPU it offers,
    which on a large node would be dozens the pod has no CPU or memory for."""
    if remote_workers:
        return 0
    return num_cpus or pod_cpus(cgroup)


def controller_ray_gpus(spec: RLJobSpec, device: str) -> int | None:
    """The GPUs the controller's Ray offers its actors (None: every visible one); see
    :func:`~spotrl_runtime.api.placement.ray_gpus`."""
    if not device.startswith("cuda"):
        return None
    import torch

    return ray_gpus(spec, torch.cuda.device_count())


def trainer_device(spec: RLJobSpec, device: str) -> str:
    """The single trainer's device: past the GPUs its Ray hands to the workers (Ray gives its
    actors the first visible GPUs)."""
    kept = controller_ray_gpus(spec, device)
    return f"cuda:{kept}" if kept is not None else device


def weight_transport(spec: RLJobSpec, device: str, remote_workers: bool) -> str:
    """The weight channel's transport for the places ``spec`` gives the trainer and the workers
    (:func:`~spotrl_runtime.generation.transport.spec_transport`); raises
    :class:`~spotrl_runtime.generation.transport.TransportError` for a placement that cannot sync."""
    from spotrl_runtime.generation.transport import spec_transport

    visible = 0
    if device.startswith("cuda"):
        import torch

        visible = torch.cuda.device_count()
    return spec_transport(spec, device, visible, remote_workers)


def generation_pool(spec: RLJobSpec, device: str, remote_workers: bool) -> GenerationPool:
    """The pool of ``spec.generation.workers`` worker actors, placed as the module docstring says."""
    backend, actor_options, max_restarts = worker_placement(spec, device, remote_workers)
    return GenerationPool(
        backend,
        spec.generation.workers,
        max_in_flight_groups=spec.generation.max_in_flight_groups or None,
        actor_options=actor_options,
        max_restarts=max_restarts,
    )


def worker_placement(
    spec: RLJobSpec, device: str, remote_workers: bool
) -> tuple[BackendSpec, dict[str, Any], int | None]:
    """A generation worker's backend spec, Ray actor options and restarts, as the spec places
    it (:mod:`~spotrl_runtime.api.placement`): its GPUs, its CPU, and with remote workers the
    resource only worker nodes offer."""
    gen = spec.generation
    on_gpu = device.startswith("cuda")
    if remote_workers:
        # A worker node's GPU is its own; without one (generation.resources.gpu 0) the worker
        # generates on its CPUs (vLLM's CPU build, or transformers).
        on_gpu = gen.resources.gpu > 0
    backend = BackendSpec.from_rljob(spec, device="cuda" if on_gpu else "cpu")
    gpus = worker_gpus(spec, on_gpu)
    options: dict[str, Any] = {"num_gpus": gpus} if gpus else {"num_cpus": 1}
    if remote_workers:
        options = {"num_gpus": gpus, "resources": {WORKER_RESOURCE: 1}}
    # Pods come and go: the operator replaces them, the pool their actors.
    return backend, options, None if remote_workers else 3
