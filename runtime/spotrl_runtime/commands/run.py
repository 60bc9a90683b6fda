"""`spotrl run -f RLJOB.yaml`: run a job in this process tree, no cluster needed.

Cuts go to ``--storage`` (default: ``spec.checkpoint.storage``, else ``./spotrl-runs/<name>``).
SIGTERM or Ctrl-C (SIGINT) takes a barrier cut and exits 143 or 130; run the same command
again (``--resume auto``) to carry on from it. A second Ctrl-C says how to abort, and a third
stops at once without the cut (:mod:`~spotrl_runtime.controller.signals`).

``--http-port P`` serves /metrics, /status and POST /barrier on 127.0.0.1 (``--http-host``
0.0.0.0 lets anyone who reaches this machine ask for a barrier); ``--metrics-port`` serves
only /metrics and /healthz.

Exit codes: 0 every step trained; 143 stopped by SIGTERM, 130 by SIGINT (with its barrier
cut, or saying why there is none); 2 a bad flag, file or RLJob field (one line names it;
nothing was started); 3 the run cannot start from this storage (it belongs to another job, a
cut fails the validation chain, ``--resume`` asks for what is not there, or an S3 store ignores
create-only puts; nothing was written there); 4 fenced (another controller claimed the job;
this one wrote nothing more); 5 a trainer rank lost; 1 any other error (Ray or the trainer
group could not start, the generation workers did not come).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any

from spotrl_runtime.commands import preflight
from spotrl_runtime.commands.preflight import UsageError


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="run an RLJob locally (no cluster)", description=__doc__)
    p.add_argument("-f", "--filename", required=True, help="the RLJob YAML")
    p.add_argument("--storage", help="where cuts and the audit go: a path or s3://bucket/prefix")
    p.add_argument("--max-steps", type=preflight.positive_int, help="stop after this many trained steps (>= 1)")
    add_controller_flags(p, http_port=None, metrics_port=None, metrics_host="127.0.0.1")
    p.add_argument("--workers", type=preflight.positive_int, help="override spec.generation.workers")
    p.add_argument(
        "--worker-nodes",
        action="store_true",
        help="generation workers join from other processes or machines (`spotrl worker --address`, printed) "
        "instead of running here, as spec.generation.workerPods does on Kubernetes",
    )
    p.add_argument(
        "--host",
        type=preflight.ip_address,
        help="with --worker-nodes: the IP address workers reach this machine at, where Ray listens (default 127.0.0.1)",
    )
    p.add_argument("--summary-json", help="write a summary of this process's run here")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-step progress")
    p.set_defaults(func=run)


def add_controller_flags(
    p: argparse.ArgumentParser, *, http_port: int | None, metrics_port: int | None, metrics_host: str
) -> None:
    """The flags `run` and `controller` share, each checked as it is parsed."""
    p.add_argument("--resume", type=preflight.resume, default="auto", help="auto (default), never, or a cut id")
    p.add_argument(
        "--sigterm-deadline", type=preflight.seconds, help="seconds a SIGTERM barrier cut may take (0 < s <= 3600)"
    )
    p.add_argument(
        "--device", type=preflight.device, default="auto", help="auto (cuda when a GPU is visible), cpu, or cuda[:N]"
    )
    off = "off" if http_port is None else str(http_port)
    p.add_argument(
        "--http-port",
        type=preflight.port,
        default=http_port,
        help=f"serve /metrics, /status and POST /barrier on --http-host (0: any free port; default {off})",
    )
    p.add_argument(
        "--http-host",
        type=preflight.listen_host,
        default="127.0.0.1",
        help="where --http-port listens (default 127.0.0.1: only this machine, or `kubectl port-forward`, can "
        "ask for a barrier; 0.0.0.0 lets anyone who reaches it)",
    )
    off = "off" if metrics_port is None else str(metrics_port)
    p.add_argument(
        "--metrics-port",
        type=preflight.port,
        default=metrics_port,
        help=f"serve only GET /metrics and /healthz on --metrics-host, for Prometheus (default {off})",
    )
    p.add_argument(
        "--metrics-host", type=preflight.listen_host, help=f"where --metrics-port listens (default {metrics_host})"
    )


def load_job(path: str) -> Any:
    """The RLJob in the YAML file ``path``; a :class:`UsageError` says what is wrong with it."""
    return preflight.load_rljob_file(path)


def run(args: argparse.Namespace) -> int:
    job = _with_workers(load_job(args.filename), args.workers)
    if args.storage is not None:
        preflight.check_storage(args.storage, "--storage")
    storage = args.storage or job.spec.checkpoint.storage or str(Path("spotrl-runs") / (job.name or "job"))
    preflight.check_job_inputs(job, f"-f {args.filename}")
    if not args.worker_nodes:  # worker nodes bring their own vLLM
        preflight.check_generation(job, args.device, f"-f {args.filename}")
    if args.host is not None and not args.worker_nodes:
        raise UsageError("--host: applies only with --worker-nodes (the address worker nodes join at)")
    if args.summary_json and not Path(args.summary_json).absolute().parent.is_dir():
        raise UsageError(f"--summary-json {args.summary_json}: its folder does not exist")
    metrics_host = args.metrics_host or "127.0.0.1"
    preflight.check_listeners(args.http_host, args.http_port, metrics_host, args.metrics_port)

    # A port taken fails the run before Ray starts (start_listeners checks again, for a race).
    probe_listeners(args.http_host or "127.0.0.1", args.http_port, metrics_host, args.metrics_port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    refused = refused_early(job, storage, args.resume)
    if refused is not None:
        return refused
    ray_host = (args.host or "127.0.0.1") if args.worker_nodes else "127.0.0.1"
    prestart = start_ray_early(args, job, ray_host=ray_host, remote_workers=args.worker_nodes)
    try:
        options = controller_options(args, job, storage, metrics_host=metrics_host)
        options.prestart = prestart
        options.remote_workers = args.worker_nodes
        options.ray_host = ray_host
        if args.worker_nodes:
            options.on_ray_head.append(_print_join_command)
        return run_controller(job, options, args.summary_json)
    finally:
        prestart.close()  # nothing, once the controller took it


def refused_early(job: Any, storage: str, resume: str) -> int | None:
    """The resume's precheck (:mod:`~spotrl_runtime.checkpoint.precheck`), then the store's
    create-only probe (:func:`refused_store`), before Ray starts: exit code 3 after printing what
    the restore would refuse the resume with, or why the store is refused; None: go on."""
    from spotrl_runtime.api.rljob import EXIT_REFUSED
    from spotrl_runtime.checkpoint.precheck import ResumeError, precheck_resume
    from spotrl_runtime.core.identity import JobIdentity
    from spotrl_runtime.core.owners import RecoveryConfig
    from spotrl_runtime.core.validation import CutCheckError
    from spotrl_runtime.storage import StorageError, open_storage

    try:
        store = open_storage(storage)
    except StorageError:
        return None  # the restore opens it again, and says why it cannot
    try:
        config = RecoveryConfig.from_spec(job.spec)
        precheck_resume(store, job=JobIdentity.of(job.metadata), config=config, resume=resume)
    except (CutCheckError, ResumeError) as err:
        print(f"spotrl: {err}", file=sys.stderr)
        return EXIT_REFUSED
    return refused_store(store)


def refused_store(store: Any) -> int | None:
    """An S3 store that ignores ``If-None-Match: *`` (:func:`~spotrl_runtime.storage.s3.probe_create_only`),
    found before this controller claims anything there: exit code 3 after printing check
    ``create_only``; None: go on. A folder's create-only puts are the file system's own. A probe
    that the store's errors stop proves nothing: the restore meets the store next, and says why."""
    from spotrl_runtime.api.rljob import EXIT_REFUSED
    from spotrl_runtime.storage import StorageError
    from spotrl_runtime.storage.s3 import CreateOnlyIgnoredError, S3Storage, probe_create_only

    if not isinstance(store, S3Storage):
        return None
    try:
        probe_create_only(store)
    except CreateOnlyIgnoredError as err:
        print(f"spotrl: {err}", file=sys.stderr)
        return EXIT_REFUSED
    except StorageError as err:
        logging.getLogger("spotrl.storage").warning("%s: create-only probe not finished: %s", store.uri, err)
    return None


