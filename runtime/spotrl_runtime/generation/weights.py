"""The weight channel: policy weights from the trainer to the generation workers, directly.

No weight byte passes through the controller's pool or Ray's object store, and nobody makes a
host copy of the whole state dict:

- the **sender** (the trainer's process, or rank 0 of a trainer group) packs the weights into
  buckets of at most ``generation.weightBucketMiB``, cast to ``policy.dtype`` as they are
  packed, one tensor (one FSDP unit's parameter, gathered) at a time, and broadcasts each
  bucket while it packs the next (two buffers);
- the **receivers** (generation workers) unpack each bucket as it arrives and load it into
  their engine: vLLM through its weight-transfer engine API (``init_weight_transfer_engine``,
  ``start_weight_update``, ``update_weights``, ``finish_weight_update``) with
  :class:`ChannelEngine`, which we register in vLLM's ``WeightTransferEngineFactory``; the
  transformers backend through the same :func:`receive`.

One code path, two transports: a torch.distributed process group made for the channel alone
(not the default group: vLLM's worker and the trainer ranks have their own), over NCCL where the
tensors are on a GPU and over gloo on the CPU, so CI runs the production code.

Membership changes as spot capacity does. The sender serves the group's rendezvous (a TCPStore
on a port the OS picks); a group is formed per **epoch**, a new epoch whenever its members
change (a worker joins, restarts or is lost), under the store prefix of that epoch. Every
operation is bounded (``generation.weightSyncTimeoutSeconds``): a lost member fails the sync,
never hangs it. The version travels with every bucket and is checked on arrival, with the
bucket's index, so a receiver refuses a torn or reordered update.

Pure logic (the plan, the bucket headers) is separate from the transport: the plan is a
function of the tensors' names, shapes and dtypes only, so sender and receivers compute the same
one from the metadata the pool carries.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import torch

log = logging.getLogger("spotrl.generation")

DEFAULT_BUCKET_MIB = 512
MAX_BUCKET_MIB = 1024
ENGINE_NAME = "spotrl"
"""The name :class:`ChannelEngine` is registered under in vLLM's ``WeightTransferEngineFactory``."""
CANCELLED = -1
"""A bucket index that tells the receivers the sync was cancelled (a barrier came)."""
_HEADER_WORDS = 3  # version, bucket index (or CANCELLED), bucket bytes


class WeightSyncError(RuntimeError):
    """A sync did not complete: a member was lost or too slow, or what arrived was not what the
    plan says (the message names it)."""


class WeightSyncCancelledError(WeightSyncError):
    """The sender cancelled the sync (a barrier: the weights would never be used)."""


# ---------------------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str
    """torch's name for it, without ``torch.``: ``bfloat16``, ``float32``."""

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * _itemsize(self.dtype)


