"""Ray and the generation workers, started on a thread before the controller's heavy imports.

A controller's start-up is a chain: its imports (torch, transformers: seconds), Ray (a head
and its processes: seconds more), the generation workers (a process each, importing torch
and loading the policy), then training. Ray's start is mostly waiting for its processes, so
it can run beside the imports, and the workers, once asked for, start in their own
processes: :class:`Prestart` begins both on a thread as soon as the job is parsed, and
:func:`~spotrl_runtime.controller.assemble.assemble` takes what it started. A resume is shorter
by what the two overlap (docs/benchmarks.md).

This module imports nothing heavy itself: the thread does, beside the main thread's imports.
The thread then stays, parked, for as long as the process: Ray starts its processes with a
parent-death signal, and on Linux that parent is the thread that started them, so they would
be killed the moment it ended.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spotrl_runtime.api.rljob import RLJobSpec
    from spotrl_runtime.generation.cluster import RayRuntime
    from spotrl_runtime.generation.pool import GenerationPool

log = logging.getLogger("spotrl.controller")


def process_started_at() -> float:
    """When this process started (Unix seconds): its age from /proc (the start in clock ticks
    since boot against the uptime, both on the same clock: /proc/stat's whole-second boot
    time would be up to a second off) taken from now; now where there is no /proc."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class Prestart:
    """Starts Ray and ``spec``'s generation pool on a thread at once. :meth:`take` hands them
    over (raising what starting them raised); :meth:`close` stops them if nobody took them."""

    def __init__(
        self,
        spec: RLJobSpec,
        *,
        host: str | None,
        remote_workers: bool,
        num_cpus: int | None,
        device: Callable[[], str],
    ) -> None:
        self._args = (spec, host, remote_workers, num_cpus, device)
        self._started = time.monotonic()
        self._began_after = time.time() - process_started_at()
        self._result: tuple[RayRuntime, GenerationPool] | None = None
        self._error: BaseException | None = None
        self._taken = False
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._hold = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray-prestart", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        spec, host, remote_workers, num_cpus, device = self._args
        try:
            try:
                from spotrl_runtime.generation.cluster import controller_ray_gpus, generation_pool, start_ray

                ray = start_ray(
                    host,
                    remote_workers,
                    num_cpus,
                    remote_nodes=spec.training.parallelism.trainer_pods,
                    num_gpus=controller_ray_gpus(spec, device()),
                )
            except BaseException as err:
                self._error = err
                return
            try:
                pool = generation_pool(spec, device(), remote_workers)
            except BaseException as err:
                ray.shutdown()
                self._error = err
                return
            self._result = (ray, pool)
            log.info(
                "Ray and the generation pool started in %.2f s (begun %.2f s after the process started)",
                time.monotonic() - self._started,
                self._began_after,
            )
        finally:
            self._ready.set()
        self._hold.wait()  # Ray's processes live as long as this thread (see the module's docstring)

    def matches(self, host: str | None, remote_workers: bool, num_cpus: int | None) -> bool:
        """Whether it was started with these settings (the options may change after it began)."""
        return self._args[1:4] == (host, remote_workers, num_cpus)

    def wait(self, workers: bool = False) -> None:
        """Waits until the start is done (raising what it raised), then puts this
        process's SIGTERM handler back in force. ``workers``: also until the generation workers
        of this process's Ray have built their backend (none to wait for with remote workers)."""
        self._ready.wait()
        _keep_our_sigterm()
        if self._error is not None:
            raise self._error
        if workers and self._result is not None and not self._args[2]:
            self._result[1].wait_ready()

    def take(self) -> tuple[RayRuntime, GenerationPool]:
        """Waits for the start, then hands Ray and the pool over; the caller stops them."""
        self._ready.wait()
        _keep_our_sigterm()
        with self._lock:
            if self._taken:
                raise RuntimeError("the prestarted Ray was taken already")
            self._taken = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def close(self) -> None:
        """Stops what it started, unless :meth:`take` handed it over. Idempotent."""
        with self._lock:
            if self._taken:
                return
            self._taken = True
        self._ready.wait()
        _keep_our_sigterm()
        if self._result is not None:
            ray, pool = self._result
            _quietly(pool.shutdown)
            _quietly(ray.shutdown)
        self._hold.set()


def _keep_our_sigterm() -> None:
    """Puts this process's SIGTERM handler back in force. Ray's core worker, started on the
    thread, installed its own (Ray's C++ failure handler, which prints a stack for the signal
    before it passes it on), and only the main thread can undo that, as ``start_ray`` does when
    it runs there."""
    handler = signal.getsignal(signal.SIGTERM)
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def _quietly(stop: Callable[[], Any]) -> None:
    try:
        stop()
    except Exception as err:  # stopping after a failed start-up: the first error is the one to show
        log.warning("stopping the prestarted Ray: %s", err)
