"""Store ownership on a local folder and on a real S3 server: the first job to write a store
owns it (``JOB.json``, create-only), another job is refused before it writes anything (check
``job_identity``), a store of the days before ``JOB.json`` is adopted only by its own job,
and a claim of another job fences nobody."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from cut_scenarios import JOB, example_b_before_cut

from spotrl_runtime.checkpoint.fence import Fence, FencedError, claim_key
from spotrl_runtime.checkpoint.ownership import prove_ownership
from spotrl_runtime.core.identity import JobIdentity
from spotrl_runtime.core.validation import ForeignCutError
from spotrl_runtime.storage import LocalStorage, Storage
from spotrl_runtime.storage.purge import OWNER_KEY

A = JobIdentity("tiny-arith", "team-a", "uid-a")
B = JobIdentity("tiny-b", "team-a", "uid-b")


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return LocalStorage(tmp_path / "store")
    return request.getfixturevalue("s3_bucket").storage("jobs/shared")


def keys(store: Storage) -> dict[str, bytes]:
    return {i.key: store.get_bytes(i.key) for i in store.list("")}


def refused(store: Storage, job: JobIdentity) -> ForeignCutError:
    before = keys(store)
    with pytest.raises(ForeignCutError) as err:
        prove_ownership(store, job)
    assert keys(store) == before, "a refused job wrote something"
    assert err.value.check == "job_identity"
    assert "point the job at its own checkpoint storage" in str(err.value)
    return err.value


def test_the_first_job_owns_an_empty_store_and_no_other_job_starts_there(store: Storage) -> None:
    prove_ownership(store, A)
    assert json.loads(store.get_bytes(OWNER_KEY)) == {"name": "tiny-arith", "namespace": "team-a", "uid": "uid-a"}
    prove_ownership(store, A)  # every start checks it again
    prove_ownership(store, JobIdentity("tiny-arith", "team-a", "uid-recreated"))  # deleted (Retain), made again
    prove_ownership(store, JobIdentity("tiny-arith"))  # `spotrl run` of the same job: no namespace
    err = refused(store, B)
    assert err.path == OWNER_KEY
    assert "the store belongs to job 'team-a/tiny-arith', not 'team-a/tiny-b'" in str(err)
    assert refused(store, JobIdentity("tiny-arith", "team-b")).path == OWNER_KEY, "same name, other namespace"


def test_a_store_holding_only_another_jobs_claim_is_refused(store: Storage) -> None:
    Fence(store, 1, A).claim()  # no cut yet, and (say) its JOB.json lost
    err = refused(store, B)
    assert err.path == claim_key(1)
    assert "the claim belongs to job 'team-a/tiny-arith'" in str(err)
    prove_ownership(store, A)  # its own job adopts it
    assert json.loads(store.get_bytes(OWNER_KEY))["name"] == "tiny-arith"


def test_an_older_store_is_adopted_by_its_own_job_only(tmp_path: Path) -> None:
    """Cuts and claims of the days before JOB.json (claims naming no job) belong to the job
    the newest cut names."""
    for name in ("own", "foreign"):
        store = LocalStorage(tmp_path / name)
        run = example_b_before_cut(store)
        Fence(store, 0).claim()  # an old claim: it names no job
        run.cut()
    err = refused(LocalStorage(tmp_path / "foreign"), B)
    assert err.path is not None
    assert err.path.endswith("manifest.json")
    assert f"the cut belongs to job {JOB!r}, not 'team-a/tiny-b'" in str(err)
    own = LocalStorage(tmp_path / "own")
    prove_ownership(own, JobIdentity(JOB))
    assert json.loads(own.get_bytes(OWNER_KEY))["name"] == JOB


def test_an_identity_file_that_names_nobody_is_refused(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    for doc in (b"not json", b'{"job": "tiny-arith"}', b'{"name": ""}', b"[]"):
        store.put_bytes(OWNER_KEY, doc)
        err = refused(store, A)
        assert "names no job" in str(err)


class _Racing:
    """A store on which two starters both find no JOB.json before either writes it."""

    def __init__(self, inner: Storage):
        self.inner = inner
        self.both_looked = threading.Barrier(2, timeout=30)

    def put_bytes(self, key: str, data: bytes, **kw: Any) -> Any:
        if key == OWNER_KEY:
            self.both_looked.wait()
        return self.inner.put_bytes(key, data, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_two_jobs_racing_for_an_empty_store_one_owns_it(store: Storage) -> None:
    racing = _Racing(store)
    outcome: dict[str, BaseException | None] = {}

    def start(job: JobIdentity) -> None:
        try:
            prove_ownership(racing, job)  # type: ignore[arg-type]
            outcome[job.name] = None
        except BaseException as err:
            outcome[job.name] = err

    threads = [threading.Thread(target=start, args=(j,)) for j in (A, B)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    owner = json.loads(store.get_bytes(OWNER_KEY))["name"]
    loser = "tiny-b" if owner == "tiny-arith" else "tiny-arith"
    assert outcome[owner] is None
    assert isinstance(outcome[loser], ForeignCutError), outcome
    assert f"the store belongs to job 'team-a/{owner}'" in str(outcome[loser])


class _CountingReads:
    def __init__(self, inner: Storage):
        self.inner = inner
        self.reads: list[str] = []

    def get_bytes(self, key: str) -> bytes:
        self.reads.append(key)
        return self.inner.get_bytes(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_forged_claim_of_another_job_with_a_higher_attempt_fences_nobody(store: Storage) -> None:
    prove_ownership(store, A)
    counting = _CountingReads(store)
    mine = Fence(counting, 3, A).claim()  # type: ignore[arg-type]
    # Consistent in every way but the job: the key, the format and a higher attempt.
    forged = {"attempt": 9, "job": B.to_json(), "host": "h", "pid": 1, "claimed_at": "2026-12-02T00:00:00.000+00:00"}
    store.put_bytes(claim_key(9), json.dumps(forged).encode(), create_only=True)
    for _ in range(3):
        mine.check()
    assert counting.reads.count(claim_key(9)) == 1, "a claim found foreign is read once, not before every step"
    # The same job in another namespace is another job too.
    ns = {**forged, "attempt": 10, "job": JobIdentity("tiny-arith", "team-b").to_json()}
    store.put_bytes(claim_key(10), json.dumps(ns).encode(), create_only=True)
    mine.check()
    # A claim that names no job (an older controller's) still fences: it may be this job's.
    store.put_bytes(claim_key(11), json.dumps({**forged, "attempt": 11, "job": None}).encode(), create_only=True)
    with pytest.raises(FencedError, match="attempt 11 claimed"):
        mine.check()
    store.delete(claim_key(11))
    mine.check()
    # And the job's own next attempt, as the operator numbers it, fences it as before.
    Fence(store, 12, JobIdentity("tiny-arith", "team-a", "uid-a")).claim()
    with pytest.raises(FencedError, match="fenced: controller attempt 12 claimed"):
        mine.check()


def test_a_forged_claim_that_takes_the_jobs_next_attempt_is_named(store: Storage) -> None:
    prove_ownership(store, A)
    forged = {"attempt": 2, "job": B.to_json(), "host": "h", "pid": 1, "claimed_at": "x"}
    store.put_bytes(claim_key(2), json.dumps(forged).encode(), create_only=True)
    with pytest.raises(FencedError, match=r"attempt 2 .* is claimed already by job 'team-a/tiny-b'"):
        Fence(store, 2, A).claim()
    Fence(store, 3, A).claim()  # the operator's next attempt goes on