@dataclass(frozen=True)
class Bucket:
    index: int
    tensors: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class SyncPlan:
    """What one sync sends: the tensors in order, split into buckets. The same for every version
    of a policy; it travels to the workers as a dict (:meth:`to_dict`)."""

    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def tensors(self) -> tuple[TensorMeta, ...]:
        return tuple(t for b in self.buckets for t in b.tensors)

    def to_dict(self) -> dict[str, Any]:
        return {"buckets": [[[t.name, list(t.shape), t.dtype] for t in b.tensors] for b in self.buckets]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SyncPlan:
        return cls(
            tuple(
                Bucket(i, tuple(TensorMeta(str(n), tuple(int(d) for d in s), str(t)) for n, s, t in bucket))
                for i, bucket in enumerate(data["buckets"])
            )
        )


def plan_buckets(tensors: Iterable[TensorMeta], bucket_bytes: int) -> SyncPlan:
    """Splits ``tensors``, in their order, into buckets of at most ``bucket_bytes``; a tensor
    larger than that travels alone in a bucket of its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    buckets: list[Bucket] = []
    current: list[TensorMeta] = []
    size = 0
    for meta in tensors:
        if current and size + meta.nbytes > bucket_bytes:
            buckets.append(Bucket(len(buckets), tuple(current)))
            current, size = [], 0
        current.append(meta)
        size += meta.nbytes
    if current:
        buckets.append(Bucket(len(buckets), tuple(current)))
    return SyncPlan(tuple(buckets))


def policy_plan(named: Iterable[tuple[str, Any]], dtype: str, bucket_bytes: int) -> SyncPlan:
    """The plan for a policy's tensors (``(name, tensor)``, each once: tied weights travel once),
    sent in ``dtype``."""
    return plan_buckets((TensorMeta(name, tuple(t.shape), dtype) for name, t in named), bucket_bytes)


def unique_tensors(state: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """``state``'s entries without aliases: a tied LM head is the embedding, sent once (vLLM and
    the transformers backend tie it again on their side)."""
    seen: set[int] = set()
    for name, tensor in state.items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield name, tensor


def header(version: int, index: int, nbytes: int) -> list[int]:
    return [version, index, nbytes]


def check_header(got: Sequence[int], version: int, bucket: Bucket) -> None:
    """Raises :class:`WeightSyncError` unless ``got`` announces ``bucket`` of ``version``."""
    if got[1] == CANCELLED:
        raise WeightSyncCancelledError(f"the sender cancelled the sync of weight version {version}")
    want = header(version, bucket.index, bucket.nbytes)
    if list(got) != want:
        raise WeightSyncError(
            f"weight sync: expected bucket {bucket.index} of version {version} ({bucket.nbytes} bytes), got "
            f"bucket {got[1]} of version {got[0]} ({got[2]} bytes); the update is torn, its weights are not used"
        )


# ---------------------------------------------------------------------------------- transport


@dataclass(frozen=True)
class ChannelAddress:
    """Where and as what a member joins the channel's group of one epoch."""

    host: str
    port: int
    epoch: int
    rank: int
    world: int
    backend: str = "gloo"
    """``gloo`` (CPU tensors) or ``nccl`` (GPU tensors)."""
    timeout: float = 120.0

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("host", "port", "epoch", "rank", "world", "backend", "timeout")}


@dataclass(frozen=True)
class ChannelEndpoint:
    """Where a sender in another process serves the channel's rendezvous."""

    host: str
    port: int
    backend: str = "gloo"
    timeout: float = 120.0

    def address(self, epoch: int, world: int, rank: int = 0) -> ChannelAddress:
        return ChannelAddress(self.host, self.port, epoch, rank, world, self.backend, self.timeout)


def _abort_key(epoch: int) -> str:
    return f"spotrl-weights/{epoch}/abort"


def open_group(address: ChannelAddress, store: Any) -> Any:
    """The channel's process group for ``address.epoch`` (blocks until every member arrives, at
    most ``timeout``), through ``store``: the sender's TCPStore, or a member's client of it."""
    import torch.distributed as dist

    timeout = dt.timedelta(seconds=address.timeout)
    prefixed = dist.PrefixStore(f"spotrl-weights/{address.epoch}", store)
    if address.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, address.rank, address.world, options)
    return dist.ProcessGroupGloo(prefixed, address.rank, address.world, timeout)


def _wait(work: Any, timeout: float, cancelled: Callable[[], bool] | None = None) -> bool:
    """Waits for one collective; False if ``cancelled`` said yes first. Raises
    :class:`WeightSyncError` past ``timeout`` or when the collective failed (a member lost)."""
    deadline = time.monotonic() + timeout
    try:
        while not work.is_completed():
            if cancelled is not None and cancelled():
                return False
            if time.monotonic() > deadline:
                raise WeightSyncError(f"a weight-sync collective did not complete within {timeout:.0f} s")
            time.sleep(0.001)
        work.wait()
    except WeightSyncError:
        raise
    except Exception as err:
        raise WeightSyncError(f"weight sync failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}") from err
    return True


