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
(not the default group: vLLM's worker and the trainer ranks have their own), over NCCL between
GPUs and over gloo where either end is on the CPU or both share one GPU, so CI runs the
production code. The transport is chosen from where the sender and each member are
(:mod:`~spotrl_runtime.generation.transport`), and carried to the members in their address.

Membership changes as spot capacity does. The sender serves the group's rendezvous (a TCPStore
on a port the OS picks); a group is formed per **epoch**, a new epoch whenever its members
change (a worker joins, restarts or is lost, or an epoch failed), under the store prefix of that
epoch. Each sync goes through a lifecycle (:mod:`~spotrl_runtime.generation.sync_lifecycle`):
the members announce "drained, ready for version v" over the store before the sender's clock
starts, then the group forms (a new epoch's first sync) and the buckets go; every step is
bounded (``generation.weightSyncTimeoutSeconds``) and abortable (the epoch's abort key, which
every end watches). A lost member ends the epoch, never hangs it, and every epoch's group is
destroyed (:func:`retire`) at both ends. The transport plugs in under this lifecycle
(:class:`GroupTransport`). The version travels with every bucket and is checked on arrival,
with the bucket's index, so a receiver refuses a torn or reordered update.

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
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from spotrl_runtime.failpoints import failpoint
from spotrl_runtime.generation.sync_lifecycle import LifecycleError, MemberSync, Phase, SenderSync
from spotrl_runtime.generation.transport import buffer_device

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


def _ready_key(epoch: int, version: int, rank: int) -> str:
    """A member's announcement: drained, ready for ``version`` (see :mod:`.sync_lifecycle`)."""
    return f"spotrl-sync/{epoch}/{version}/ready/{rank}"


def _go_key(epoch: int, version: int) -> str:
    """Every member announced: the sender's clock started."""
    return f"spotrl-sync/{epoch}/{version}/go"


def _beat_key(epoch: int, version: int) -> str:
    """The sender's heartbeat while it waits for announcements (bounds a member's wait for go)."""
    return f"spotrl-sync/{epoch}/{version}/beat"


class GroupTransport(Protocol):
    """What carries one epoch's bytes, under the lifecycle: it forms the epoch's group (called
    on a formation thread, so a blocking formation is still bounded and cancellable), and ends
    one (``abort``: stop its pending collectives now where the transport can; ``destroy``: free
    it, called on the reaper thread, never on the trainer's). A GPU transport plugs in here."""

    def open(self, address: ChannelAddress, store: Any) -> Any: ...

    def abort(self, group: Any) -> None: ...


class _Gloo:
    def open(self, address: ChannelAddress, store: Any) -> Any:
        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, address.rank, address.world, dt.timedelta(seconds=address.timeout))

    def abort(self, group: Any) -> None:
        # Gloo cannot end a collective in progress (its abort is a no-op): a pending one ends when
        # the peers drop the epoch (their sockets close), or at the group's timeout.
        return None


class _Nccl:
    def open(self, address: ChannelAddress, store: Any) -> Any:
        import torch.distributed as dist

        options = dist.ProcessGroupNCCL.Options()
        options._timeout = dt.timedelta(seconds=address.timeout)
        return dist.ProcessGroupNCCL(store, address.rank, address.world, options)

    def abort(self, group: Any) -> None:
        group.abort()  # ncclCommAbort: pending collectives end now


TRANSPORTS: dict[str, GroupTransport] = {"gloo": _Gloo(), "nccl": _Nccl()}
"""The channel's transports by name (:attr:`ChannelAddress.backend`)."""


def open_group(address: ChannelAddress, store: Any) -> Any:
    """The channel's process group for ``address.epoch`` (blocks until every member arrives, at
    most ``timeout``), through ``store``: the sender's TCPStore, or a member's client of it."""
    import torch.distributed as dist

    transport = TRANSPORTS.get(address.backend)
    if transport is None:
        raise WeightSyncError(f"the weight channel has no transport {address.backend!r} (one of {sorted(TRANSPORTS)})")
    return transport.open(address, dist.PrefixStore(f"spotrl-weights/{address.epoch}", store))