def start_ray_early(args: argparse.Namespace, job: Any, *, ray_host: str, remote_workers: bool) -> Any:
    """Ray and the generation workers, begun on a thread before the controller's modules are
    imported (:class:`~spotrl_runtime.controller.prestart.Prestart`); call its ``close`` when done."""
    from spotrl_runtime.controller.prestart import Prestart

    return Prestart(
        job.spec, host=ray_host, remote_workers=remote_workers, num_cpus=None, device=lambda: _device(args.device)
    )


def _with_workers(job: Any, workers: int | None) -> Any:
    """``job`` with ``--workers`` in place of ``spec.generation.workers``, checked as the field is."""
    if workers is None:
        return job
    from pydantic import ValidationError

    from spotrl_runtime.api.rljob import Generation

    try:
        gen = Generation.model_validate({**job.spec.generation.model_dump(by_alias=True), "workers": workers})
    except ValidationError as err:
        raise UsageError(f"--workers {workers}: {err.errors()[0]['msg']} (spec.generation.workers)") from None
    return job.model_copy(update={"spec": job.spec.model_copy(update={"generation": gen})})


def _print_join_command(address: str, workers: int, trainers: int = 0) -> None:
    if workers:
        print(
            f"waiting for {workers} generation worker(s); start each with: spotrl worker --address {address}",
            flush=True,
        )
    if trainers:
        print(
            f"waiting for {trainers} trainer node(s), one per rank; start each with: "
            f"spotrl worker --role trainer --address {address}",
            flush=True,
        )