def _pack(buffer: torch.Tensor, bucket: Bucket, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copies (and casts) ``bucket``'s tensors into ``buffer``'s first bytes."""
    import torch

    offset = 0
    with torch.no_grad():
        for meta in bucket.tensors:
            target = buffer[offset : offset + meta.nbytes].view(_dtype(meta.dtype)).view(meta.shape)
            target.copy_(tensors[meta.name])
            offset += meta.nbytes


def unpack(buffer: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Views of ``bucket``'s tensors in ``buffer`` (valid until the buffer is reused)."""
    out, offset = [], 0
    for meta in bucket.tensors:
        out.append((meta.name, buffer[offset : offset + meta.nbytes].view(_dtype(meta.dtype)).view(meta.shape)))
        offset += meta.nbytes
    return out


def send(
    group: Any,
    plan: SyncPlan,
    version: int,
    buckets: Iterator[Mapping[str, torch.Tensor] | None],
    *,
    device: str = "cpu",
    timeout: float = 120.0,
    cancelled: Callable[[], bool] | None = None,
) -> int:
    """Broadcasts ``version`` from rank 0 of ``group``: each bucket's tensors come from ``buckets``
    (one mapping per bucket of ``plan``, produced lazily: a gathered tensor is freed once
    packed). Packs the next bucket while the previous is on the wire. Returns the bytes sent;
    on ``cancelled``, or a None from ``buckets``, sends the receivers a cancel and raises
    :class:`WeightSyncCancelledError`."""
    import torch

    size = max((b.nbytes for b in plan.buckets), default=0)
    buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(min(2, len(plan.buckets)))]
    heads = [torch.empty(_HEADER_WORDS, dtype=torch.int64, device=device) for _ in buffers]
    pending: list[Any] = []
    sent = 0
    for n, (bucket, tensors) in enumerate(zip(plan.buckets, buckets, strict=True)):
        slot = n % len(buffers)
        # The slot's previous bucket must be off the wire before it is packed again.
        if len(pending) == len(buffers):
            for work in pending.pop(0):
                if not _wait(work, timeout, cancelled):
                    _cancel(group, version, device)
        if tensors is None or (cancelled is not None and cancelled()):
            return _cancel(group, version, device)
        _pack(buffers[slot], bucket, tensors)
        heads[slot].copy_(torch.tensor(header(version, bucket.index, bucket.nbytes)))
        pending.append((group.broadcast(heads[slot], 0), group.broadcast(buffers[slot][: bucket.nbytes], 0)))
        sent += bucket.nbytes
    for works in pending:
        for work in works:
            if not _wait(work, timeout, cancelled):
                _cancel(group, version, device)
    return sent


def _cancel(group: Any, version: int, device: str) -> NoReturn:
    import torch

    with contextlib.suppress(Exception):  # the group may be broken: the cancel is best effort
        head = torch.tensor(header(version, CANCELLED, 0), device=device)
        group.broadcast(head, 0)
    raise WeightSyncCancelledError(f"the sync of weight version {version} was cancelled")


def receive(
    group: Any,
    plan: SyncPlan,
    version: int,
    load: Callable[[list[tuple[str, torch.Tensor]]], None],
    *,
    device: str = "cpu",
    timeout: float = 120.0,
    aborted: Callable[[], bool] | None = None,
) -> int:
    """Receives ``version`` on ``group`` (as a member, rank > 0), checking each bucket's header,
    and hands each bucket's tensors to ``load`` as it arrives, while the next one lands. Each
    bucket gets a buffer of its own, so the tensors stay valid for as long as the loader keeps
    them: vLLM's layerwise reload keeps a layer's until the layer is whole, which may be a
    bucket or more later. Returns the bytes received. ``aborted``: whether the sender ended the
    epoch (the sync failed elsewhere)."""
    import torch

    if not plan.buckets:
        return 0

    def post(i: int) -> tuple[Any, Any, Any, Any]:
        head = torch.empty(_HEADER_WORDS, dtype=torch.int64, device=device)
        buffer = torch.empty(plan.buckets[i].nbytes, dtype=torch.uint8, device=device)
        return head, buffer, group.broadcast(head, 0), group.broadcast(buffer, 0)

    ended = f"the sender ended the sync of weight version {version}"
    got = 0
    posted = post(0)
    for i, bucket in enumerate(plan.buckets):
        head, buffer, head_work, data_work = posted
        if not _wait(head_work, timeout, aborted):
            raise WeightSyncCancelledError(ended)
        check_header([int(x) for x in head.tolist()], version, bucket)
        if not _wait(data_work, timeout, aborted):
            raise WeightSyncCancelledError(ended)
        if i + 1 < len(plan.buckets):
            posted = post(i + 1)  # the next bucket lands while this one loads
        load(unpack(buffer, bucket))
        got += bucket.nbytes
    return got