class Link:
    """One epoch's process group at one end of the channel, counted from its formation until
    the reaper destroyed it (:func:`live_links`): as membership churns, the count stays flat."""

    def __init__(self, group: Any, backend: str, epoch: int) -> None:
        self.group: Any = group
        self.backend = backend
        self.epoch = epoch
        with _LINKS_LOCK:
            _LINKS.add(id(self))

    def broadcast(self, tensor: torch.Tensor, root: int) -> Any:
        return self.group.broadcast(tensor, root)

    def destroy(self) -> None:
        """Aborts what the transport can, then drops the group: its destructor waits for the
        collectives still pending (see :class:`_Gloo`), so this runs on the reaper."""
        group, self.group = self.group, None
        try:
            if group is not None:
                with contextlib.suppress(Exception):
                    TRANSPORTS[self.backend].abort(group)
                del group
        finally:
            with _LINKS_LOCK:
                _LINKS.discard(id(self))


_LINKS: set[int] = set()
_LINKS_LOCK = threading.Lock()


def live_links() -> int:
    """The channel's process groups alive in this process (formed and not yet destroyed)."""
    with _LINKS_LOCK:
        return len(_LINKS)


def retire(link: Link | None) -> None:
    """Destroys ``link`` on a thread of its own, never on the trainer's: a group whose epoch
    failed mid-collective still has that collective pending, and its destructor waits for it
    (at once where the peer's process died, else within the channel's timeout on gloo: its
    peers are destroying theirs meanwhile). A thread each, so that one such wait holds up no
    other epoch's group: the live groups are the current one and those failed within the
    timeout, however many epochs come and go."""
    if link is not None:
        threading.Thread(target=_destroy, args=(link,), name=f"weights-reap-{link.epoch}", daemon=True).start()


def _destroy(link: Link) -> None:
    # ``link`` is held by this frame, which the interpreter never frees at exit: a group with a
    # pending collective is then never destroyed by the exiting thread (it would wait for it).
    try:
        link.destroy()
    except Exception as err:  # the process goes on; the group is left to the collector
        log.warning("destroying the weight channel's epoch %d failed: %s", link.epoch, err)


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
        failpoint("weights.send", bucket.index)  # a test kills the sender here, mid-send
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


BEAT_SECONDS = 0.5
"""How often the side that waits for announcements refreshes its heartbeat."""


class ChannelWatch:
    """The sync lifecycle's view of a channel's store (:mod:`.sync_lifecycle`), from where the
    sync is driven (the pool, in the controller; the sender itself where no pool is): the
    members' announcements, and the sender's go, heartbeat and abort. A client of its own: the
    sender's may be busy in a formation."""

    def __init__(self, host: str, port: int, timeout: float, store: Any = None) -> None:
        """``store``: a client to use (the sender's own); else one is made (at most ``timeout``)."""
        import torch.distributed as dist

        self.at = (host, port)
        if store is None:
            store = dist.TCPStore(host, port, is_master=False, timeout=dt.timedelta(seconds=timeout))
        self._store = store
        self._beats = 0

    def announced(self, epoch: int, version: int, ranks: Iterable[int]) -> set[int]:
        return {r for r in ranks if self._store.check([_ready_key(epoch, version, r)])}

    def go(self, epoch: int, version: int) -> None:
        self._store.set(_go_key(epoch, version), "1")

    def beat(self, epoch: int, version: int) -> None:
        self._beats += 1
        self._store.set(_beat_key(epoch, version), str(self._beats))

    def abort(self, epoch: int) -> None:
        with contextlib.suppress(Exception):  # the store gone: so is every member's wait on it
            self._store.set(_abort_key(epoch), "1")

    def aborted(self, epoch: int) -> bool:
        try:
            return bool(self._store.check([_abort_key(epoch)]))
        except Exception:  # the store gone (the sender's process): the epoch is over
            return True


