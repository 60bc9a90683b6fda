"""JSON requests to the API server through the official client's configuration: the one
Kubernetes client of the product (the operator, and the controller's bridge to its RLJob).

The official client brings authentication (kubeconfig, in-cluster token, token refresh)
and TLS; its generated models are slow and lossy for custom resources, so we send and
receive plain dicts through :meth:`ApiClient.call_api` instead. Errors come back as
:class:`KubeError` with the API server's status code and message (0 when unreachable).

An answer that says "later" is waited out and the request sent again, within bounds:
:data:`RETRY_LIMIT` times, :data:`RETRY_WAIT_MAX` s a wait, :data:`RETRY_TOTAL_MAX` s in
all; then it is raised.

- A 429 (API Priority and Fairness, or a watch cache still filling after a CRD was created
  or the API server restarted) means the request was not processed, so it is sent again
  for every method, writes included: after its Retry-After, or 1 s without one. Except a
  POST to ``.../eviction``: there a 429 is the PodDisruptionBudget's answer, for the caller.
- A 503 is sent again only with a Retry-After, and only for a GET or an idempotent write
  (PUT, DELETE): a 503 may come from a proxy after the request was processed.

Every request, each retry included, first takes a token from a client-side rate limiter
(:class:`TokenBucket`, ``qps`` and ``burst`` as client-go's), one per client and the clients
derived from it. Every write (any method but GET) first asks the client's ``guard``, if it
has one: the leader Lease's fencing hook, which raises :class:`NotLeadingError` to refuse.
"""

# Not spotrl_e2e.kube: the product needs kubeconfig/in-cluster auth with token refresh, and ships without test code.

from __future__ import annotations

import copy
import email.utils
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

Obj = dict[str, Any]
Guard = Callable[[str, str], None]

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"

RETRY_METHODS = frozenset({"GET", "PUT", "DELETE"})  # those whose 503 is sent again
RETRY_LIMIT = 4  # retries of one request
RETRY_WAIT_MAX = 5.0  # seconds, one wait (the API server asks 1 s, up to 30 after a long outage)
RETRY_TOTAL_MAX = 15.0  # seconds, all the waits of one request
RETRY_WAIT_429 = 1.0  # seconds, a 429 without Retry-After (APF's own answer asks 1 s)

log = logging.getLogger("spotrl.kube")
writes = logging.getLogger("spotrl.kube.writes")
"""Every write sent, at DEBUG (the operator's ``--log-writes`` shows them): an audit of who acted when."""
_sleep = time.sleep  # the tests' clock
_now = time.monotonic  # the tests' clock


class KubeError(RuntimeError):
    """The API server refused a request (``status`` is the HTTP code, 0 when unreachable;
    ``retry_after`` the seconds its Retry-After header asked for, None without one)."""

    def __init__(
        self, method: str, path: str, status: int, reason: str, message: str, retry_after: float | None = None
    ):
        self.method = method
        self.path = path
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        super().__init__(f"{method} {path}: HTTP {status} {reason}: {message}")


class NotLeadingError(KubeError):
    """A write the client's guard refused (this replica no longer holds the leader Lease);
    nothing was sent. Built as ``NotLeadingError(method, path, 0, "NotLeading", message)``:
    a KubeError, so callers that handle those handle it too."""