# ------------------------------------------------------------------------------ the two ends


class ChannelHost:
    """The sender's end: serves the rendezvous store and keeps the group of the current epoch."""

    def __init__(self, host: str, *, backend: str = "gloo", timeout: float = 120.0) -> None:
        import torch.distributed as dist

        self.host = host
        self.backend = backend
        self.timeout = timeout
        self._store = dist.TCPStore(
            host, 0, is_master=True, timeout=dt.timedelta(seconds=timeout), wait_for_workers=False
        )
        self.port = int(self._store.port)
        # A client of its own for the epoch's end: a store connection blocks behind a pending
        # wait (a formation waiting for its members holds one).
        self._signals = dist.TCPStore(host, self.port, is_master=False, timeout=dt.timedelta(seconds=timeout))
        self._group: Any = None
        self._epoch: int | None = None
        self._formed: set[int] = set()

    def address(self, epoch: int, world: int, rank: int = 0) -> ChannelAddress:
        return ChannelAddress(self.host, self.port, epoch, rank, world, self.backend, self.timeout)

    @property
    def endpoint(self) -> ChannelEndpoint:
        return ChannelEndpoint(self.host, self.port, self.backend, self.timeout)

    def group(self, epoch: int, world: int, cancelled: Callable[[], bool] | None = None) -> Any:
        """The group of ``epoch``, formed on first use: every member must be joining it.
        ``cancelled`` (a barrier) ends the wait at once."""
        if self._epoch == epoch:
            return self._group
        if epoch in self._formed:
            # Its rendezvous keys (the members' addresses) are still in the store: a member
            # would be sent to a process that may be gone. One channel per pool.
            raise WeightSyncError(f"epoch {epoch} was formed on this channel before; epochs must not repeat")
        self._formed.add(epoch)
        _bury(self._group)
        self._group, self._epoch = None, None
        try:
            self._group = _form(self.address(epoch, world), self._store, cancelled)
        except WeightSyncError:
            self.fail(epoch)
            raise
        self._epoch = epoch
        return self._group

    def fail(self, epoch: int) -> None:
        """Ends ``epoch`` for its members at once (they look for it while they join or receive)
        and drops its group: the next sync forms a new epoch."""
        with contextlib.suppress(Exception):
            self._signals.set(_abort_key(epoch), "1")
        _bury(self._group)
        self._group, self._epoch = None, None


def _bury(group: Any) -> None:
    """Keeps a dropped group alive on a parked daemon thread until the process ends. A process
    group's destructor waits for its pending operations, and a failed or cancelled sync leaves
    some (a broadcast to a member that stopped, or that a barrier stopped) until the channel's
    timeout: on the trainer's thread that would hold up a barrier, and at exit the process."""
    if group is not None:
        threading.Thread(target=_hold, args=([group],), name="weights-buried", daemon=True).start()


def _hold(graves: list[Any]) -> None:
    threading.Event().wait()  # ``graves`` lives in this frame, which the interpreter never frees


def _form(address: ChannelAddress, store: Any, cancelled: Callable[[], bool] | None) -> Any:
    """:func:`open_group` on a thread of its own, so that ``cancelled`` (a barrier, or the
    epoch's end) stops the wait at once; a formation left behind is abandoned with its epoch."""
    formed: list[Any] = []
    failed: list[BaseException] = []

    def form() -> None:
        try:
            formed.append(open_group(address, store))
        except BaseException as err:  # reported to the waiting thread
            failed.append(err)

    thread = threading.Thread(target=form, name=f"weights-epoch-{address.epoch}", daemon=True)
    thread.start()
    deadline = time.monotonic() + address.timeout
    while thread.is_alive():
        if cancelled is not None and cancelled():
            raise WeightSyncCancelledError(f"the weight channel's epoch {address.epoch} was cancelled while it formed")
        if time.monotonic() > deadline:
            raise WeightSyncError(
                f"the weight channel's {address.world - 1} member(s) did not join within {address.timeout:.0f} s"
            )
        thread.join(0.01)
    if failed:
        raise WeightSyncError(
            f"the weight channel's epoch {address.epoch} did not form (its {address.world - 1} member(s) did not join "
            f"within {address.timeout:.0f} s, or one failed): {str(failed[0]).splitlines()[0][:300]}"
        ) from failed[0]
    return formed[0]


