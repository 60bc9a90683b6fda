"""`spotrl run -f RLJOB.yaml`: run a job in this process tree, no cluster needed.

Cuts go to ``--storage`` (default: ``spec.checkpoint.storage``, else ``./spotrl-runs/<name>``).
SIGTERM takes a barrier cut and exits 143; run the same command again (``--resume auto``)
to carry on from it.

Exit codes: 0 every step trained; 143 stopped by SIGTERM (with its barrier cut, or saying
why there is none); 3 the run cannot start from this storage (a cut fails the validation
chain, or ``--resume`` asks for what is not there); 4 fenced (another controller claimed
the job; this one wrote nothing more); 1 any other error.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import yaml


def register(sub: Any) -> None:
    p = sub.add_parser("run", help="run an RLJob locally (no cluster)", description=__doc__)
    p.add_argument("-f", "--filename", required=True, help="the RLJob YAML")
    p.add_argument("--storage", help="where cuts and the audit go: a path or s3://bucket/prefix")
    p.add_argument("--max-steps", type=int, help="stop after this many trained steps")
    p.add_argument("--resume", default="auto", help="auto (default), never, or a cut id")
    p.add_argument("--sigterm-deadline", type=float, help="seconds a SIGTERM barrier cut may take")
    p.add_argument("--http-port", type=int, help="serve /metrics, /status and POST /barrier on 127.0.0.1")
    p.add_argument("--workers", type=int, help="override spec.generation.workers")
    p.add_argument(
        "--worker-nodes",
        action="store_true",
        help="generation workers join from other processes or machines (`spotrl worker --address`, printed) "
        "instead of running here, as spec.generation.workerPods does on Kubernetes",
    )
    p.add_argument("--host", help="with --worker-nodes: the address workers reach this machine at (default 127.0.0.1)")
    p.add_argument("--device", default="auto", help="auto (cuda when a GPU is visible), cpu, or cuda[:N]")
    p.add_argument("--summary-json", help="write a summary of this process's run here")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-step progress")
    p.set_defaults(func=run)


def load_job(path: str) -> Any:
    from spotrl_runtime.api.rljob import parse_rljob

    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    if len(docs) != 1:
        raise SystemExit(f"{path}: expected one RLJob document, found {len(docs)}")
    return parse_rljob(docs[0])


def run(args: argparse.Namespace) -> int:
    from spotrl_runtime.api.rljob import SpecError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        job = load_job(args.filename)
    except SpecError as err:
        print(f"{args.filename}: {err}", file=sys.stderr)
        return 2
    if args.workers:
        gen = job.spec.generation.model_copy(update={"workers": args.workers})
        job = job.model_copy(update={"spec": job.spec.model_copy(update={"generation": gen})})
    storage = args.storage or job.spec.checkpoint.storage or str(Path("spotrl-runs") / (job.name or "job"))
    options = controller_options(args, job, storage)
    if args.worker_nodes:
        options.remote_workers = True
        options.http_host = args.host or "127.0.0.1"
        options.on_ray_head.append(_print_join_command)
    return run_controller(job, options, args.summary_json)


def _print_join_command(address: str, workers: int) -> None:
    print(f"waiting for {workers} generation worker(s); start each with: spotrl worker --address {address}", flush=True)


def controller_options(args: argparse.Namespace, job: Any, storage: str) -> Any:
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
        http_port=args.http_port,
        device=_device(args.device),
        sinks=[] if quiet else [TerminalProgress(job.spec.training.total_steps)],
    )


def run_controller(job: Any, options: Any, summary_json: str | None = None) -> int:
    """Assembles and runs a Controller; shared by `run` and `controller`. A SIGTERM before
    training starts ends start-up (exit 143, no cut: nothing happened since the cut it
    restores from); from then on it takes a barrier cut."""
    # The controller's modules import torch (and Ray when it starts): only now, so that the
    # CLI's other commands and --help stay quick.
    from spotrl_runtime.checkpoint.fence import FencedError
    from spotrl_runtime.checkpoint.restore import NoCommittedCutError
    from spotrl_runtime.checkpoint.resume import ResumeError
    from spotrl_runtime.checkpoint.writer import CutConflictError
    from spotrl_runtime.controller.assemble import ControllerError, assemble
    from spotrl_runtime.controller.http import ControlServer
    from spotrl_runtime.controller.loop import EXIT_FENCED, EXIT_TERMINATED, Controller
    from spotrl_runtime.controller.metrics import registry_for
    from spotrl_runtime.core.validation import CutCheckError
    from spotrl_runtime.generation.cluster import RayStartError

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        parts = assemble(job, options, stop)
    except FencedError as err:
        print(f"spotrl: {err}", file=sys.stderr)
        return EXIT_FENCED
    except (CutCheckError, NoCommittedCutError, ControllerError, ResumeError, RayStartError) as err:
        print(f"spotrl: {err}", file=sys.stderr)
        return 3
    controller = Controller(job, options, parts, stop)
    signal.signal(signal.SIGTERM, lambda *_: controller.on_sigterm())
    if stop.is_set():
        parts.shutdown()
        return EXIT_TERMINATED
    server = None
    if options.http_port is not None:
        server = ControlServer(controller, registry_for(controller), options.http_host, options.http_port).start()
        print(f"controller endpoint: {server.address} (/metrics, /status, POST /barrier)", flush=True)
    try:
        rc = controller.run()
    except (FencedError, CutConflictError) as err:
        print(f"spotrl: {err}", file=sys.stderr)
        rc = EXIT_FENCED
    finally:
        if server is not None:
            server.stop()
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
        Path(summary_json).write_text(json.dumps(summary, indent=2))
    return rc


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