def await_announcements(
    watch: ChannelWatch,
    sync: SenderSync,
    *,
    look: Callable[[], tuple[Collection[str], Mapping[str, str]]] | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> SenderSync:
    """Drives ``sync`` through its announce phase: until every member announced (then says go:
    the sender's clock starts), one was lost or too slow, or ``cancelled`` (then aborts the
    epoch for the members). ``look``: the members still draining and those lost, asked each
    round (the pool drives its calls in it, at most 0.1 s); without it nobody drains."""
    ranks = [r for member in sync.members.values() for r in member]
    beat_at = 0.0
    while True:
        draining, lost = look() if look is not None else ((), {})
        try:
            announced = watch.announced(sync.epoch, sync.version, ranks)
            phase = sync.observe(
                time.monotonic(),
                announced=announced,
                draining=draining,
                lost=lost,
                cancelled=cancelled is not None and cancelled(),
            )
            if phase in (Phase.FORM, Phase.SEND):
                watch.go(sync.epoch, sync.version)
                return sync
            if phase.ended:
                watch.abort(sync.epoch)
                return sync
            if time.monotonic() - beat_at > BEAT_SECONDS:
                watch.beat(sync.epoch, sync.version)
                beat_at = time.monotonic()
        except LifecycleError:
            raise
        except Exception as err:  # the sender's store is gone: so is the sender
            sync.failed(f"the weight channel's store did not answer: {str(err).splitlines()[0][:300]}")
            return sync
        if look is None:
            time.sleep(0.01)


class ChannelHost:
    """The sender's end: serves the rendezvous store and keeps the group of the current epoch
    (one at most: a group left behind is destroyed by the reaper, :func:`retire`)."""

    def __init__(self, host: str, *, backend: str = "gloo", timeout: float = 120.0) -> None:
        import torch.distributed as dist

        self.host = host
        self.backend = backend
        self.timeout = timeout
        self._store = dist.TCPStore(
            host, 0, is_master=True, timeout=dt.timedelta(seconds=timeout), wait_for_workers=False
        )
        self.port = int(self._store.port)
        # The lifecycle's keys through a client of its own: a store connection serves one
        # request at a time, and a formation's wait holds the first (the master's own).
        self._watch: ChannelWatch | None = None
        self._formations = _FormationStore(host, self.port, timeout, client=self._store)
        self._link: Link | None = None
        self._formed: set[int] = set()

    def address(self, epoch: int, world: int, rank: int = 0) -> ChannelAddress:
        return ChannelAddress(self.host, self.port, epoch, rank, world, self.backend, self.timeout)

    @property
    def endpoint(self) -> ChannelEndpoint:
        return ChannelEndpoint(self.host, self.port, self.backend, self.timeout)

    @property
    def watch(self) -> ChannelWatch:
        if self._watch is None:
            self._watch = ChannelWatch(self.host, self.port, self.timeout)
        return self._watch

    def ready(self, epoch: int, version: int, world: int, cancelled: Callable[[], bool] | None = None) -> None:
        """Waits for the ``world - 1`` members of ``epoch`` to announce they are ready for
        ``version``, each within the channel's timeout, then starts the sender's clock (what the
        pool does where there is one). Raises :class:`WeightSyncError` (one did not announce) or
        :class:`WeightSyncCancelledError`."""
        members = {f"rank {r}": (r,) for r in range(1, world)}
        formed = self._link is not None and self._link.epoch == epoch
        sync = SenderSync(epoch, version, members, self.timeout, formed=formed)
        await_announcements(self.watch, sync, cancelled=cancelled)
        if sync.phase is Phase.CANCELLED:
            raise WeightSyncCancelledError(sync.reason)
        if sync.phase is Phase.FAILED:
            self.fail(epoch)
            raise WeightSyncError(f"the weight channel's member {sync.reason}")

    def group(self, epoch: int, world: int, cancelled: Callable[[], bool] | None = None) -> Link:
        """The group of ``epoch``, formed on first use (every member announced, so each is
        joining it): within the channel's timeout; ``cancelled`` (a barrier) ends the wait at
        once. The previous epoch's group is destroyed."""
        if self._link is not None and self._link.epoch == epoch:
            return self._link
        if epoch in self._formed:
            # Its rendezvous keys (the members' addresses) are still in the store: a member
            # would be sent to a process that may be gone. One channel per pool.
            raise WeightSyncError(f"epoch {epoch} was formed on this channel before; epochs must not repeat")
        self._formed.add(epoch)
        retire(self._link)
        self._link = None
        try:
            self._link = _form(self.address(epoch, world), self._formations, cancelled)
        except WeightSyncError:
            self.fail(epoch)
            raise
        return self._link

    def ended(self, epoch: int) -> _EpochEnd:
        """Asks whether a member ended ``epoch`` (its receive failed), at most every 50 ms."""
        return _EpochEnd(self.watch, epoch)

    def fail(self, epoch: int) -> None:
        """Ends ``epoch`` for its members at once (they look for it while they wait, form or
        receive) and destroys its group: the next sync forms a new epoch."""
        with contextlib.suppress(Exception):
            self.watch.abort(epoch)
        self.close()

    def close(self) -> None:
        """Destroys the current epoch's group (on the reaper)."""
        retire(self._link)
        self._link = None


class _EpochEnd:
    """Whether the abort key of an epoch is set (a member ended it), looked up at most every
    50 ms; ``seen`` stays True once it was."""

    def __init__(self, watch: ChannelWatch, epoch: int) -> None:
        self.watch, self.epoch = watch, epoch
        self.seen = False
        self._looked = 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self.seen and now - self._looked >= 0.05:
            self._looked = now
            self.seen = self.watch.aborted(self.epoch)
        return self.seen


class _FormationStore:
    """One end's client of the channel's store for its formations, made on first use. A
    formation given up still waits on it (until the store's timeout), and a client serves one
    request at a time: after one, the next formation gets a new client. (Not a client per
    formation: the store's server stalls a new connection for seconds now and then.)"""

    def __init__(self, host: str, port: int, timeout: float, client: Any = None) -> None:
        self.at = (host, port)
        self.timeout = timeout
        self._client: Any = client

    def get(self) -> Any:
        import torch.distributed as dist

        client = self._client
        if client is None:
            client = dist.TCPStore(*self.at, is_master=False, timeout=dt.timedelta(seconds=self.timeout))
            self._client = client
        return client

    def renew(self) -> None:
        self._client = None


class _Formation:
    """:func:`open_group` on a thread of its own, so that the waiting thread can give up (a
    barrier, the epoch's end, the bound) at once; a group formed after it gave up is retired."""

    def __init__(self, address: ChannelAddress, store: _FormationStore) -> None:
        self.address = address
        self.store = store
        self.link: Link | None = None
        self.error: BaseException | None = None
        self._abandoned = False
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"weights-epoch-{address.epoch}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        a = self.address
        try:
            link = Link(open_group(a, self.store.get()), a.backend, a.epoch)
        except BaseException as err:  # reported to the waiting thread
            self.error = err
            return
        with self._lock:
            if self._abandoned:
                retire(link)
            else:
                self.link = link

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            if self.thread.is_alive():
                self.store.renew()  # this formation's wait holds the client
            retire(self.link)
            self.link = None


def _form(address: ChannelAddress, store: _FormationStore, cancelled: Callable[[], bool] | None) -> Link:
    """The group of ``address.epoch``, within ``address.timeout``; ``cancelled`` (a barrier, or
    the epoch's end) stops the wait at once."""
    formation = _Formation(address, store)
    deadline = time.monotonic() + address.timeout
    try:
        while formation.thread.is_alive():
            if cancelled is not None and cancelled():
                raise WeightSyncCancelledError(
                    f"the weight channel's epoch {address.epoch} was cancelled while it formed"
                )
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"the weight channel's {address.world - 1} member(s) did not join within {address.timeout:.0f} s"
                )
            formation.thread.join(0.01)
    except BaseException:
        formation.abandon()
        raise
    if formation.error is not None or formation.link is None:
        err = formation.error
        raise WeightSyncError(
            f"the weight channel's epoch {address.epoch} did not form (its {address.world - 1} member(s) did not join "
            f"within {address.timeout:.0f} s, or one failed): {str(err).splitlines()[0][:300] if err else 'no group'}"
        ) from err
    return formation.link


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
        self.device = buffer_device(channel.backend, device)  # gloo: CPU buffers, whatever the trainer's device
        self.plan = policy_plan(unique_tensors(tensors()), dtype, bucket_bytes)

    def send(self, epoch: int, world: int, version: int, cancelled: Callable[[], bool] | None = None) -> int:
        """Sends ``version`` (the weights ``tensors`` returns now; they must not change until it
        returns) to the ``world - 1`` members of ``epoch``; returns the bytes sent.
        Raises :class:`WeightSyncError` (a member lost: the next sync forms a new epoch) or
        :class:`WeightSyncCancelledError`."""
        ended = self.channel.ended(epoch)
        state = self.tensors()
        try:
            group = self.channel.group(epoch, world, cancelled)
            return send(
                group,
                self.plan,
                version,
                ({t.name: state[t.name] for t in bucket.tensors} for bucket in self.plan.buckets),
                device=self.device,
                timeout=self.channel.timeout,
                cancelled=lambda: (cancelled is not None and cancelled()) or ended(),
            )
        except WeightSyncError as err:
            self.channel.fail(epoch)
            if isinstance(err, WeightSyncCancelledError) and ended.seen:
                raise WeightSyncError(
                    f"a member ended the weight channel's epoch {epoch} (its receive failed)"
                ) from None
            raise

    def sync(self, epoch: int, world: int, version: int, cancelled: Callable[[], bool] | None = None) -> int:
        """The whole lifecycle where no pool drives it (tests, :func:`give_weights`): waits for
        the members' announcements (:meth:`ChannelHost.ready`), then :meth:`send`."""
        self.channel.ready(epoch, version, world, cancelled)
        return self.send(epoch, world, version, cancelled)


