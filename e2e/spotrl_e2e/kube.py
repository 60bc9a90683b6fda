"""A small Kubernetes REST client over plain dicts, for the harness and the node agent.

The official client's generated models are slow to build and awkward for a kubelet's
partial status patches; this one speaks JSON and raises :class:`ApiError` with the API
server's own message. Tests that want the official client use ``Cluster.api_client()``.
"""

# Not spotrl_runtime.kube: the harness needs watches, per-node client certs and none of the code under test.

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3

from spotrl_e2e.pki import KeyPair

Obj = dict[str, Any]

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class ApiError(RuntimeError):
    """The API server refused a request; ``status`` is the HTTP code, ``body`` its Status object,
    ``retry_after`` the seconds its Retry-After header asks to wait before trying again (None
    without one)."""

    def __init__(self, method: str, path: str, status: int, body: Obj | str, retry_after: float | None = None):
        self.status = status
        self.body = body
        self.retry_after = retry_after
        self.reason = body.get("reason", "") if isinstance(body, dict) else ""
        message = body.get("message", body) if isinstance(body, dict) else body
        self.message = str(message)
        super().__init__(f"{method} {path}: HTTP {status} {self.reason}: {message}")


def path(
    api_version: str,
    resource: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The URL path of a resource: ``path("v1", "pods", "ns", "p", "status")``."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [base]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(resource)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


@dataclass
class Credentials:
    """How to reach and authenticate to an API server: a client certificate or a bearer token."""

    server: str
    ca: Path
    client: KeyPair | None = None
    token: str | None = None


class KubeClient:
    """JSON requests to one API server as one identity. Thread-safe."""

    def __init__(self, creds: Credentials, timeout: float = 15.0):
        self.creds = creds
        ctx = ssl.create_default_context(cafile=str(creds.ca))
        if creds.client is not None:
            ctx.load_cert_chain(str(creds.client.cert), str(creds.client.key))
        self._http = urllib3.PoolManager(ssl_context=ctx, maxsize=16, retries=False)
        self.timeout = timeout

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if content_type:
            h["Content-Type"] = content_type
        if self.creds.token:
            h["Authorization"] = f"Bearer {self.creds.token}"
        return h

    def request(
        self,
        method: str,
        url_path: str,
        body: Any = None,
        params: dict[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> Obj:
        """Sends one request; returns the decoded JSON answer or raises :class:`ApiError`."""
        base = "" if url_path.startswith("https://") else self.creds.server  # absolute: another server, same CA
        url = base + url_path + ("?" + urlencode(params) if params else "")
        data = json.dumps(body).encode() if body is not None else None
        resp = self._http.request(
            method,
            url,
            body=data,
            headers=self._headers(content_type if data is not None else None),
            timeout=timeout or self.timeout,
        )
        text = resp.data.decode("utf-8", "replace")
        try:
            decoded: Any = json.loads(text) if text else {}
        except json.JSONDecodeError:
            decoded = text
        if resp.status >= 400:
            retry_after = retry_after_seconds(resp.headers.get("Retry-After"))
            raise ApiError(method, url_path, resp.status, decoded, retry_after)
        return decoded if isinstance(decoded, dict) else {"raw": decoded}

    def get(self, url_path: str, **params: Any) -> Obj:
        return self.request("GET", url_path, params=params or None)

    def get_or_none(self, url_path: str) -> Obj | None:
        try:
            return self.get(url_path)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def create(self, url_path: str, obj: Obj, **params: Any) -> Obj:
        return self.request("POST", url_path, obj, params=params or None)

    def replace(self, url_path: str, obj: Obj) -> Obj:
        return self.request("PUT", url_path, obj)

    def patch(self, url_path: str, patch: Any, patch_type: str = MERGE, **params: Any) -> Obj:
        return self.request("PATCH", url_path, patch, params=params or None, content_type=patch_type)

    def delete(self, url_path: str, body: Obj | None = None, **params: Any) -> Obj | None:
        """Deletes; None if it was already gone."""
        try:
            return self.request("DELETE", url_path, body, params=params or None)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def apply_manifest(self, obj: Obj, plural: str, namespace: str | None = None) -> Obj:
        """Creates ``obj``, or replaces it (keeping its resourceVersion) if it exists."""
        ns = namespace or obj.get("metadata", {}).get("namespace")
        collection = path(obj["apiVersion"], plural, ns)
        try:
            return self.create(collection, obj)
        except ApiError as err:
            if err.status != 409:
                raise
        name = obj["metadata"]["name"]
        current = self.get(f"{collection}/{name}")
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}}
        return self.replace(f"{collection}/{name}", obj)

    def watch(
        self,
        url_path: str,
        resource_version: str,
        timeout_seconds: int = 60,
        stop: Callable[[], bool] = lambda: False,
        **params: Any,
    ) -> Iterator[Obj]:
        """Yields watch events (``{"type", "object"}``) from ``resource_version`` until the server
        ends the watch, ``timeout_seconds`` pass or ``stop()`` is true. Raises :class:`ApiError`
        on an error event (410 Gone: list again)."""
        query = {
            **params,
            "watch": "1",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_seconds),
            "allowWatchBookmarks": "true",
        }
        url = f"{self.creds.server}{url_path}?{urlencode(query)}"
        resp = self._http.request(
            "GET",
            url,
            headers=self._headers(),
            preload_content=False,
            timeout=urllib3.Timeout(connect=self.timeout, read=timeout_seconds + 15),
        )
        try:
            if resp.status >= 400:
                body = resp.read().decode("utf-8", "replace")
                retry_after = retry_after_seconds(resp.headers.get("Retry-After"))
                raise ApiError("WATCH", url_path, resp.status, _json_or_text(body), retry_after)
            buf = b""
            for chunk in resp.stream(64 * 1024):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object", {})
                        raise ApiError("WATCH", url_path, int(status.get("code", 500)), status)
                    yield event
                if stop():
                    return
        finally:
            resp.release_conn()

    def wait_for(
        self,
        url_path: str,
        predicate: Callable[[Obj | None], bool],
        timeout: float,
        what: str,
        interval: float = 0.2,
    ) -> Obj | None:
        """Polls ``GET url_path`` until ``predicate(obj or None)`` holds; the TimeoutError names
        ``what`` and shows the last object seen."""
        deadline = time.monotonic() + timeout
        last: Obj | None = None
        while True:
            last = self.get_or_none(url_path)
            if predicate(last):
                return last
            if time.monotonic() > deadline:
                shown = json.dumps(last, indent=1)[-3000:] if last is not None else "(not found)"
                raise TimeoutError(
                    f"timed out after {timeout:.0f} s waiting for {what} ({url_path}); last seen:\n{shown}"
                )
            time.sleep(interval)


