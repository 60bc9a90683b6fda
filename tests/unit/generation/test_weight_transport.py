"""The weight channel's transport, chosen per member from where the sender and that member are:
every placement of the examples and of the placement tests, with the places and transports
written out by hand here (read off each spec and :mod:`~spotrl_runtime.api.placement`'s rules,
not computed by the code under test); the placements that cannot sync, refused by name; and
the choice at work: a GPU trainer's sender over gloo keeps its buffers on the CPU."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from spotrl_runtime.api.rljob import RLJobSpec, parse_rljob, parse_spec
from spotrl_runtime.controller.assemble import ControllerError, ControllerOptions, assemble
from spotrl_runtime.generation.transport import (
    Place,
    TransportError,
    buffer_device,
    channel_transport,
    member_transport,
    planned_places,
    spec_transport,
)
from spotrl_runtime.generation.weights import ChannelHost, ChannelMember, WeightSender

REPO = Path(__file__).resolve().parents[3]
C = "controller"


def _file(path: str) -> RLJobSpec:
    return parse_spec(yaml.safe_load((REPO / path).read_text())["spec"])


MINIMAL: dict[str, Any] = {
    "policy": {"model": "builtin:tiny-arith"},
    "dataset": {"uri": "builtin:arithmetic"},
    "reward": {"name": "arithmetic_exact"},
    "training": {"totalSteps": 3},
}


def _spec(**parts: dict[str, Any]) -> RLJobSpec:
    doc = copy.deepcopy(MINIMAL)
    for key, value in parts.items():
        doc[key] = {**doc.get(key, {}), **value}
    return parse_spec(doc)


def _w(node: str, gpus: tuple[int, ...], backend: str, i: int) -> Place:
    return Place(node, gpus, backend, f"generation worker {i}")


TRAINER = "the trainer"
RANK0 = "trainer rank 0"

# name: (spec, the controller's device, the GPUs it sees, sender, members, transport)
PLACEMENTS: dict[str, tuple[Any, str, int, Place, list[Place], str]] = {
    # examples/*.yaml, as the operator runs them: the controller pod's device and GPUs.
    "tiny-cpu.yaml": (
        lambda: _file("examples/tiny-cpu.yaml"),
        "cpu",
        0,
        Place(C, (), name=TRAINER),
        [_w(C, (), "transformers", 0)],
        "gloo",
    ),
    "cpu-chat-gsm8k.yaml": (
        lambda: _file("examples/cpu-chat-gsm8k.yaml"),
        "cpu",
        0,
        Place(C, (), name=TRAINER),
        [_w(C, (), "transformers", 0)],
        "gloo",
    ),
    "cpu-chat-gsm8k-lora.yaml": (
        lambda: _file("examples/cpu-chat-gsm8k-lora.yaml"),
        "cpu",
        0,
        Place(C, (), name=TRAINER),
        [_w(C, (), "transformers", 0)],
        "gloo",
    ),
    "cpu-agent-calculator.yaml": (
        lambda: _file("examples/cpu-agent-calculator.yaml"),
        "cpu",
        0,
        Place(C, (), name=TRAINER),
        [_w(C, (), "transformers", 0)],
        "gloo",
    ),
    # The trainer's GPU 1 is kept out of Ray, which hands the vLLM worker GPU 0.
    "gpu-qwen-7b-lora.yaml": (
        lambda: _file("examples/gpu-qwen-7b-lora.yaml"),
        "cuda",
        2,
        Place(C, (1,), name=TRAINER),
        [_w(C, (0,), "vllm", 0)],
        "nccl",
    ),
    "gpu-qwen-gsm8k.yaml": (
        lambda: _file("examples/gpu-qwen-gsm8k.yaml"),
        "cuda",
        3,
        Place(C, (2,), name=TRAINER),
        [_w(C, (0,), "vllm", 0), _w(C, (1,), "vllm", 1)],
        "nccl",
    ),
    # A controller pod without GPUs; rank 0 and each worker in a pod of its own, one GPU each.
    "gpu-qwen-fsdp.yaml": (
        lambda: _file("examples/gpu-qwen-fsdp.yaml"),
        "cpu",
        0,
        Place("trainer-0", (0,), name=RANK0),
        [_w(f"worker-{i}", (0,), "vllm", i) for i in range(4)],
        "nccl",
    ),
    # The GPU check's demos: `spotrl run` on one GPU, the transformers worker on the trainer's
    # GPU (NCCL refuses two ranks on one GPU: host memory carries the bytes).
    "gpu-check-tiny-cpu.yaml-on-one-gpu": (
        lambda: _file("examples/tiny-cpu.yaml"),
        "cuda",
        1,
        Place(C, (0,), name=TRAINER),
        [_w(C, (0,), "transformers", 0)],
        "gloo",
    ),
    "gpu-check-random-100m.yaml-on-one-gpu": (
        lambda: _file("e2e/gpu/random-100m.yaml"),
        "cuda",
        1,
        Place(C, (0,), name=TRAINER),
        [_w(C, (0,), "transformers", 0)],
        "gloo",
    ),
    # The placement tests' specs (tests/unit/api/test_rljob_model_vs_crd.py, test_gpu_placement.py).
    "vllm-workers-with-their-gpus-in-a-gpu-pod": (
        lambda: _spec(
            training={"resources": {"gpu": 1}},
            generation={"backend": "vllm", "workers": 2, "tensorParallelSize": 2, "resources": {"gpu": 2}},
        ),
        "cuda",
        5,
        Place(C, (4,), name=TRAINER),
        [_w(C, (0, 1), "vllm", 0), _w(C, (2, 3), "vllm", 1)],
        "nccl",
    ),
    "cpu-worker-pods": (
        lambda: _spec(generation={"workers": 2, "workerPods": True, "resources": {"cpu": "2"}}),
        "cpu",
        0,
        Place(C, (), name=TRAINER),
        [_w("worker-0", (), "transformers", 0), _w("worker-1", (), "transformers", 1)],
        "gloo",
    ),
    # CPU workers beside a GPU trainer: gloo, CPU buffers at both ends.
    "cpu-vllm-worker-pods-beside-a-gpu-trainer": (
        lambda: _spec(
            training={"resources": {"gpu": 1}},
            generation={"backend": "vllm", "workers": 2, "workerPods": True, "resources": {"cpu": "8"}},
        ),
        "cuda",
        1,
        Place(C, (0,), name=TRAINER),
        [_w("worker-0", (), "vllm", 0), _w("worker-1", (), "vllm", 1)],
        "gloo",
    ),
    "gpu-trainer-run-with-device-cpu": (
        lambda: _file("examples/gpu-qwen-gsm8k.yaml"),
        "cpu",
        0,
        Place(C, (), name=TRAINER),
        [_w(C, (), "vllm", 0), _w(C, (), "vllm", 1)],
        "gloo",
    ),
    # FSDP ranks in the controller pod: Ray hands the in-pod workers' GPUs first, then the ranks'.
    "fsdp-in-pod-with-vllm-workers-on-their-gpus": (
        lambda: _spec(
            training={"resources": {"gpu": 2}, "parallelism": {"strategy": "fsdp", "ranks": 2, "gpusPerRank": 1}},
            generation={"backend": "vllm", "workers": 2, "resources": {"gpu": 1}},
        ),
        "cuda",
        4,
        Place(C, (2,), name=RANK0),
        [_w(C, (0,), "vllm", 0), _w(C, (1,), "vllm", 1)],
        "nccl",
    ),
    "fsdp-in-pod-with-transformers-on-the-ranks-gpus": (
        lambda: _spec(
            training={"resources": {"gpu": 2}, "parallelism": {"strategy": "fsdp", "ranks": 2, "gpusPerRank": 1}},
        ),
        "cuda",
        2,
        Place(C, (0,), name=RANK0),
        [_w(C, (0,), "transformers", 0)],
        "gloo",
    ),
    "fsdp-cpu-ranks-with-gpu-worker-pods": (
        lambda: _spec(
            training={"parallelism": {"strategy": "fsdp", "ranks": 2}},
            generation={"backend": "vllm", "workers": 1, "workerPods": True, "resources": {"gpu": 1}},
        ),
        "cpu",
        0,
        Place(C, (), name=RANK0),
        [_w("worker-0", (0,), "vllm", 0)],
        "gloo",
    ),
    "fsdp-trainer-pods-with-cpu-worker-pods": (
        lambda: _spec(
            training={
                "parallelism": {
                    "strategy": "fsdp",
                    "ranks": 2,
                    "gpusPerRank": 1,
                    "trainerPods": True,
                    "resources": {"gpu": 1},
                }
            },
            generation={"workers": 1, "workerPods": True},
        ),
        "cpu",
        0,
        Place("trainer-0", (0,), name=RANK0),
        [_w("worker-0", (), "transformers", 0)],
        "gloo",
    ),
}


def test_every_example_has_its_transport_written_down() -> None:
    examples = {p.name for p in (REPO / "examples").glob("*.yaml")}
    assert examples <= set(PLACEMENTS), "a new example: add its row to PLACEMENTS"


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_each_placement_gets_the_transport_its_places_need(name: str) -> None:
    make, device, visible, sender, members, transport = PLACEMENTS[name]
    spec = make()
    assert planned_places(spec, device, visible) == (sender, members)
    assert spec_transport(spec, device, visible) == transport


def test_a_member_on_the_cpu_or_a_sender_on_the_cpu_is_reached_over_gloo() -> None:
    gpu, cpu = Place(C, (0,)), Place(C, ())
    assert member_transport(gpu, Place("worker-0", (), "vllm")) == "gloo"
    assert member_transport(cpu, Place("worker-0", (0,), "vllm")) == "gloo"
    assert member_transport(cpu, Place(C, (0,), "transformers")) == "gloo"


def test_a_member_on_another_gpu_is_reached_over_nccl() -> None:
    trainer = Place(C, (1,))
    assert member_transport(trainer, Place(C, (0,), "vllm")) == "nccl"
    assert member_transport(trainer, Place(C, (2, 3), "vllm")) == "nccl"
    # GPU 1 of another node is another GPU.
    assert member_transport(trainer, Place("worker-0", (1,), "transformers")) == "nccl"


def test_a_member_on_the_senders_gpu_is_never_in_an_nccl_group_with_it() -> None:
    trainer = Place(C, (0,))
    assert member_transport(trainer, Place(C, (0,), "transformers")) == "gloo"
    assert member_transport(trainer, Place(C, (0,), "vllm")) == "ipc"
    assert member_transport(trainer, Place(C, (1, 0), "vllm")) == "ipc"  # one of its TP ranks


def test_a_vllm_engine_on_the_trainers_gpu_is_refused_naming_the_colocated_placement_and_what_to_do() -> None:
    members = [Place(C, (0,), "vllm", "generation worker 0")]
    with pytest.raises(TransportError) as info:
        channel_transport(Place(C, (0,)), members)
    message = str(info.value)
    for words in ("generation worker 0", "colocated", "generation.resources.gpu", "backend: transformers"):
        assert words in message


def test_members_that_need_different_transports_are_refused_by_name() -> None:
    members = [Place(C, (0,), "vllm", "generation worker 0"), Place("worker-1", (), "vllm", "generation worker 1")]
    with pytest.raises(TransportError) as info:
        channel_transport(Place(C, (1,)), members)
    assert "gloo: generation worker 1; nccl: generation worker 0" in str(info.value)
    assert "one transport per epoch" in str(info.value)
    assert channel_transport(Place(C, (1,)), []) == "gloo"


def test_a_local_gpu_run_with_vllm_workers_on_the_trainers_gpu_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    """training.resources.gpu 0 passes the model's rules (no pod GPUs to check), but `spotrl run`
    on a GPU puts the vLLM workers without GPUs of their own on the trainer's."""
    doc = {
        "apiVersion": "spotrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "t"},
        "spec": {**MINIMAL, "generation": {"backend": "vllm"}},
    }
    job = parse_rljob(doc)
    with pytest.raises(ControllerError, match=r"colocated.*generation\.resources\.gpu"):
        assemble(job, ControllerOptions(storage_uri=str(tmp_path), device="cuda"), threading.Event())


