"""bench/_targets.py, the one way a benchmark checks its targets: with ``--check`` (``make
bench-check``) a missed target ends the script non-zero, naming it and the figure measured;
without it the script prints the targets and exits 0, as ``make bench`` wants. No benchmark runs."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import pytest

# bench/ is the benchmarks' folder, not a package: the module is loaded from its file, and
# registered first, as dataclasses look their module up by name.
SPEC = importlib.util.spec_from_file_location("_targets", Path(__file__).resolve().parents[2] / "bench" / "_targets.py")
assert SPEC is not None
assert SPEC.loader is not None
targets_module = sys.modules.setdefault(SPEC.name, importlib.util.module_from_spec(SPEC))
SPEC.loader.exec_module(targets_module)
Targets = targets_module.Targets


def test_a_missed_target_fails_the_check_and_a_met_one_passes(capsys: pytest.CaptureFixture[str]) -> None:
    met = Targets()
    assert met.at_most("barrier cut / torch.save", 1.2, 1.5)
    assert met.at_least("vLLM all at once / 8 a call", 1.5, 1.5)  # the bound itself meets the goal
    met.report(check=True)  # returns: the script goes on to exit 0
    assert "barrier cut / torch.save: 1.2 (goal ≤ 1.5): met" in capsys.readouterr().out

    missed = Targets()
    missed.at_most("barrier cut / torch.save", 1.2, 1.5)
    assert not missed.at_most("stall / synchronous cut", 0.25, 0.1)
    assert not missed.at_least("LoRA gain / full gain", math.nan, 0.8)  # nothing measured is a miss
    with pytest.raises(SystemExit) as exited:
        missed.report(check=True)
    # SystemExit with a message exits with status 1 and prints it: the target and its ratio.
    message = exited.value.code
    assert isinstance(message, str)
    assert "2 of 3 targets missed" in message
    assert "stall / synchronous cut: 0.25 (goal ≤ 0.1): NOT met" in message
    assert "LoRA gain / full gain: nan (goal ≥ 0.8): NOT met" in message
    assert "barrier cut / torch.save" not in message

    missed.report(check=False)  # make bench: printed, and the script exits 0
    assert "stall / synchronous cut: 0.25 (goal ≤ 0.1): NOT met" in capsys.readouterr().out

    with pytest.raises(SystemExit, match="no target was measured"):
        Targets().report(check=True)  # flags that skipped every measured part check nothing

    parser = argparse.ArgumentParser()
    targets_module.add_check(parser)
    assert parser.parse_args(["--check"]).check
    assert not parser.parse_args([]).check