def wait_crd_served(
    client: KubeClient,
    name: str,
    timeout: float = 30,
    *,
    interval: float = 0.2,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Obj:
    """Waits until the API server serves the resource of the CRD ``name`` (just created or
    applied); returns the CRD.

    A new CRD's status has no conditions for a moment (``kubectl wait
    --for=condition=Established`` then fails at once), and once Established, a list of its
    resource may still be answered 429 "storage is (re)initializing" while the API server
    fills its watch cache. So this waits for the condition Established, then for one list
    of the resource to be answered; a 429 with Retry-After is waited out as it asks. Every
    wait, those included, ends at ``timeout``: then a TimeoutError names the CRD, what was
    awaited and the last answer. Any other refusal is raised as it comes."""
    deadline = clock() + timeout
    crd_url = path("apiextensions.k8s.io/v1", "customresourcedefinitions", name=name)

    def established() -> tuple[Obj | None, str]:
        crd = client.get_or_none(crd_url)
        if crd is None:
            return None, "the CRD is not there"
        conditions = (crd.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
            return crd, ""
        return None, f"status.conditions {json.dumps(conditions)}"

    crd = _until_served(established, f"CRD {name} to be Established", deadline, interval, clock, sleep)
    spec = crd["spec"]
    version = next((v["name"] for v in spec["versions"] if v.get("storage")), spec["versions"][0]["name"])
    list_url = path(f"{spec['group']}/{version}", spec["names"]["plural"])

    def listed() -> tuple[Obj | None, str]:
        # No limit: the API server sends a list with a limit to etcd while the cache is not
        # ready, so it would answer before the lists of the tests and of the operator do.
        return client.get(list_url), ""

    _until_served(listed, f"CRD {name}'s storage to answer a list of {list_url}", deadline, interval, clock, sleep)
    return crd


def _until_served(
    probe: Callable[[], tuple[Obj | None, str]],
    what: str,
    deadline: float,
    interval: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> Obj:
    """``probe()`` until it returns an object, every ``interval`` s, or as long as a 429's
    Retry-After asks; a TimeoutError at ``deadline`` with the last thing seen."""
    seen = "no answer yet"
    while True:
        pause = interval
        try:
            obj, seen = probe()
            if obj is not None:
                return obj
        except ApiError as err:
            if err.status != 429 or err.retry_after is None:
                raise
            seen, pause = str(err), max(err.retry_after, interval)
        left = deadline - clock()
        if left <= 0:
            raise TimeoutError(f"timed out waiting for {what}; the last answer: {seen}")
        sleep(min(pause, left))


def retry_after_seconds(header: str | None) -> float | None:
    """The seconds of a Retry-After header in its delay form (the API server's); None without
    one, or for the date form."""
    try:
        return max(0.0, float(header)) if header else None
    except ValueError:
        return None


def _json_or_text(text: str) -> Obj | str:
    try:
        decoded = json.loads(text)
    except json.JSONDecodeError:
        return text
    return decoded if isinstance(decoded, dict) else text
