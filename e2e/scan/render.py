"""Writes what the security scanners read: the Helm chart rendered, and for each example
RLJob the objects the operator would create for it, one folder per set.

    python e2e/scan/render.py OUT

Sets (folders of OUT, each one multi-document ``objects.yaml``):

- ``chart``, ``chart-watch-namespaces``: ``helm template`` of charts/spotrl with its default
  values, and with ``watchNamespaces`` set (RoleBindings per namespace instead of cluster-wide).
- ``operator-<example>`` for each examples/*.yaml, and ``operator-tiny-cpu-worker-pods`` (the
  tiny job with ``generation.workerPods``): every object builder of
  spotrl_operator.resources called for that job with the operator's default Settings.

Builders are found, not listed: every public function of resources.py whose first
parameter is ``ref`` and that returns a manifest. Their parameters are filled by name from
ARGUMENTS; a builder with a parameter not in it stops the render, naming it. Builders in
WHEN are rendered only where the job uses them. The code imported is the checkout this file
sits in (so a copy in another worktree renders that worktree).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "runtime")]

from spotrl_operator import resources  # noqa: E402
from spotrl_operator.settings import Settings  # noqa: E402
from spotrl_runtime.api import rljob as api  # noqa: E402

RELEASE = "spotrl"
RELEASE_NAMESPACE = "spotrl-system"
JOB_NAMESPACE = "team-a"
"""The examples' jobs are rendered in a namespace of their own, as a cluster would run them
(not ``default``, which checkov flags for reasons that are not the operator's)."""
WATCH_NAMESPACES = ("team-a", "team-b")
KUBE_VERSION = "1.35.4"
DEFAULT_STORAGE = "s3://spotrl-cuts"
"""Examples without spec.checkpoint.storage need the chart's storage.default; this stands in."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One example RLJob as the operator sees it."""

    ref: resources.JobRef
    spec: api.RLJobSpec
    settings: Settings


# Values for builder parameters, by name. A new builder's new parameter goes here.
ARGUMENTS: dict[str, Callable[[Job], Any]] = {
    "ref": lambda job: job.ref,
    "spec": lambda job: job.spec,
    "settings": lambda job: job.settings,
    "attempt": lambda job: 1,
    "index": lambda job: 0,
    "address": lambda job: f"{resources.controller_pod_name(job.ref.name, 1)}.{job.ref.namespace}:6379",
    "open_": lambda job: False,  # the PodDisruptionBudget as created: closed
    "uri": lambda job: resources.storage_uri(job.ref, job.spec, job.settings),
    "try_": lambda job: 1,
}

# Builders that only some jobs use: rendered where the predicate holds. One worker pod (one
# trainer pod) stands for all of them (they differ in name and index only).
WHEN: dict[str, Callable[[Job], bool]] = {
    "worker_pod": lambda job: job.spec.generation.worker_pods,
    "trainer_pod": lambda job: job.spec.training.parallelism.trainer_pods,
}


def builders() -> dict[str, Callable[..., dict[str, Any]]]:
    """The object builders of resources.py: public, first parameter ``ref``, returning a manifest."""
    found: dict[str, Callable[..., dict[str, Any]]] = {}
    for name, fn in vars(resources).items():
        if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != resources.__name__:
            continue
        params = list(inspect.signature(fn).parameters)
        if params[:1] == ["ref"] and str(fn.__annotations__.get("return")) in ("dict[str, Any]", str(dict[str, Any])):
            found[name] = fn
    return found


def operator_objects(job: Job) -> list[dict[str, Any]]:
    """Every object the operator's builders make for ``job``."""
    out = []
    for name, fn in builders().items():
        if name in WHEN and not WHEN[name](job):
            continue
        kwargs = {}
        for param in inspect.signature(fn).parameters.values():
            if param.name in ARGUMENTS:
                kwargs[param.name] = ARGUMENTS[param.name](job)
            elif param.default is inspect.Parameter.empty:
                raise SystemExit(
                    f"render: resources.{name} has a parameter {param.name!r} the scan has no value for; "
                    "add it to ARGUMENTS in e2e/scan/render.py"
                )
        out.append(fn(**kwargs))
    return out


def example_jobs() -> dict[str, Job]:
    """examples/*.yaml as jobs, named by file, plus tiny-cpu with worker pods."""
    settings = dataclasses.replace(Settings(), default_storage=DEFAULT_STORAGE)
    jobs = {}
    for path in sorted((REPO / "examples").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        ref = resources.JobRef(doc["metadata"]["name"], JOB_NAMESPACE, "00000000-0000-4000-8000-000000000001")
        jobs[path.stem] = Job(ref, api.parse_spec(doc["spec"]), settings)
        if path.stem == "tiny-cpu":
            spec = dict(doc["spec"])
            spec["generation"] = {**spec["generation"], "workerPods": True, "workers": 2}
            jobs["tiny-cpu-worker-pods"] = Job(ref, api.parse_spec(spec), settings)
    return jobs


def helm() -> str:
    out = subprocess.run(
        [str(REPO / "e2e/toolchain/build.sh"), "--env"], check=True, capture_output=True, text=True
    ).stdout
    tools = dict(line.split("=", 1) for line in out.splitlines())
    return os.environ.get("HELM") or tools["HELM"]


def chart_objects(*values: str) -> list[dict[str, Any]]:
    """``helm template`` of charts/spotrl (no CRDs: a schema is not a workload), ``--set`` values."""
    args = [helm(), "template", RELEASE, str(REPO / "charts/spotrl"), "--namespace", RELEASE_NAMESPACE]
    args += ["--kube-version", KUBE_VERSION]
    for value in values:
        args += ["--set", value]
    rendered = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def render(out: Path) -> dict[str, int]:
    """Writes every set under ``out``; returns the number of objects in each."""
    sets: dict[str, list[dict[str, Any]]] = {
        "chart": chart_objects(),
        "chart-watch-namespaces": chart_objects(f"watchNamespaces={{{','.join(WATCH_NAMESPACES)}}}"),
    }
    for name, job in example_jobs().items():
        sets[f"operator-{name}"] = operator_objects(job)
    for name, objects in sets.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "objects.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
    return {name: len(objects) for name, objects in sets.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write the sets into")
    args = parser.parse_args()
    for name, count in render(args.out).items():
        print(f"{name}: {count} objects")


if __name__ == "__main__":
    main()
