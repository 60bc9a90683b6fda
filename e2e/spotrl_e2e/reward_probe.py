"""A reward that looks for the storage's keys: the probe of the tests that check a reward's
process holds none of them, and that nothing it read or raised is echoed (the integration test
of a local run, the end-to-end test of the operator's pods)."""

from __future__ import annotations

from pathlib import Path

RETURNED = "a-file-the-reward-returned-61a7"
"""What the probe returns on some rows: a value no log, audit record or status may hold."""
RAISED = "a-file-the-reward-raised-with-93c2"
"""What the probe's exception says on other rows: in the reward's own log only."""

PROBE = '''
import os

def score(prompt, completion):
    """Returns the storage's key if it can find one; else, on some rows, what it read."""
    with open("/proc/self/environ", "rb") as f:
        environ = f.read()
    seen = os.environ.get("AWS_SECRET_ACCESS_KEY")
    out = os.path.join(os.environ["PROBE_OUT"], f"{os.getpid()}.environ")
    if not os.path.exists(out):
        with open(out, "wb") as f:
            f.write(environ)
    if seen or b"AWS_" in environ:
        return seen or environ.decode()
    if prompt.idx % 4 == 1:
        with open(os.environ["PROBE_FILES"] + "/returned") as f:
            return f.read()
    if prompt.idx % 4 == 2:
        with open(os.environ["PROBE_FILES"] + "/raised") as f:
            raise PermissionError("cannot use " + f.read())
    return 1.0 if completion.strip() == prompt.answer.strip() else 0.0
'''


def write_probe(module: Path, files: Path) -> None:
    """The probe as ``module`` (a ``.py`` file), and in ``files`` what it returns and raises
    (``$PROBE_FILES``); it writes what its process's environment holds into ``$PROBE_OUT``."""
    module.write_text(PROBE)
    files.mkdir(parents=True, exist_ok=True)
    (files / "returned").write_text(RETURNED)
    (files / "raised").write_text(RAISED)