def channel_host_address() -> str:
    """This process's address as the channel's members reach it: its Ray node's, or loopback."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception as err:  # Ray not installed or not connected: a single-machine test
        log.debug("no Ray node address: %s", err)
    return "127.0.0.1"


class WeightSender:
    """Sends one policy's weights over a :class:`ChannelHost`: ``tensors`` names them (called
    at each sync: the live weights, never copied whole), ``dtype`` is what they travel in."""

    def __init__(
        self,
        tensors: Callable[[], Mapping[str, torch.Tensor]],
        dtype: str,
        channel: ChannelHost,
        bucket_bytes: int,
        device: str = "cpu",
    ) -> None:
        self.tensors = tensors
        self.channel = channel
        self.device = device
        self.plan = policy_plan(unique_tensors(tensors()), dtype, bucket_bytes)

    def send(self, epoch: int, world: int, version: int, cancelled: Callable[[], bool] | None = None) -> int:
        """Sends ``version`` (the weights ``tensors`` returns now; they must not change until it
        returns) to the ``world - 1`` members of ``epoch``; returns the bytes sent.
        Raises :class:`WeightSyncError` (a member lost: the next sync forms a new epoch) or
        :class:`WeightSyncCancelledError`."""
        group = self.channel.group(epoch, world, cancelled)
        state = self.tensors()
        try:
            return send(
                group,
                self.plan,
                version,
                ({t.name: state[t.name] for t in bucket.tensors} for bucket in self.plan.buckets),
                device=self.device,
                timeout=self.channel.timeout,
                cancelled=cancelled,
            )
        except WeightSyncError:
            self.channel.fail(epoch)
            raise


class ChannelMember:
    """A receiver's end: the group of the epoch it was last told to join. While it joins or
    receives it also looks for the sender ending the epoch (:meth:`ChannelHost.fail`), so that
    a sync that failed elsewhere (another member lost) ends here at once, not at the timeout."""

    def __init__(self) -> None:
        self._group: Any = None
        self._address: ChannelAddress | None = None
        self._store: Any = None
        self._signals: Any = None
        """A second client of the sender's store, to look for the epoch's end (the first is busy
        while a formation waits)."""
        self._store_at: tuple[str, int] | None = None
        self._looked = 0.0

    def join(self, address: ChannelAddress) -> None:
        """Joins ``address.epoch``'s group unless already in it (blocks until every member and
        the sender arrive, at most ``address.timeout``)."""
        import torch.distributed as dist

        if self._group is not None and self._address == address:
            return
        _bury(self._group)
        self._group, self._address = None, None
        try:
            if self._store_at != (address.host, address.port):
                timeout = dt.timedelta(seconds=address.timeout)
                self._store = dist.TCPStore(address.host, address.port, is_master=False, timeout=timeout)
                self._signals = dist.TCPStore(address.host, address.port, is_master=False, timeout=timeout)
                self._store_at = (address.host, address.port)
            self._address = address
            self._group = _form(address, self._store, self._aborted)
        except Exception as err:
            self._address = None
            if isinstance(err, WeightSyncError):
                raise
            raise WeightSyncError(f"joining the weight channel's epoch {address.epoch} failed: {err}") from err

    @property
    def device(self) -> str:
        return "cuda" if self._address is not None and self._address.backend == "nccl" else "cpu"

    def receive(self, plan: SyncPlan, version: int, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
        if self._group is None or self._address is None:
            raise WeightSyncError("receive before joining the weight channel")
        try:
            timeout = self._address.timeout
            return receive(self._group, plan, version, load, device=self.device, timeout=timeout, aborted=self._aborted)
        except WeightSyncError:
            _bury(self._group)  # a failed group is never used again
            self._group, self._address = None, None
            raise

    def _aborted(self) -> bool:
        """Whether the sender ended this epoch (asked of its store at most every 50 ms)."""
        now = time.monotonic()
        if self._address is None or now - self._looked < 0.05:
            return False
        self._looked = now
        try:
            return bool(self._signals.check([_abort_key(self._address.epoch)]))
        except Exception:  # the sender's store is gone: so is the sender
            return True


# ------------------------------------------------------------------------- vLLM's engine API


def register_vllm_engine() -> None:
    """Registers :class:`ChannelEngine` in vLLM's ``WeightTransferEngineFactory`` (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if ENGINE_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, _engine_class())


