"""Which transport carries the weight channel's bytes to each member, chosen from where the
sender and that member are (pure: no torch, no I/O).

- ``gloo``: a member on the CPU, or a sender on the CPU (NCCL needs a GPU at both ends), or a
  transformers worker on the sender's own GPU (NCCL refuses two ranks on one GPU; the bytes go
  through host memory). Both ends' buffers are on the CPU.
- ``nccl``: a member on GPUs none of which is the sender's. Both ends' buffers are on their GPU.
- ``ipc``: a vLLM worker on the sender's GPU (vLLM's IPC engine). Only the colocated placement
  puts a vLLM worker there, and SpotRL has none yet: :func:`channel_transport` refuses it.

One epoch of the channel is one process group, so it has one transport: a channel whose members
need different ones is refused by name (a spec's workers are all placed alike, so a valid spec
never makes one). Above the transport the channel's contract is the same on each: versioned
buckets, joiners, the gap check.

:func:`planned_places` says where a spec puts the sender and the workers, by the arithmetic of
:mod:`~spotrl_runtime.api.placement` (the GPUs Ray hands out are the first visible ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from spotrl_runtime.api.placement import ray_gpus, worker_gpus

Transport = Literal["gloo", "nccl", "ipc"]


class TransportError(ValueError):
    """No transport the channel has can reach these members; the message says what to change."""


@dataclass(frozen=True)
class Place:
    """Where one end of the channel runs."""

    node: str
    """The node (pod) it runs on: ``controller``, ``worker-<i>``, ``trainer-<i>``."""
    gpus: tuple[int, ...] = ()
    """The node's GPU indices it runs on; empty: the CPU."""
    backend: str = ""
    """A member's generation backend (``vllm`` or ``transformers``); empty for the sender."""
    name: str = ""
    """Who it is, for messages."""


def member_transport(sender: Place, member: Place) -> Transport:
    """The transport that carries the weights from ``sender`` to ``member``."""
    if not member.gpus or not sender.gpus:
        return "gloo"
    if member.node == sender.node and set(member.gpus) & set(sender.gpus):
        return "ipc" if member.backend == "vllm" else "gloo"
    return "nccl"


def channel_transport(sender: Place, members: Sequence[Place]) -> Transport:
    """The one transport of a channel from ``sender`` to ``members`` (gloo without members).
    Raises :class:`TransportError` for ``ipc`` or for members that need different transports."""
    chosen = {m.name or m.node: member_transport(sender, m) for m in members}
    if "ipc" in chosen.values():
        shared = ", ".join(n for n, t in chosen.items() if t == "ipc")
        raise TransportError(
            f"{shared} would share the trainer's GPU with a vLLM engine, which needs the colocated placement "
            "(vLLM's IPC weight transfer) that SpotRL does not have yet: give the vLLM workers GPUs of their own "
            "(generation.resources.gpu), or use backend: transformers"
        )
    kinds = sorted(set(chosen.values()))
    if len(kinds) > 1:
        which = "; ".join(f"{t}: {', '.join(n for n, c in chosen.items() if c == t)}" for t in kinds)
        raise TransportError(
            f"the weight channel has one transport per epoch, and these members need different ones ({which}): "
            "place every generation worker alike (all on GPUs of their own, or all on CPUs)"
        )
    return kinds[0] if kinds else "gloo"


def buffer_device(transport: str, device: str) -> str:
    """Where a channel end on ``device`` keeps its buffers: on its GPU with NCCL, else the CPU
    (gloo sends host memory; a GPU end copies each bucket through it)."""
    if transport == "nccl":
        return "cuda" if device == "cpu" else device
    return "cpu"


def planned_places(
    spec: Any, device: str, visible: int = 1, remote_workers: bool | None = None
) -> tuple[Place, list[Place]]:
    """Where ``spec`` puts the channel's sender (the single trainer, or rank 0 of the trainer
    group) and each generation worker, for a controller on ``device`` (``cpu`` or ``cuda``)
    that sees ``visible`` GPUs; ``remote_workers``: the workers run on nodes of their own
    (default: ``generation.workerPods``). GPU indices are each node's own, written as Ray hands
    them out (the workers' in the controller pod first); what decides a transport is only
    whether a member is on the CPU, on GPUs of its own, or on the sender's GPU."""
    remote = spec.generation.worker_pods if remote_workers is None else remote_workers
    sender = _sender_place(spec, device, visible, remote)
    return sender, [_worker_place(spec, i, device, sender, remote) for i in range(spec.generation.workers)]


def _sender_place(spec: Any, device: str, visible: int, remote: bool) -> Place:
    par, gen = spec.training.parallelism, spec.generation
    if par.strategy == "fsdp":
        if not par.gpus_per_rank:
            return Place("trainer-0" if par.trainer_pods else "controller", name="trainer rank 0")
        if par.trainer_pods:
            return Place("trainer-0", (0,), name="trainer rank 0")
        return Place("controller", (0 if remote else gen.workers * gen.resources.gpu,), name="trainer rank 0")
    if not device.startswith("cuda"):
        return Place("controller", name="the trainer")
    kept = ray_gpus(spec, visible)  # the single trainer's GPU is the first past Ray's
    return Place("controller", (kept or 0,), name="the trainer")


def _worker_place(spec: Any, index: int, device: str, sender: Place, remote: bool) -> Place:
    gen = spec.generation
    name = f"generation worker {index}"
    if remote:  # a worker pod's GPUs are its own; without them it generates on its CPUs
        return Place(f"worker-{index}", tuple(range(gen.resources.gpu)), gen.backend, name)
    if not device.startswith("cuda"):
        return Place("controller", (), gen.backend, name)
    gpus = worker_gpus(spec, True)
    if gpus < 1:  # no GPUs of its own in a GPU pod: it runs on the trainer's (with FSDP, say rank 0's)
        return Place("controller", sender.gpus, gen.backend, name)
    own = int(gpus)
    return Place("controller", tuple(range(index * own, (index + 1) * own)), gen.backend, name)


def spec_transport(spec: Any, device: str, visible: int = 1, remote_workers: bool | None = None) -> Transport:
    """The weight channel's transport for ``spec``'s placement (see :func:`planned_places`)."""
    sender, members = planned_places(spec, device, visible, remote_workers)
    return channel_transport(sender, members)
