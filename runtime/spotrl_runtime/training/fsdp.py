"""One trainer rank: a process of the trainer group, holding a shard of the policy (FSDP2).

A rank joins a torch.distributed process group (NCCL on GPU, gloo on CPU), loads the policy,
shards it per transformer block and then as a whole (``fully_shard``), and wraps the sharded
model in the same :class:`~spotrl_runtime.training.trainer.Trainer` the single process uses:
the GRPO loss, micro-batching, clipping and AdamW are today's, only the parameters are
DTensors. It owns parameters and optimizer state, nothing of the recovery state.

Cuts go through a second process group (gloo) of their own: a periodic cut's shards are
written while the next step trains, and their collectives must never interleave with the
step's. :class:`TrainerRank` is what :class:`~spotrl_runtime.training.group.TrainerGroup`
runs as a Ray actor (three calls at a time: a step or a weight sync, a cut's write, and a sync's
cancel). Rank 0 also serves the weight channel to the generation workers.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

log = logging.getLogger("spotrl.trainer")

COLLECTIVE_TIMEOUT = dt.timedelta(minutes=10)
"""How long a collective waits for the other ranks. A lost rank is noticed by the group's
driver long before (Ray reports the actor's death); this bounds a rank left behind."""

WRITE_THREADS = 2
"""Files each rank writes a cut's shards into at once: one thread's hashing and writing then
overlap another's, so two files beat one and match a plain torch.save + fsync of the same state
(docs/benchmarks.md)."""


def shard_policy(model: Any, compute_dtype: Any, mesh: Any = None, float32_root: bool = False) -> Any:
    """FSDP2 over ``model``: each transformer block is its own unit (the classes the model names
    in ``_no_split_modules``), then the root (embeddings, final norm, head). In place. The shards
    stay float32; each unit is gathered in ``compute_dtype`` and its gradients reduced in float32
    (:func:`~spotrl_runtime.training.precision.fsdp_mixed_precision`). The trainer's log-prob
    method (:mod:`~spotrl_runtime.training.logprobs`) runs under the root's hooks, as ``forward`` does.
    ``float32_root`` (``training.precision.lmHead: float32``): the root is gathered in float32, so
    the head multiplies float32 weights (a tied head is the embedding: it is gathered in float32
    too, and its output cast to the compute dtype)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from spotrl_runtime.training import logprobs, precision

    block_names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} names no transformer block class (_no_split_modules); FSDP needs one "
            "to shard per block"
        )
    mp_policy = precision.fsdp_mixed_precision(compute_dtype)
    options: dict[str, Any] = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **({"mesh": mesh} if float32_root else options))
    if float32_root and mp_policy is not None:
        # The blocks still take the embedding's output in the compute dtype, as they would from a
        # root gathered in it (the same values): cast by FSDP on the way in, a block's input
        # would differ between its forward and its recomputation under activation checkpointing.
        model.get_input_embeddings().register_forward_hook(lambda _m, _args, out: out.to(compute_dtype))
    logprobs.attach(model)
    register_fsdp_forward_method(model, logprobs.METHOD)
    return model


def build_sharded(
    policy: Any,
    device: str,
    compute_dtype: Any,
    rank: int,
    copies: int = 1,
    seed: int = 0,
    base: str = "",
    float32_root: bool = False,
) -> tuple[list[Any], Any]:
    """``copies`` of the policy (the model, and the KL reference when there is one) as this
    rank's float32 shards on ``device`` (with ``policy.lora``: the base's shards in its dtype,
    the adapter's in float32, rank 0's adapter drawn from ``seed``), without any rank holding
    the whole model on its device, and only rank 0 holding it at all (in host memory, read once
    for every copy): each copy is built on the meta device (no memory), sharded
    (:func:`shard_policy`), given empty shards on ``device``, and filled from rank 0's weights,
    which it reads on the CPU and broadcasts. An 8B policy in float32 is 32 GB: eight ranks of a
    node each loading it would need 256 GB of host memory, and each GPU would hold it whole
    before sharding. Buffers that are not in the weights (rotary frequencies) are broadcast from
    rank 0 too. Every rank of the group must call it (it broadcasts). Returns the copies and, with
    ``policy.lora``, the adapter's identity (``base``: the base's digest)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from spotrl_runtime.models import load_policy, lora, resolve_model_dir
    from spotrl_runtime.training import precision

    config = AutoConfig.from_pretrained(resolve_model_dir(policy if isinstance(policy, str) else policy.model))
    adapter = getattr(policy, "lora", None)
    dtype = "float32" if isinstance(policy, str) else lora.trainer_load_dtype(policy)
    full: dict[str, Any] = {}
    buffers: dict[str, Any] = {}
    identity = None
    if rank == 0:
        whole, _ = load_policy(policy, "cpu", dtype=dtype)
        if adapter is not None:
            lora.add_adapter(whole, adapter, base="", seed=seed)
        full, buffers = whole.state_dict(), dict(whole.named_buffers())
    models = []
    for _ in range(copies):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=precision.DTYPES[dtype])
            if adapter is not None:
                identity = lora.add_adapter(model, adapter, base=base, seed=seed)
        shard_policy(model, compute_dtype, float32_root=float32_root)
        model.to_empty(device=device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, dict(full), options=options)  # it changes the dict it is given
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if rank == 0:
                    buffer.copy_(buffers[name])
                dist.broadcast(buffer, src=0)
        models.append(model.eval())
    return models, identity


