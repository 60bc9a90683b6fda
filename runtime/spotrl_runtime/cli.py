"""The `spotrl` command. Each subcommand lives in its own module under ``commands/``.

Modules are imported when the CLI starts, but each one imports its heavy dependencies
(torch, kopf, boto3) inside the function that runs it, so `spotrl validate` stays fast and
works where only the operator's dependencies are installed.

What a user sees when something is wrong is one line on stderr: a bad flag or file (exit 2,
:class:`~spotrl_runtime.commands.preflight.UsageError` or argparse), or an unexpected error
(exit 1, its type and message). ``--debug`` (or ``SPOTRL_DEBUG=1``) adds the traceback.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import sys
import threading
import traceback
from typing import NoReturn

from spotrl_runtime.commands.preflight import UsageError

# One line per subcommand module; each module defines `register(subparsers)`.
COMMAND_MODULES = (
    "spotrl_runtime.commands.validate",
    "spotrl_runtime.commands.run",
    "spotrl_runtime.commands.audit",
    "spotrl_runtime.commands.episodes",
    "spotrl_runtime.commands.controller",
    "spotrl_runtime.commands.worker",
    "spotrl_runtime.commands.ckpt",
    "spotrl_runtime.commands.eval",
    "spotrl_runtime.commands.operator",
)
DEBUG_HELP = "on an error, print its traceback too ($SPOTRL_DEBUG=1 does the same)"


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag said in one line (argparse prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="spotrl",
        description="RL post-training on spot GPUs that never loses work to a preemption.",
    )
    debug = os.environ.get("SPOTRL_DEBUG", "") not in ("", "0", "false")
    parser.add_argument("--debug", action="store_true", default=debug, help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    # `spotrl run ... --debug` as well as `spotrl --debug run ...`.
    for command in sub.choices.values():
        if "--debug" not in command._option_string_actions:
            command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = f"spotrl {args.command}"
    try:
        rc: int = args.func(args)
    except UsageError as err:
        _say(f"{prog}: {err}", args.debug)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        hint = "" if args.debug else f" (run `spotrl --debug {args.command} ...` for the traceback)"
        _say(f"{prog}: unexpected error: {type(err).__name__}: {_one_line(err)}{hint}", args.debug)
        return 1
    return rc


def _say(line: str, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    print(line, file=sys.stderr, flush=True)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or "(no message)"


def entry() -> NoReturn:
    """The `spotrl` command: :func:`main`, then :func:`exit_process` with its code."""
    exit_process(main())


def exit_process(code: int) -> NoReturn:
    """Ends the process as ``sys.exit(code)`` would (threading's shutdown: executors told to
    stop, the threads that are not daemons joined; then the ``atexit`` functions: Ray's
    shutdown, logging's flush), but without the interpreter's finalization. After Ray, that
    finalization could crash the process: its garbage collection of the modules ran beside
    Ray's C++ threads and crashed (a SIGABRT from the handler that caught it), so that a controller
    stopped by SIGTERM during start-up exited -6 instead of 143. Ray's own workers end the same
    way (its core worker exits the process directly)."""
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter runs first, then:
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