def controller_options(args: argparse.Namespace, job: Any, storage: str, *, metrics_host: str) -> Any:
    """The :class:`ControllerOptions` the flags shared by `run` and `controller` ask for."""
    from spotrl_runtime.controller.assemble import ControllerOptions
    from spotrl_runtime.controller.progress import TerminalProgress

    grace = job.spec.scheduling.termination_grace_period_seconds
    quiet = getattr(args, "quiet", False)
    return ControllerOptions(
        storage_uri=storage,
        resume=args.resume,
        max_steps=getattr(args, "max_steps", None),
        sigterm_deadline=args.sigterm_deadline or max(2.0, grace - 5.0),
        http_host=args.http_host,
        http_port=args.http_port,
        metrics_host=metrics_host,
        metrics_port=args.metrics_port,
        device=_device(args.device),
        sinks=[] if quiet else [TerminalProgress(job.spec.training.total_steps)],
    )


def _listeners(http_host: str, http_port: int | None, metrics_host: str, metrics_port: int | None) -> list[Any]:
    """(host, port, private, flags) of each listener asked for (port None: not asked for)."""
    return [
        (host, port, private, flags)
        for host, port, private, flags in (
            (http_host, http_port, True, "--http-host/--http-port"),
            (metrics_host, metrics_port, False, "--metrics-host/--metrics-port"),
        )
        if port is not None
    ]


def _cannot_listen(flags: str, host: str, port: int, err: OSError) -> str:
    return f"{flags} {host}:{port}: cannot listen there ({err.strerror or err})"


def _pick_another(problem: str) -> UsageError:
    return UsageError(f"{problem}; pick another port, or 0 for any free one")


def probe_listeners(http_host: str, http_port: int | None, metrics_host: str, metrics_port: int | None) -> None:
    """Raises :class:`UsageError` if a listener's fixed port cannot be bound now (0: any port)."""
    import socket

    for host, port, _, flags in _listeners(http_host, http_port, metrics_host, metrics_port):
        if port == 0:
            continue
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listeners do
                sock.bind((host, port))
        except OSError as err:
            raise _pick_another(_cannot_listen(flags, host, port, err)) from None


def start_listeners(endpoint: Any, options: Any, *, required: bool = True) -> list[Any]:
    """The controller's HTTP listeners (:mod:`spotrl_runtime.controller.http`) that ``options``
    asks for, started and announced. One that cannot listen is a :class:`UsageError` naming
    its flags, or with ``required=False`` a warning, and the run goes on without it."""
    from spotrl_runtime.controller.http import ControlServer

    wanted = _listeners(options.http_host, options.http_port, options.metrics_host, options.metrics_port)
    servers: list[ControlServer] = []
    try:
        for host, port, private, flags in wanted:
            try:
                server = ControlServer(endpoint, host, port, private=private)
            except OSError as err:
                problem = _cannot_listen(flags, host, port, err)
                if required:
                    raise _pick_another(problem) from None
                logging.getLogger("spotrl.controller").warning("%s; the run goes on without it", problem)
                continue
            servers.append(server.start())
            what = "controller endpoint" if private else "metrics endpoint"
            print(f"{what}: {server.address} ({server.routes})", flush=True)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def run_controller(job: Any, options: Any, summary_json: str | None = None, *, listeners_required: bool = True) -> int:
    """Assembles and runs a Controller; shared by `run` and `controller`. The HTTP listeners
    start first, so /status answers while the run starts (``listeners_required``: see
    :func:`start_listeners`). A SIGTERM or SIGINT before training starts ends start-up (exit 143
    or 130, no cut: nothing happened since the cut it restores from); from then on it takes a
    barrier cut (:mod:`~spotrl_runtime.controller.signals`: also what a 2nd and 3rd Ctrl-C do)."""
    from spotrl_runtime.controller.http import Endpoint
    from spotrl_runtime.controller.signals import StopSignals

    stop = threading.Event()
    signals = StopSignals(lambda _: stop.set(), "stopping start-up (nothing trained yet: no cut is needed)").install()
    total = job.spec.training.total_steps
    endpoint = Endpoint(job.name, options.attempt, min(total, options.max_steps or total))
    servers = start_listeners(endpoint, options, required=listeners_required)
    try:
        return _assemble_and_run(job, options, endpoint, stop, signals, summary_json)
    finally:
        for server in servers:
            server.stop()


