"""``python -m spotrl_e2e.nodeagent --config agent.json``: run the node agent until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from spotrl_e2e.nodeagent.agent import Agent
from spotrl_e2e.nodeagent.config import AgentConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spotrl_e2e.nodeagent", description=__doc__)
    parser.add_argument("--config", type=Path, required=True, help="agent config (JSON) written by the harness")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s",
        stream=sys.stderr,
    )
    agent = Agent(AgentConfig.load(args.config))
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    agent.run()
    done.wait()
    logging.getLogger("nodeagent").info("stopping: killing every pod process")
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
