"""The trainer tests' helpers (a small Llama, hand-made groups) are shared with the unit tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "training"))