class TrainerRank:
    """One rank of the trainer group (a Ray actor); see the module docstring."""

    def __init__(self, rank: int, world: int, device: str, threads: int | None = None) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.threads = threads
        """torch's threads in this process, set at :meth:`start` (None: left as they are). Set here,
        not by ``OMP_NUM_THREADS`` in a ``runtime_env``: torch reads that variable when it is
        imported, and an actor with a ``runtime_env`` of its own cannot take a worker Ray
        started beforehand (each rank waited for a process of its own)."""
        self.trainer: Any = None
        self._ckpt_group: Any = None
        self._captured: dict[str, Any] = {}
        self._barrier_token: str | None = None
        """The token of a barrier's capture: while it is held, a periodic capture is refused."""
        self._lock = threading.Lock()
        self._storages: dict[str, Any] = {}
        self._store: Any = None
        """Rank 0's rendezvous store (a TCPStore server), from :meth:`rendezvous` to :meth:`start`."""
        self._channel: Any = None
        self._plan: Any = None
        self._cancel = threading.Event()

    # ------------------------------------------------------------------ start

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address for the process group (called on rank 0 only): it serves the group's
        rendezvous store from now on, on a port the OS picked for it. (A port found free and
        bound later could be taken in between by any process on the node: it was, in CI.)"""
        import ray
        from torch.distributed import TCPStore

        host = ray.util.get_node_ip_address()
        self._store = TCPStore(host, 0, self.world, True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        return host, int(self._store.port)

    def start(
        self, master: tuple[str, int], policy: Any, config: Any, pad_token_id: int
    ) -> tuple[int, dict[str, Any] | None, str]:
        """Joins the process group, loads and shards the policy. Returns this process's pid, with
        ``policy.lora`` the adapter's identity (its base digest is of this node's files), and
        ``training.packing`` as this rank decided it for the policy (``on`` or ``off``)."""
        import torch
        import torch.distributed as dist

        from spotrl_runtime.models import lora, resolve_model_dir
        from spotrl_runtime.training import precision
        from spotrl_runtime.training.trainer import Trainer

        # Build or download the policy into this node's cache first: inside a process group,
        # transformers saves nothing on a rank other than 0 (a trainer pod has a cache of its own).
        resolve_model_dir(policy if isinstance(policy, str) else policy.model)
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        if self.device.startswith("cuda"):
            torch.cuda.set_device(0)  # Ray shows each rank its own GPU as device 0
        backend = "nccl" if self.device.startswith("cuda") else "gloo"
        store = self._store
        if store is None:
            store = dist.TCPStore(master[0], master[1], self.world, False, timeout=COLLECTIVE_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, timeout=COLLECTIVE_TIMEOUT)
        self._ckpt_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        dtype = precision.compute_dtype(config.compute_dtype)
        # The KL reference is sharded the same way (Trainer's own deep copy is for one process);
        # with LoRA it is the base itself, the adapter switched off.
        adapter = getattr(policy, "lora", None)
        copies = 2 if config.kl_coef > 0 and adapter is None else 1
        base = lora.base_digest(resolve_model_dir(policy.model)) if adapter is not None else ""
        (model, *rest), identity = build_sharded(
            policy,
            self.device,
            dtype,
            self.rank,
            copies=copies,
            seed=config.seed,
            base=base,
            float32_root=config.lm_head == "float32",
        )
        reference = rest[0].requires_grad_(False) if rest else None
        self.trainer = Trainer(model, config, pad_token_id=pad_token_id, reference=reference, adapter=identity)
        return os.getpid(), identity.to_json() if identity is not None else None, self.trainer.config.packing

    def use_packing(self, packed: bool) -> None:
        """:meth:`~spotrl_runtime.training.trainer.Trainer.use_packing` on this rank."""
        self.trainer.use_packing(packed)

    # ------------------------------------------------------------------ the step

    def score(self, rows: Sequence[Any], passes: int, step: int) -> list[Any]:
        """This rank's share of a step's scoring pass (:meth:`~spotrl_runtime.training.trainer.Trainer.score`),
        ``passes`` forward passes as every rank runs."""
        with self._lock:
            self.trainer.step = step
            return self.trainer.score(list(rows), passes)

    def train(self, updates: Sequence[tuple[Sequence[Any], int, int]], step: int) -> tuple[Any, float, float]:
        """This rank's share of one step: (its loss sums, grad norm, learning rate), by the single
        process's own :meth:`~spotrl_runtime.training.trainer.Trainer.run_updates`. ``updates``:
        per optimizer update, this rank's rows, the update's tokens over every rank and the
        passes every rank runs.

        Every rank runs the same passes, clippings and optimizer updates, so their collectives
        line up. FSDP averages gradients over the ranks; the loss is scaled by the world size, so
        the ranks' gradients add up to the update's loss, as in one process.
        """
        with self._lock:
            self.trainer.step = step
            return self.trainer.run_updates([(list(r), t, p) for r, t, p in updates], loss_scale=self.world)

    def full_state(self) -> dict[str, Any] | None:
        """The whole policy on rank 0's CPU in the compute dtype (every rank must call it: it
        gathers): what a resume keeps of an older version. Other ranks return None."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from spotrl_runtime.models import lora
        from spotrl_runtime.training import precision

        with self._lock:
            frozen = self.trainer.adapter is not None  # a LoRA policy: its adapter alone
            state = get_model_state_dict(
                self.trainer.model,
                options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=frozen),
            )
        if frozen:  # a tied head comes back beside the adapter: what the trainer trains, only
            state = {k: v for k, v in state.items() if lora.is_adapter_tensor(k)}
        return precision.to_compute_dtype(state, self.trainer.compute_dtype) if self.rank == 0 else None

    # ------------------------------------------------------------------ weights to the workers

    def open_channel(self, bucket_bytes: int, timeout: float, transport: str = "gloo") -> tuple[Any, dict[str, Any]]:
        """Rank 0 serves the weight channel (:mod:`~spotrl_runtime.generation.weights`) over
        ``transport`` (what the workers' places need: :mod:`~spotrl_runtime.generation.transport`):
        returns its endpoint and the plan of every sync (the policy's tensors in the compute dtype)."""
        from spotrl_runtime.generation.weights import ChannelHost, channel_host_address, policy_plan, unique_tensors

        self._channel = ChannelHost(channel_host_address(), backend=transport, timeout=timeout)
        dtype = str(self.trainer.compute_dtype).removeprefix("torch.")
        self._plan = policy_plan(unique_tensors(self.trainer.trained_state(keep_vars=True)), dtype, bucket_bytes)
        self._cancel = threading.Event()
        return self._channel.endpoint, self._plan.to_dict()

    def send_weights(self, plan: Mapping[str, Any], epoch: int, world: int, version: int) -> int:
        """Every rank gathers the policy one tensor at a time, in the compute dtype (each rank casts
        its shard first, so the gather moves half the bytes in bf16); rank 0 packs and sends each
        bucket to the workers of ``epoch`` while the next is gathered. No rank holds more than a
        bucket and one gathered tensor. The ranks gather every tensor of the plan even when the
        send fails or is cancelled, so that their collectives stay in step. Returns the bytes
        rank 0 sent (0 on the others)."""
        import torch
        import torch.distributed as dist

        from spotrl_runtime.generation.transport import buffer_device
        from spotrl_runtime.generation.weights import SyncPlan, WeightSyncError, send

        sync_plan = SyncPlan.from_dict(plan)
        device = "cuda" if self.device.startswith("cuda") else "cpu"
        with self._lock:
            state = self.trainer.trained_state(keep_vars=True)

            def gathered() -> Iterator[dict[str, Any] | None]:
                """Each bucket's tensors, gathered; None once the ranks agree the sync is cancelled
                (rank 0 was told: one flag reduced over the ranks before each bucket)."""
                for bucket in sync_plan.buckets:
                    flag = torch.tensor([1 if self._cancel.is_set() else 0], device=device)
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                    if int(flag.item()):
                        yield None
                        return
                    out = {}
                    for meta in bucket.tensors:
                        tensor = state[meta.name].detach().to(getattr(torch, meta.dtype))
                        out[meta.name] = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                    yield out

            buckets = gathered()
            if self.rank != 0:
                for _ in buckets:
                    pass
                return 0
            try:
                group = self._channel.group(epoch, world, self._cancel.is_set)
                return send(
                    group,
                    sync_plan,
                    version,
                    buckets,
                    device=buffer_device(self._channel.backend, device),  # gloo: CPU buffers beside a GPU rank
                    timeout=self._channel.timeout,
                    cancelled=self._cancel.is_set,
                )
            except WeightSyncError:
                self._channel.fail(epoch)
                self._cancel.set()  # the other ranks stop gathering at the next bucket
                for _ in buckets:
                    pass
                raise
            finally:
                self._cancel.clear()

    def cancel_sync(self) -> None:
        """Ends the sync at the next bucket (a barrier came): every rank is told, and they agree
        on the bucket before gathering it."""
        self._cancel.set()

    # ------------------------------------------------------------------ cuts

    def capture(self, last: bool = False) -> str:
        """Copies this rank's shards (model and optimizer) for a cut; the step may go on. The token
        names the copy for :meth:`save`. A rank keeps one copy: a new capture drops an unsaved
        periodic one, but never a barrier's (``last``): a periodic capture is then refused with
        :class:`~spotrl_runtime.training.group.CaptureRefusedError` (the barrier's cut holds
        everything it would)."""
        from spotrl_runtime.checkpoint.sharded import capture_sharded
        from spotrl_runtime.training.group import CaptureRefusedError

        with self._lock:
            if not last and self._barrier_token in self._captured:
                raise CaptureRefusedError(
                    f"rank {self.rank} holds the barrier's capture {self._barrier_token}, not yet written"
                )
            state = capture_sharded(self.trainer.model, self.trainer.optimizer)
            token = uuid.uuid4().hex
            self._captured = {token: state}
            self._barrier_token = token if last else None
            return token

    def save(self, token: str, storage_uri: str, folder: str, seconds_left: float | None) -> list[Any]:
        """Writes the captured shards into ``folder`` of the store (every rank at once, through
        the cut's own process group); returns the files this rank wrote."""
        from spotrl_runtime.api.times import Deadline
        from spotrl_runtime.checkpoint.sharded import save_sharded
        from spotrl_runtime.storage import deadline_scope

        state = self._captured.get(token)
        if state is None:
            raise RuntimeError(f"rank {self.rank}: no captured state {token} (a newer capture replaced it)")
        deadline = None if seconds_left is None else Deadline.after(seconds_left)
        try:
            with deadline_scope(deadline):
                return save_sharded(
                    state,
                    self._storage(storage_uri),
                    folder,
                    process_group=self._ckpt_group,
                    thread_count=WRITE_THREADS,
                )
        finally:
            self._captured.pop(token, None)

    def load(self, storage_uri: str, folder: str, files: Mapping[str, tuple[int, str]], step: int) -> None:
        """Loads a sharded cut into this rank's shards (DCP reshards whatever the cut's world was)."""
        from spotrl_runtime.checkpoint.sharded import apply_sharded, load_sharded, sharded_state

        with self._lock:
            state = sharded_state(self.trainer.model, self.trainer.optimizer)  # loaded in place
            load_sharded(state, self._storage(storage_uri), folder, dict(files), process_group=self._ckpt_group)
            apply_sharded(self.trainer.model, self.trainer.optimizer, state)
            self.trainer.step = step

    def stop(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def _storage(self, uri: str) -> Any:
        from spotrl_runtime.storage import open_storage

        if uri not in self._storages:
            self._storages[uri] = open_storage(uri)
        return self._storages[uri]