class ChannelMember:
    """A receiver's end of the channel, one channel rank. Each receive goes through the sync's
    lifecycle (:mod:`.sync_lifecycle`): it announces it is ready for the version (its groups
    drained: the caller receives only then), waits for the sender's go, forms the epoch's group
    if it has none, and receives. Throughout it looks for the sender ending the epoch
    (:meth:`ChannelHost.fail`), so that a sync that failed elsewhere (another member lost) ends
    here at once, not at the timeout. It keeps one group at most: that of its current epoch."""

    def __init__(self) -> None:
        self._link: Link | None = None
        self._address: ChannelAddress | None = None
        self._signals: Any = None
        """A client of the sender's store for the lifecycle's keys (a formation has its own)."""
        self._formations: _FormationStore | None = None
        self._store_at: tuple[str, int] | None = None
        self._looked = 0.0

    def join(self, address: ChannelAddress) -> None:
        """Takes ``address`` for the next receive: connects to the sender's store (at most
        ``address.timeout``). A group of another epoch is destroyed; the new one forms in
        :meth:`receive`, once the sender's clock started."""
        import torch.distributed as dist

        if self._link is not None and self._address != address:
            retire(self._link)
            self._link = None
        try:
            if self._store_at != (address.host, address.port):
                timeout = dt.timedelta(seconds=address.timeout)
                self._signals = dist.TCPStore(address.host, address.port, is_master=False, timeout=timeout)
                self._formations = _FormationStore(address.host, address.port, address.timeout)
                self._store_at = (address.host, address.port)
        except Exception as err:
            self._address = None
            raise WeightSyncError(f"joining the weight channel's epoch {address.epoch} failed: {err}") from err
        self._address = address

    @property
    def device(self) -> str:
        return buffer_device(self._address.backend, "cuda") if self._address is not None else "cpu"

    def receive(self, plan: SyncPlan, version: int, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
        """Announces, waits for go, forms (first sync of the epoch) and receives ``version``."""
        address, formations = self._address, self._formations
        if address is None or formations is None:
            raise WeightSyncError("receive before joining the weight channel")

        def loaded(pairs: list[tuple[str, torch.Tensor]]) -> None:
            load(pairs)
            failpoint("weights.received", address.rank)  # a test kills this member here, mid-send

        try:
            failpoint("weights.announce", address.rank)  # drained; a test kills it here, before it says so
            self._signals.set(_ready_key(address.epoch, version, address.rank), "1")
            self._await_go(address, version)
            if self._link is None:
                self._link = _form(address, formations, self._aborted)
            return receive(
                self._link, plan, version, loaded, device=self.device, timeout=address.timeout, aborted=self._aborted
            )
        except Exception as err:
            retire(self._link)  # a failed epoch's group is never used again
            self._link = None
            if isinstance(err, WeightSyncCancelledError):
                raise
            if self._ended(address.epoch):  # ended elsewhere first: this error is its echo (a peer's reset)
                why = str(err).splitlines()[0][:300]
                raise WeightSyncCancelledError(f"the sender ended the sync of weight version {version}: {why}") from err
            with contextlib.suppress(Exception):  # this member ends the epoch for everyone
                self._signals.set(_abort_key(address.epoch), "1")
            if isinstance(err, WeightSyncError):
                raise
            raise WeightSyncError(f"the weight channel's epoch {address.epoch} failed here: {err}") from err

    def close(self) -> None:
        retire(self._link)
        self._link = None

    def _await_go(self, address: ChannelAddress, version: int) -> None:
        """Until the sender's clock starts (every member announced): bounded by its heartbeat."""
        sync = MemberSync(address.epoch, version, address.timeout, time.monotonic(), formed=self._link is not None)
        go, beat = _go_key(address.epoch, version), _beat_key(address.epoch, version)
        while True:
            try:
                started = bool(self._signals.check([go]))
                aborted = bool(self._signals.check([_abort_key(address.epoch)]))
                pulse = self._signals.get(beat) if not (started or aborted) and self._signals.check([beat]) else None
            except Exception:  # the sender's store is gone: so is the sender
                started, aborted, pulse = False, True, None
            phase = sync.observe(time.monotonic(), go=started, aborted=aborted, beat=pulse)
            if phase is Phase.CANCELLED:
                raise WeightSyncCancelledError(sync.reason)
            if phase is Phase.FAILED:
                raise WeightSyncError(sync.reason)
            if phase is not Phase.ANNOUNCE:
                return
            time.sleep(0.005)  # the go is due once every member announced: each sync waits for it

    def _ended(self, epoch: int) -> bool:
        try:
            return bool(self._signals.check([_abort_key(epoch)]))
        except Exception:  # the sender's store is gone: so is the sender
            return True

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
            if self.member is not None:
                self.member.close()  # its epoch's group is destroyed, not left to the collector
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
            sender.sync(1, 2, version)
        except BaseException as err:  # raised in the caller's thread below
            failed.append(err)

    thread = threading.Thread(target=run, name="give-weights", daemon=True)
    thread.start()
    backend.join_channel(channel.address(1, 2, rank=1))
    got = int(backend.receive_weights(sender.plan, version))  # a refusal leaves the sender to time out
    thread.join(timeout)
    channel.close()
    if failed:
        raise failed[0]
    return got
