"""From a Pod object to what a local process needs: its environment, its volume folders,
its command line. Pure functions (no I/O but the ``lookup`` callback) so they can be
tested without a cluster.

Volume mounts: a container's files live under its pod's folder. Each ``mountPath`` is a
symlink under the pod's root folder (the process's working directory), and any command,
argument, env value or workingDir that names a mount path (``/data``, ``/data/x``,
``--dir=/data``) is rewritten to the local folder. A program that builds such a path
itself, from pieces, will not find it: pass paths in arguments or env.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

Obj = dict[str, Any]
# (kind, namespace, name) -> the object's data (secrets decoded), or None if it does not exist.
Lookup = Callable[[str, str, str], dict[str, str] | None]

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class PodConfigError(ValueError):
    """The pod cannot start as written (kubelet: CreateContainerConfigError); says which field."""


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known variables are replaced, unknown ones kept as
    written, ``$$`` is a literal ``$``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR.sub(sub, value)


def field_ref(pod: Obj, field_path: str) -> str:
    """The downward API's fieldRef values."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
        "status.hostIPs": ",".join(ip["ip"] for ip in status.get("hostIPs", [])),
        "status.podIPs": ",".join(ip["ip"] for ip in status.get("podIPs", [])),
    }
    if field_path in simple:
        return str(simple[field_path] or "")
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", field_path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    if field_path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(field_path.split(".")[1], {})
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise PodConfigError(f"fieldRef.fieldPath {field_path!r} is not supported by the node agent")


def _ref_value(pod: Obj, kind: str, ref: Obj, lookup: Lookup, where: str) -> str | None:
    data = lookup(kind, pod["metadata"]["namespace"], ref["name"])
    optional = bool(ref.get("optional", False))
    if data is None:
        if optional:
            return None
        raise PodConfigError(f"{where}: {kind} {ref['name']!r} not found")
    if ref["key"] not in data:
        if optional:
            return None
        raise PodConfigError(f"{where}: key {ref['key']!r} not found in {kind} {ref['name']!r}")
    return data[ref["key"]]


def container_env(pod: Obj, container: Obj, lookup: Lookup, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of one container: ``base`` (PATH, HOME, KUBECONFIG ...), then envFrom,
    then env in order, with ``$(VAR)`` expansion as the kubelet does it."""
    env = dict(base)
    name = container["name"]
    for i, src in enumerate(container.get("envFrom", []) or []):
        prefix = src.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key not in src:
                continue
            ref = src[key]
            data = lookup(kind, pod["metadata"]["namespace"], ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise PodConfigError(f"containers[{name}].envFrom[{i}]: {kind} {ref['name']!r} not found")
            env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env", []) or []:
        where = f"containers[{name}].env[{var['name']}]"
        if "value" in var or "valueFrom" not in var:
            env[var["name"]] = expand(var.get("value", ""), env)
            continue
        src = var["valueFrom"]
        value: str | None
        if "fieldRef" in src:
            value = field_ref(pod, src["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in src:
            value = _ref_value(pod, "Secret", src["secretKeyRef"], lookup, where)
        elif "configMapKeyRef" in src:
            value = _ref_value(pod, "ConfigMap", src["configMapKeyRef"], lookup, where)
        else:
            raise PodConfigError(f"{where}: valueFrom {sorted(src)} is not supported by the node agent")
        if value is not None:
            env[var["name"]] = value
    return env


def rewrite_path(value: str, mounts: Mapping[str, Path]) -> str:
    """Replaces a leading mount path (also after ``=`` in ``--flag=/path``) with its local folder."""
    prefix = ""
    if value.startswith("-") and "=" in value:
        prefix, value = value.split("=", 1)
        prefix += "="
    for mount_path in sorted(mounts, key=len, reverse=True):
        mp = mount_path.rstrip("/") or "/"
        if value == mp or value.startswith(mp + "/"):
            return prefix + str(mounts[mount_path]) + value[len(mp) :]
    return prefix + value


def command_line(
    container: Obj, env: Mapping[str, str], mounts: Mapping[str, Path], resolve: Callable[[str], str | None]
) -> list[str]:
    """command + args, expanded and with mount paths rewritten. The image's entrypoint is not
    known here, so a container without ``command`` cannot run. ``resolve`` finds a program on
    the local PATH: an absolute command that exists only in the image (``/usr/local/bin/spotrl``)
    falls back to its name on PATH."""
    command = list(container.get("command") or [])
    if not command:
        raise PodConfigError(
            f"containers[{container['name']}].command is empty: the node agent runs command+args as a local "
            "process and cannot read the image's entrypoint; set command"
        )
    argv = [rewrite_path(expand(a, env), mounts) for a in command + list(container.get("args") or [])]
    program = argv[0]
    if program.startswith("/") and not Path(program).exists():
        local = resolve(Path(program).name)
        if local is None:
            raise PodConfigError(f"containers[{container['name']}].command[0] {program!r}: not found locally")
        argv[0] = local
    return argv


def restart_policy(pod: Obj) -> str:
    return str(pod.get("spec", {}).get("restartPolicy", "Always"))


def grace_period(pod: Obj) -> int:
    """The grace period of a deletion in progress, else the spec's (default 30 s)."""
    meta = pod.get("metadata", {})
    if meta.get("deletionGracePeriodSeconds") is not None:
        return int(meta["deletionGracePeriodSeconds"])
    return int(pod.get("spec", {}).get("terminationGracePeriodSeconds", 30))
