"""The weight sync's lifecycle as pure state machines: every transition, with the clock passed in."""

from __future__ import annotations

import pytest

from spotrl_runtime.generation.sync_lifecycle import LifecycleError, MemberSync, Phase, SenderSync

MEMBERS = {"gen-0": (1,), "gen-1": (2, 3)}  # gen-1: tensor parallelism 2, two channel ranks


def sync(formed: bool = False) -> SenderSync:
    return SenderSync(epoch=4, version=7, members=MEMBERS, timeout=10.0, formed=formed)


def test_the_clock_starts_when_every_rank_announced_and_forms_only_a_new_epoch() -> None:
    s = sync()
    assert s.observe(0.0, announced={1, 2}) is Phase.ANNOUNCE, "gen-1's second rank has not announced"
    assert s.deadline() is None, "no clock while members announce"
    assert s.observe(3.0, announced={1, 2, 3}) is Phase.FORM
    assert (s.clock, s.deadline()) == (3.0, 13.0)
    assert s.formed_now() is Phase.SEND
    assert s.sent() is Phase.DONE
    assert s.deadline() is None
    again = sync(formed=True)
    assert again.observe(0.0, announced={1, 2, 3}) is Phase.SEND, "a formed epoch's next sync does not form"


def test_a_draining_member_has_no_clock_and_its_clock_starts_once_it_drained() -> None:
    s = sync()
    # gen-1 drains for a minute, much longer than the bound: nothing ends.
    for t in range(0, 60, 5):
        assert s.observe(float(t), announced={1}, draining={"gen-1"}) is Phase.ANNOUNCE
    assert s.observe(60.0, announced={1}) is Phase.ANNOUNCE  # drained now: its clock starts
    assert s.observe(70.0, announced={1}) is Phase.ANNOUNCE  # exactly the bound: still in time
    assert s.observe(70.5, announced={1}) is Phase.FAILED
    assert s.culprits == ("gen-1",)
    assert "did not announce it was ready for version 7 within 10 s of finishing its groups: gen-1" in s.reason


def test_a_lost_member_ends_the_epoch_at_once_naming_it() -> None:
    s = sync()
    assert s.observe(0.0, announced={2, 3}, draining={"gen-0"}, lost={"gen-0": "ActorDiedError"}) is Phase.FAILED
    assert s.culprits == ("gen-0",)
    assert "lost before it announced" in s.reason
    assert "gen-0: ActorDiedError" in s.reason
    with pytest.raises(LifecycleError):
        s.observe(1.0, announced={1, 2, 3})
    assert s.failed("later") is Phase.FAILED
    assert "lost before" in s.reason, "an ended sync keeps its first reason"


def test_a_barrier_cancels_in_every_phase() -> None:
    s = sync()
    assert s.observe(0.0, announced=set(), cancelled=True) is Phase.CANCELLED
    for advance in (lambda x: None, lambda x: x.formed_now()):
        s = sync()
        s.observe(0.0, announced={1, 2, 3})
        advance(s)
        assert s.cancel() is Phase.CANCELLED
        assert s.deadline() is None


def test_a_failure_mid_send_ends_the_epoch_and_transitions_out_of_order_are_refused() -> None:
    s = sync(formed=True)
    with pytest.raises(LifecycleError):
        s.sent()
    s.observe(0.0, announced={1, 2, 3})
    with pytest.raises(LifecycleError):
        s.formed_now()
    assert s.failed("a weight-sync collective did not complete within 10 s") is Phase.FAILED
    assert s.phase.ended


def test_a_member_waits_for_go_while_the_sender_beats_and_gives_up_when_it_stops() -> None:
    m = MemberSync(epoch=4, version=7, timeout=10.0, started=0.0)
    for t in range(0, 50, 5):  # the other members drain; the sender waits, beating
        assert m.observe(float(t), go=False, aborted=False, beat=t) is Phase.ANNOUNCE
    assert m.observe(55.0, go=False, aborted=False, beat=45) is Phase.ANNOUNCE
    assert m.observe(55.5, go=False, aborted=False, beat=45) is Phase.FAILED, "no beat for more than 10 s"
    assert "sent no sign of waiting for 10 s" in m.reason


def test_a_member_forms_on_go_unless_formed_and_stops_on_the_epochs_end() -> None:
    assert MemberSync(4, 7, 10.0, 0.0).observe(1.0, go=True, aborted=False) is Phase.FORM
    assert MemberSync(4, 7, 10.0, 0.0, formed=True).observe(1.0, go=True, aborted=False) is Phase.SEND
    m = MemberSync(4, 7, 10.0, 0.0)
    assert m.observe(1.0, go=True, aborted=True) is Phase.CANCELLED, "the end wins over a go"
    assert "the sender ended the sync of weight version 7" in m.reason
    with pytest.raises(LifecycleError):
        m.observe(2.0, go=True, aborted=False)