def _assemble_and_run(
    job: Any, options: Any, endpoint: Any, stop: threading.Event, signals: Any, summary_json: str | None
) -> int:
    # The controller's modules import torch (and Ray when it starts): only now, so that the
    # CLI's other commands and --help stay quick.
    from spotrl_runtime.checkpoint.fence import FencedError
    from spotrl_runtime.checkpoint.precheck import ResumeError
    from spotrl_runtime.checkpoint.restore import NoCommittedCutError
    from spotrl_runtime.checkpoint.resume import RedoStoppedError
    from spotrl_runtime.checkpoint.writer import CutConflictError
    from spotrl_runtime.controller.assemble import ControllerError, assemble
    from spotrl_runtime.controller.loop import (
        EXIT_ERROR,
        EXIT_FENCED,
        EXIT_RANK_LOST,
        EXIT_REFUSED,
        EXIT_TERMINATED,
        Controller,
    )
    from spotrl_runtime.core.validation import CutCheckError
    from spotrl_runtime.generation.cluster import RayStartError
    from spotrl_runtime.rewards.loading import RewardError
    from spotrl_runtime.training.group import RankLostError, TrainerGroupError

    if stop.is_set():
        return signals.exit_code()
    try:
        parts = assemble(job, options, stop)
    except FencedError as err:
        print(f"spotrl: {err}", file=sys.stderr)
        return EXIT_FENCED
    except RankLostError as err:
        print(f"spotrl: {err}; the next controller restores from the last cut", file=sys.stderr)
        return EXIT_RANK_LOST
    except (CutCheckError, NoCommittedCutError, ResumeError) as err:
        print(f"spotrl: {err}", file=sys.stderr)
        return EXIT_REFUSED
    except RedoStoppedError as err:
        print(f"spotrl: {err}", file=sys.stderr)
        return signals.exit_code()
    except (ControllerError, RayStartError, TrainerGroupError, RewardError) as err:
        print(f"spotrl: {err}", file=sys.stderr)
        return EXIT_ERROR
    controller = Controller(job, options, parts, stop)
    signals.stop_with(controller.on_stop_signal, "taking a barrier cut, then stopping")
    if stop.is_set():
        parts.shutdown()
        return signals.exit_code()
    endpoint.serve(controller)
    try:
        rc = controller.run()
        if rc == EXIT_TERMINATED:
            rc = signals.exit_code()  # 130 after SIGINT
    except (FencedError, CutConflictError) as err:
        print(f"spotrl: {err}", file=sys.stderr)
        rc = EXIT_FENCED
    except RankLostError as err:
        # Without notice: the group's state went with the rank. Nothing after the last cut is
        # kept; the next controller restores from it and retrains those steps on the same prompts.
        print(f"spotrl: {err}; the next controller restores from the last cut", file=sys.stderr)
        rc = EXIT_RANK_LOST
    summary = {
        "exit_code": rc,
        "attempt": controller.owners.attempt,
        "resumed_from": controller.resumed_from.__dict__ if controller.resumed_from else None,
        "steps_trained": [h["step"] for h in controller.history],
        "rewards": [h["reward"] for h in controller.history],
        "cuts": [c.__dict__ for c in controller.cuts],
        "counters": controller.owners.counters.__dict__,
        "stats": controller.stats,
    }
    if summary_json:
        Path(summary_json).write_text(json.dumps(summary, indent=2, default=_jsonable))
    return rc


def _jsonable(obj: Any) -> Any:
    """What ``json.dumps`` cannot write by itself in a run's summary: nested dataclasses (a
    cut's estimate) as dicts."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