_ENGINE: Any = None


def _engine_class() -> Any:
    """Built on first use: vLLM is imported only where a vLLM worker runs."""
    global _ENGINE
    if _ENGINE is not None:
        return _ENGINE
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class InitInfo(WeightTransferInitInfo):
        address: dict[str, Any]
        """A :class:`ChannelAddress` as a dict (``to_dict``)."""

    @dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        version: int = 0
        plan: dict[str, Any] | None = None

    class ChannelEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
        """vLLM's end of the weight channel: the worker's vLLM calls it with the model's
        ``load_weights`` (layerwise reload of checkpoint-format tensors) for each bucket."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

        def __init__(self, config: Any, parallel_config: Any, model: Any) -> None:
            super().__init__(config, parallel_config, model)
            self.member: ChannelMember | None = None
            self.received = 0

        def init_transfer_engine(self, init_info: Any) -> None:
            # A worker with tensor parallelism is as many members as it has ranks: the pool
            # gives it the first, each rank takes the next (every rank loads its own shard
            # of each bucket it receives whole).
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            address = ChannelAddress(**init_info.address)
            address = replace(address, rank=address.rank + get_tensor_model_parallel_rank())
            if self.member is None:
                self.member = ChannelMember()
            self.member.join(address)

        def receive_weights(self, update_info: Any, load_weights: Callable[..., Any]) -> None:
            if self.member is None:
                raise WeightSyncError("vLLM's weight channel was not initialised (init_weight_transfer_engine)")
            plan = SyncPlan.from_dict(update_info.plan or {"buckets": []})

            # Each bucket has a buffer of its own (``receive``): vLLM may keep its tensors.
            self.received = self.member.receive(plan, update_info.version, load_weights)

        def shutdown(self) -> None:
            self.member = None

        @staticmethod
        def trainer_send_weights(iterator: Iterator[tuple[str, Any]], trainer_args: Any) -> None:
            """vLLM's trainer-side entry: ``trainer_args`` holds ``group`` (the epoch's),
            ``plan`` (a :class:`SyncPlan`) and ``version``; the tensors are sent by
            :func:`send`, bucket by bucket, as a :class:`WeightSender` sends them."""
            state = dict(iterator)  # references, not copies
            plan: SyncPlan = trainer_args["plan"]
            send(
                trainer_args["group"],
                plan,
                int(trainer_args["version"]),
                ({t.name: state[t.name] for t in b.tensors} for b in plan.buckets),
                device=trainer_args.get("device", "cpu"),
                timeout=float(trainer_args.get("timeout", 120.0)),
            )

    ChannelEngine.__name__ = ChannelEngine.__qualname__ = "ChannelEngine"
    _ENGINE = ChannelEngine
    return _ENGINE


# ------------------------------------------------------------------------------------ helpers


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _itemsize(name: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1}[name]


def give_weights(
    backend: Any,
    state: Mapping[str, torch.Tensor],
    version: int,
    *,
    dtype: str | None = None,
    timeout: float = 120.0,
    bucket_bytes: int = DEFAULT_BUCKET_MIB << 20,
) -> int:
    """Sends ``state`` to a generation backend driven in this process (tests, the GPU check),
    over the channel as a sync does: a sender thread on loopback (gloo), the backend joining and
    receiving here. ``dtype``: what the weights travel in (default: the first tensor's)."""
    dtype = dtype or str(next(iter(state.values())).dtype).removeprefix("torch.")
    channel = ChannelHost("127.0.0.1", timeout=timeout)
    sender = WeightSender(lambda: state, dtype, channel, bucket_bytes)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            sender.send(1, 2, version)
        except BaseException as err:  # raised in the caller's thread below
            failed.append(err)

    thread = threading.Thread(target=run, name="give-weights", daemon=True)
    thread.start()
    backend.join_channel(channel.address(1, 2, rank=1))
    got = int(backend.receive_weights(sender.plan, version))  # a refusal leaves the sender to time out
    thread.join(timeout)
    if failed:
        raise failed[0]
    return got
