"""JSON requests to the API server through the official client's configuration: the one
Kubernetes client of the product (the operator, and the controller's bridge to its RLJob).

The official client brings authentication (kubeconfig, in-cluster token, token refresh)
and TLS; its generated models are slow and lossy for custom resources, so we send and
receive plain dicts through :meth:`ApiClient.call_api` instead. Errors come back as
:class:`KubeError` with the API server's status code and message.

An answer that says "later" (429 or 503 with Retry-After: a watch cache still filling after
a CRD was created or the API server restarted, or API Priority and Fairness) is waited out
as it asks and the request sent again, for reads and the idempotent writes (GET, PUT,
DELETE), within bounds: :data:`RETRY_LIMIT` times, :data:`RETRY_WAIT_MAX` s a wait,
:data:`RETRY_TOTAL_MAX` s in all; then it is raised. Never a POST: an eviction's 429 is the
PodDisruptionBudget's answer.
"""

# Not spotrl_e2e.kube: the product needs kubeconfig/in-cluster auth with token refresh, and ships without test code.

from __future__ import annotations

import json
import logging
import time
from typing import Any
from urllib.parse import quote

Obj = dict[str, Any]

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"

RETRY_STATUSES = frozenset({429, 503})
RETRY_METHODS = frozenset({"GET", "PUT", "DELETE"})
RETRY_LIMIT = 4  # retries of one request
RETRY_WAIT_MAX = 5.0  # seconds, one wait (the API server asks 1 s, up to 30 after a long outage)
RETRY_TOTAL_MAX = 15.0  # seconds, all the waits of one request

log = logging.getLogger("spotrl.kube")
_sleep = time.sleep  # the tests' clock


class KubeError(RuntimeError):
    """The API server refused a request (``status`` is the HTTP code, 0 when unreachable;
    ``retry_after`` the seconds its Retry-After header asked for, None without one)."""

    def __init__(
        self, method: str, path: str, status: int, reason: str, message: str, retry_after: float | None = None
    ):
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        super().__init__(f"{method} {path}: HTTP {status} {reason}: {message}")


def retry_wait(method: str, err: KubeError, retries: int, waited: float) -> float | None:
    """How long to wait before sending again a request that ``err`` refused, after
    ``retries`` retries that waited ``waited`` s in all; None: raise ``err``."""
    if method not in RETRY_METHODS or err.status not in RETRY_STATUSES or err.retry_after is None:
        return None
    wait = min(err.retry_after, RETRY_WAIT_MAX)
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
    """One API server, one identity. Thread-safe (the client's connection pool is).
    ``api_client``: see :meth:`connect`; one made elsewhere keeps its own urllib3 retries
    (by default those retry a Retry-After answer too, under this class's own)."""

    def __init__(self, api_client: Any, timeout: float = 15.0):
        self.api_client = api_client
        self.timeout = timeout

    @classmethod
    def connect(cls, kubeconfig: str | None = None) -> Kube:
        """Loads ``kubeconfig``, else $KUBECONFIG or ~/.kube/config, else the in-cluster account."""
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
        # urllib3's default (3 retries) also retries a 429 or 503 with Retry-After, as long as
        # it asks; _call does that, within bounds. Connection and read errors: as before.
        cfg.retries = urllib3.Retry(3, respect_retry_after_header=False)
        return cls(client.ApiClient(cfg))

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
                wait = retry_wait(method, err, retries, waited)
                if wait is None:
                    raise
                log.info("%s; sending it again in %.1f s (Retry-After)", err, wait)
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

        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            return self.api_client.call_api(
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
        except ApiException as err:
            reason, message = err.reason or "", str(err.body or "")
            try:
                status_obj = json.loads(err.body or "{}")
                reason, message = status_obj.get("reason", reason), status_obj.get("message", message)
            except (ValueError, AttributeError):
                pass
            retry_after = _retry_after(err.headers)
            raise KubeError(method, url_path, int(err.status or 0), str(reason), str(message), retry_after) from None
        except OSError as err:  # connection refused, reset, TLS ...
            raise KubeError(method, url_path, 0, "Unreachable", str(err)) from None

    def get(self, url_path: str, **params: Any) -> Obj:
        return self.request("GET", url_path, params=params or None)

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

    def delete(self, url_path: str, grace_seconds: int | None = None) -> bool:
        """Deletes (in the background); False if it was already gone."""
        body: Obj = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            self.request("DELETE", url_path, body)
        except KubeError as err:
            if err.status == 404:
                return False
            raise
        return True
