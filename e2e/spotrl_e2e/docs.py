"""What the docs tests read out of the Markdown: fenced blocks with their markers, the
``spotrl`` and ``make`` commands they name, and phrases that belong on the benchmarks page.

A YAML block is checked by what it is (tests/unit/test_docs.py, tests/cluster/test_docs_manifests.py):
an RLJob by the model (``spotrl validate``), any other Kubernetes object by a server-side dry
run, a block after ``<!-- helm-values -->`` by the chart's values.schema.json
(spotrl_e2e.chart_values) and ``helm template``; a block after ``<!-- fragment -->`` only has to
parse.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from spotrl_e2e.tools import REPO_ROOT

FRAGMENT = "<!-- fragment -->"
HELM_VALUES = "<!-- helm-values -->"
BENCHMARKS_PAGE = Path("docs/benchmarks.md")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its file, the line its fence opens on, its language and marker."""

    path: Path
    line: int
    lang: str
    marker: str | None
    text: str

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files(root: Path = REPO_ROOT) -> list[Path]:
    """Every page a user reads: the site's, the README and the contributing guide."""
    pages = sorted((root / "docs").rglob("*.md"))
    return [p.relative_to(root) for p in pages] + [Path(n) for n in ("README.md", "CONTRIBUTING.md")]


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)[^\n]*$")


def blocks(text: str, path: Path) -> Iterator[Block]:
    """The fenced blocks of one Markdown file, each with the HTML comment on the line above it
    (its marker), if any."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, fence, lang = opened.groups()
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        marker = above if above.startswith("<!--") and above.endswith("-->") else None
        yield Block(path, i + 1, lang.lower(), marker, "\n".join(body) + "\n")
        i = j + 1


def marked_block(text: str, path: Path, marker: str) -> Block:
    """The one block right after ``marker`` (e.g. ``<!-- first-hour:begin -->``, whose commands a
    test runs); an AssertionError names the marker when the page lost it."""
    found = [b for b in blocks(text, path) if b.marker == marker]
    assert len(found) == 1, f"{path} has {len(found)} blocks after {marker}, not one"
    return found[0]


def command_lines(block: Block) -> Iterator[str]:
    """The commands of a shell block: continuations joined, prompts (``$ ``), comment lines and
    comments after two spaces (``cmd  # why``) dropped."""
    joined = re.sub(r"\\\n\s*", " ", block.text)
    for line in joined.splitlines():
        line = line.split("  #", 1)[0].strip()
        if line.startswith("$ "):
            line = line[2:]
        if line and not line.startswith("#"):
            yield line


SEPARATORS = ("|", "||", "&&", ";", "&", "(", ")", "$(")
PREFIXES = ("sudo", "exec", "time", "env", "nohup")


def spotrl_invocations(line: str) -> Iterator[list[str]]:
    """The argument lists of each ``spotrl ...`` command in a shell line: ``spotrl`` (or a path
    to it) as the first word of a command, after a separator, variable assignments or a prefix
    such as ``sudo``; its arguments run to the next separator or redirection."""
    try:
        words = shlex.split(line, comments=True, posix=True)
    except ValueError:
        return
    current: list[str] | None = None
    at_start = True
    for word in [*words, "|"]:
        if word in SEPARATORS or word.startswith((">", "2>", "<")):
            if current is not None:
                yield current
            current, at_start = None, True
        elif current is not None:
            current.append(word)
        elif at_start and (word == "spotrl" or word.endswith("/spotrl")):
            current = []
        elif at_start and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", word) or word in PREFIXES):
            continue
        else:
            at_start = False


INLINE_CODE = re.compile(r"`([^`\n]+)`")


def inline_commands(text: str, program: str) -> Iterator[str]:
    """Inline code spans that start with ``program`` (``spotrl ...``, ``make ...``)."""
    for match in INLINE_CODE.finditer(text):
        code = match.group(1).strip()
        if code.startswith(f"{program} "):
            yield code


def make_targets(makefile: str) -> set[str]:
    return set(re.findall(r"^([a-z0-9][a-z0-9-]*):", makefile, re.M))


_NUMBER = r"\d+(?:[.,]\d+)?"
_UNIT = r"(?:ms|s|sec|secs|seconds?|min|mins|minutes?|h|hours?)"
TIMING_PHRASES = (
    # before and after: "<n> -> <m> s", "from <n> s to <m> s"
    re.compile(rf"\b{_NUMBER}\s*{_UNIT}?\s*(?:->|→|=>)\s*{_NUMBER}\s*{_UNIT}\b"),
    re.compile(rf"\bfrom\s+{_NUMBER}\s*{_UNIT}\s+to\s+{_NUMBER}\s*{_UNIT}\b"),
    # how long something took: "took <n> s", "ran in about <n> min"
    re.compile(rf"\b(?:took|taking|ran in|runs in|finished in|finishes in)\s+(?:about\s+|~|≈)?{_NUMBER}\s*{_UNIT}\b"),
    # a run's length: "<n> minutes warm", "cold: <n> s"
    re.compile(rf"\b{_NUMBER}\s*{_UNIT}\s*(?:warm|cold)\b"),
    re.compile(rf"\b(?:warm|cold)\s*[:,]?\s*(?:about\s+)?{_NUMBER}\s*{_UNIT}\b"),
    # a speed-up: "<n>x faster", "<n>× slower"
    re.compile(rf"\b{_NUMBER}\s*[x×]\s+(?:faster|slower|as long|as fast)\b"),
    # a machine's mood on the day
    re.compile(r"\b(?:this|the)\s+(?:VM|machine)\s+was\s+(?:slow|fast|busy)\b", re.I),
)
"""Measured durations and their history: they belong on the benchmarks page, dated, with the machine."""

HAND_COUNTED_TESTS = re.compile(r"\b\d[\d,]*\s+tests\b")
"""A number of tests written by hand goes stale with the next test: ``make test-count`` says it."""


def timing_phrases(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, phrase)`` of each measured duration in ``text``."""
    for n, line in enumerate(text.splitlines(), 1):
        for pattern in TIMING_PHRASES:
            for match in pattern.finditer(line):
                yield n, match.group(0)