def test_buffers_are_on_the_gpu_with_nccl_and_on_the_cpu_with_gloo() -> None:
    assert buffer_device("nccl", "cuda:2") == "cuda:2"
    assert buffer_device("nccl", "cpu") == "cuda"  # a member: its engine's GPU
    assert buffer_device("gloo", "cuda:2") == "cpu"
    assert buffer_device("gloo", "cpu") == "cpu"


def test_a_gpu_trainers_sender_over_gloo_packs_into_cpu_buffers() -> None:
    """A trainer on cuda:1 beside CPU workers: its sender's buffers are on the CPU (this machine
    has no GPU, so a CUDA buffer would fail the sync), and the member receives every tensor."""
    g = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(32, 8, generator=g), "b.bias": torch.randn(8, generator=g)}
    host = ChannelHost("127.0.0.1", backend="gloo", timeout=30)
    sender = WeightSender(lambda: state, "float32", host, bucket_bytes=512, device="cuda:1")
    got: dict[str, torch.Tensor] = {}
    failed: list[BaseException] = []

    def member() -> None:
        try:
            end = ChannelMember()
            end.join(host.address(1, 2, rank=1))
            assert end.device == "cpu"
            end.receive(sender.plan, 3, lambda pairs: got.update({k: v.clone() for k, v in pairs}))
        except BaseException as err:
            failed.append(err)

    thread = threading.Thread(target=member)
    thread.start()
    try:
        assert sender.sync(1, 2, 3) == sender.plan.nbytes  # the members' announcements, then the send
    finally:
        thread.join(30)
    assert not failed, failed
    assert set(got) == set(state)
    assert all(torch.equal(got[k], state[k]) for k in state)
