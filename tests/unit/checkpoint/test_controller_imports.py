"""What a controller start imports: each `spotrl run` and every controller pod pays for it in CPU,
and a run from a single-process cut never needs ``torch.distributed.checkpoint`` (FSDP's sharded
cuts import it where they are written and read)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch.distributed.checkpoint", "torch.distributed.fsdp")


def test_the_controller_and_its_restore_do_not_import_the_sharded_checkpoint_modules() -> None:
    probe = (
        "import sys\n"
        "import spotrl_runtime.controller.assemble\n"
        "import spotrl_runtime.checkpoint.restore\n"
        "import spotrl_runtime.checkpoint.resume\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"imported at start: {out.stdout.strip()}"