class ServerClock:
    """The API server's clock, as the ``Date`` header of its answers shows it: the offset from
    this process's wall clock, the median of the last :data:`SAMPLES` answers. A Date has whole
    seconds, so each sample is taken at its middle (+0.5 s); the answer's transit makes it a
    little early. Before any answer the offset is 0 (the wall clock)."""

    SAMPLES = 15

    def __init__(self, wall: Callable[[], float] = time.time):
        self.wall = wall
        self._offsets: list[float] = []
        self._lock = threading.Lock()

    def observe(self, date: str | None, received: float | None = None) -> None:
        """An answer's Date header, received at ``received`` (this process's wall clock, now by default)."""
        try:
            server = email.utils.parsedate_to_datetime(date).timestamp() + 0.5 if date else None
        except (TypeError, ValueError):
            server = None
        if server is None:
            return
        offset = server - (self.wall() if received is None else received)
        with self._lock:
            self._offsets = [*self._offsets[-(self.SAMPLES - 1) :], offset]

    def offset(self) -> float:
        """Seconds the API server's clock is ahead of this process's (negative: behind)."""
        with self._lock:
            offsets = sorted(self._offsets)
        return offsets[len(offsets) // 2] if offsets else 0.0

    def now(self) -> datetime:
        """The API server's time now."""
        return datetime.fromtimestamp(self.wall() + self.offset(), UTC)


class TokenBucket:
    """client-go's token bucket: ``burst`` requests at once, then ``qps`` a second. Pure but
    for its lock: the caller passes the clock and sleeps what :meth:`take` answers."""

    def __init__(self, qps: float, burst: int):
        self.qps = qps
        self.burst = max(1, burst)
        self._tokens = float(self.burst)
        self._last: float | None = None
        self._lock = threading.Lock()

    def take(self, now: float) -> float:
        """Takes a token at ``now``; the seconds to wait before using it (0: at once). A token
        not there yet is reserved (the count goes negative), so waiters queue in order."""
        if self.qps <= 0:
            return 0.0
        with self._lock:
            if self._last is not None:
                # Threads read the clock before the lock: never let time run backwards.
                self._tokens = min(self.burst, self._tokens + max(0.0, now - self._last) * self.qps)
            self._last = now if self._last is None else max(now, self._last)
            self._tokens -= 1
            return max(0.0, -self._tokens / self.qps)


def _retryable(method: str, err: KubeError) -> bool:
    if err.status == 429:
        # APF's 429: not processed, safe to send again; an eviction's: the PDB said no.
        return not (method == "POST" and err.path.rstrip("/").endswith("/eviction"))
    return err.status == 503 and method in RETRY_METHODS and err.retry_after is not None


def retry_wait(method: str, err: KubeError, retries: int, waited: float) -> float | None:
    """How long to wait before sending again a request that ``err`` refused (its path is
    ``err.path``), after ``retries`` retries that waited ``waited`` s in all; None: raise ``err``."""
    if not _retryable(method, err):
        return None
    wait = min(RETRY_WAIT_429 if err.retry_after is None else err.retry_after, RETRY_WAIT_MAX)
    if retries >= RETRY_LIMIT or waited + wait > RETRY_TOTAL_MAX:
        return None
    return wait


def _retry_after(headers: Any) -> float | None:
    """Retry-After in its delay form (the API server's), from the answer's headers."""
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:  # the date form
        return None


def _header(answer: Any, name: str) -> str | None:
    """A header of an answer (a urllib3 response or an ApiException), if it has headers."""
    headers = getattr(answer, "headers", None)
    value = headers.get(name) if headers is not None else None
    return str(value) if value else None


def path(
    api_version: str, resource: str, namespace: str | None = None, name: str | None = None, sub: str | None = None
) -> str:
    """``path("v1", "pods", "ns", "p")`` → ``/api/v1/namespaces/ns/pods/p``."""
    parts = [f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"]
    if namespace:
        parts.append(f"namespaces/{quote(namespace)}")
    parts.append(resource)
    if name:
        parts.append(quote(name))
    if sub:
        parts.append(sub)
    return "/".join(parts)


class Kube:
    """One API server, one identity. Thread-safe (the client's connection pool is, and the
    rate limiter). ``api_client``: see :meth:`connect`; one made elsewhere keeps its own urllib3
    retries (by default those retry a Retry-After answer too, under this class's own).
    ``qps`` <= 0: no rate limit. ``guard(method, path)``: asked before every write; raises to refuse."""

    def __init__(
        self, api_client: Any, timeout: float = 15.0, qps: float = 20.0, burst: int = 40, guard: Guard | None = None
    ):
        self.api_client = api_client
        self.timeout = timeout
        self.limiter = TokenBucket(qps, burst)
        self.guard = guard
        self.retry = True  # False: a "later" answer is raised at once (see for_deadline)
        self.config: Any = None  # the kubernetes.client.Configuration, when connect made it
        self.server_clock = ServerClock()
        """The API server's clock, from its answers (shared by the clients derived from this one)."""

    @classmethod
    def connect(
        cls,
        kubeconfig: str | None = None,
        *,
        qps: float = 20.0,
        burst: int = 40,
        timeout: float = 15.0,
        retries: int = 3,
    ) -> Kube:
        """Loads ``kubeconfig``, else $KUBECONFIG or ~/.kube/config, else the in-cluster account.
        ``retries``: urllib3's, for connection and read errors."""
        import urllib3
        from kubernetes import client, config

        cfg = client.Configuration()
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            try:
                config.load_kube_config(client_configuration=cfg)
            except config.ConfigException:
                config.load_incluster_config(client_configuration=cfg)
        # urllib3's default also retries a 429 or 503 with Retry-After, as long as it asks;
        # _call does that, within bounds.
        cfg.retries = urllib3.Retry(retries, respect_retry_after_header=False)
        kube = cls(client.ApiClient(cfg), timeout=timeout, qps=qps, burst=burst)
        kube.config = cfg
        return kube

    def _derive(self, **changes: Any) -> Kube:
        """A copy sharing the api_client and the rate limiter (one bucket for them all)."""
        clone = copy.copy(self)
        clone.__dict__.update(changes)
        return clone

    def with_guard(self, guard: Guard) -> Kube:
        """The same client, its writes fenced by ``guard``."""
        return self._derive(guard=guard)

    def unguarded(self) -> Kube:
        """The same client without a guard: for the leader Lease's own calls."""
        return self._derive(guard=None)

    def for_deadline(self, seconds: float) -> Kube:
        """A client for the leader Lease: each call fails within ``seconds`` (its timeout),
        with no retries, neither urllib3's nor on Retry-After, no guard, and no place in the
        shared rate limit (a renewal queued behind a burst of writes would lose the lease). A
        renewal must fail fast rather than outlive the leader's right to act."""
        api_client, cfg = self.api_client, self.config
        if cfg is not None:
            import urllib3
            from kubernetes import client

            # A shallow copy shares the credentials (api_key), so a token refresh serves both.
            cfg = copy.copy(cfg)
            cfg.retries = urllib3.Retry(0, redirect=0, respect_retry_after_header=False)
            api_client = client.ApiClient(cfg)
        return self._derive(
            api_client=api_client, config=cfg, timeout=seconds, retry=False, guard=None, limiter=TokenBucket(0, 0)
        )

    def request(
        self,
        method: str,
        url_path: str,
        body: Any = None,
        params: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float | tuple[float, float] | None = None,
    ) -> Obj:
        """One request; the answer's JSON (a list comes back as ``{"items": [...]}``)."""
        data = self._call(method, url_path, body, params, content_type, timeout).data
        decoded = json.loads(data) if data else {}
        return decoded if isinstance(decoded, dict) else {"items": decoded}

    def stream(self, url_path: str, timeout: float | tuple[float, float], **params: Any) -> Any:
        """A GET whose answer is read as it comes (a watch): the urllib3 response; release it."""
        return self._call("GET", url_path, None, params, "application/json", timeout)

    def _call(
        self,
        method: str,
        url_path: str,
        body: Any,
        params: dict[str, Any] | None,
        content_type: str,
        timeout: float | tuple[float, float] | None,
    ) -> Any:
        retries, waited = 0, 0.0
        while True:
            try:
                return self._call_once(method, url_path, body, params, content_type, timeout)
            except KubeError as err:
                wait = retry_wait(method, err, retries, waited) if self.retry else None
                if wait is None:
                    raise
                log.info("%s; sending it again in %.1f s", err, wait)
                _sleep(wait)
                retries, waited = retries + 1, waited + wait

    def _call_once(
        self,
        method: str,
        url_path: str,
        body: Any,
        params: dict[str, Any] | None,
        content_type: str,
        timeout: float | tuple[float, float] | None,
    ) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError as Urllib3Error

        # Asked at every attempt (leadership may be lost during a Retry-After wait), and again
        # after a wait for the rate limit.
        if self.guard is not None and method != "GET":
            self.guard(method, url_path)
        wait = self.limiter.take(_now())
        if wait > 0:
            _sleep(wait)
            if self.guard is not None and method != "GET":
                self.guard(method, url_path)
        if method != "GET":
            writes.debug("%s %s", method, url_path)
        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            answer = self.api_client.call_api(
                url_path,
                method,
                query_params=list((params or {}).items()),
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _return_http_data_only=True,
                _request_timeout=self.timeout if timeout is None else timeout,
            )
            self.server_clock.observe(_header(answer, "Date"))
            return answer
        except ApiException as err:
            self.server_clock.observe(_header(err, "Date"))
            reason, message = err.reason or "", str(err.body or "")
            try:
                status_obj = json.loads(err.body or "{}")
                reason, message = status_obj.get("reason", reason), status_obj.get("message", message)
            except (ValueError, AttributeError):
                pass
            retry_after = _retry_after(err.headers)
            raise KubeError(method, url_path, int(err.status or 0), str(reason), str(message), retry_after) from None
        # Connection refused, reset, TLS, timeouts; urllib3's once its retries are spent
        # (MaxRetryError), which is no OSError.
        except (OSError, Urllib3Error) as err:
            raise KubeError(method, url_path, 0, "Unreachable", str(err)) from None

    def get(self, url_path: str, **params: Any) -> Obj:
        return self.request("GET", url_path, params=params or None)

    def list_all(self, url_path: str, chunk: int = 500, **params: Any) -> list[Obj]:
        """Every item of the collection ``url_path``, listed ``chunk`` at a time (following
        ``metadata.continue``). A continue token that expired (410 Gone) starts the list over,
        once: the pages must come from one snapshot."""
        restarted = False
        while True:
            items: list[Obj] = []
            token: str | None = None
            try:
                while True:
                    page = self.request("GET", url_path, params=self._page(params, chunk, token))
                    items.extend(page.get("items") or [])
                    token = (page.get("metadata") or {}).get("continue") or None
                    if token is None:
                        return items
            except KubeError as err:
                if err.status != 410 or token is None or restarted:
                    raise
                restarted = True
                log.info("%s; listing %s again from the start", err, url_path)

    @staticmethod
    def _page(params: dict[str, Any], chunk: int, token: str | None) -> dict[str, Any]:
        page = {**params, "limit": chunk}
        if token is not None:
            page["continue"] = token
        return page

    def get_or_none(self, url_path: str) -> Obj | None:
        try:
            return self.get(url_path)
        except KubeError as err:
            if err.status == 404:
                return None
            raise

    def create(self, url_path: str, obj: Obj) -> Obj:
        return self.request("POST", url_path, obj)

    def create_or_get(self, url_path: str, obj: Obj) -> tuple[Obj, bool]:
        """Creates ``obj`` in the collection ``url_path``; if it exists, returns the existing one.
        The bool says whether this call created it."""
        try:
            return self.create(url_path, obj), True
        except KubeError as err:
            if err.status != 409:
                raise
        return self.get(f"{url_path}/{quote(obj['metadata']['name'])}"), False

    def update(self, url_path: str, obj: Obj) -> Obj:
        return self.request("PUT", url_path, obj)

    def patch(self, url_path: str, patch: Any, content_type: str = MERGE) -> Obj:
        return self.request("PATCH", url_path, patch, content_type=content_type)

    def delete(self, url_path: str, grace_seconds: int | None = None, uid: str | None = None) -> bool:
        """Deletes (in the background); False if it was already gone. With ``uid``, only the
        object of that uid (DeleteOptions preconditions): one made under the same name since it
        was read is someone else's and stays (the API server answers 409, returned as False)."""
        body: Obj = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", url_path, body)
        except KubeError as err:
            if err.status == 404 or (err.status == 409 and uid):
                return False
            raise
        return True
