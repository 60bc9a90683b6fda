"""The docs as a user meets them: every example is whole and valid (or says it is a fragment),
every command and flag they name exists, a newcomer reaches each first step within two clicks
of the README, and measured timings live on the benchmarks page only.

The Kubernetes objects and Helm values in the docs get their server-side dry run in
tests/cluster/test_docs_manifests.py; ``mkdocs build --strict`` runs in ``make lint``.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from spotrl_e2e import chart_values
from spotrl_e2e.docs import (
    BENCHMARKS_PAGE,
    FRAGMENT,
    HAND_COUNTED_TESTS,
    HELM_VALUES,
    INLINE_CODE,
    Block,
    blocks,
    command_lines,
    doc_files,
    inline_commands,
    make_targets,
    marked_block,
    spotrl_invocations,
    timing_phrases,
)
from spotrl_e2e.tools import REPO_ROOT
from spotrl_runtime.api.rljob import API_VERSION, KIND, parse_rljob
from spotrl_runtime.cli import build_parser

SHELL_LANGS = ("bash", "sh", "shell", "console", "")


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in blocks((REPO_ROOT / p).read_text(), p)]


def yaml_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang in ("yaml", "yml")]


def test_the_docs_have_examples_to_check() -> None:
    """The checks below pass vacuously on a docs tree they cannot read."""
    found = yaml_blocks()
    assert len(found) >= 20, [b.where() for b in found]
    assert any(b.marker == HELM_VALUES for b in found)
    assert any(b.marker == FRAGMENT for b in found)


def test_every_yaml_block_is_a_whole_valid_object_or_marked() -> None:
    """An RLJob passes the model (what `spotrl validate` runs); any other block is a Kubernetes
    object (dry-run by the cluster test), Helm values the chart's values.schema.json accepts (at
    every level: a misspelt nested key fails), or marked a fragment."""
    problems = []
    for block in yaml_blocks():
        try:
            docs = [d for d in yaml.safe_load_all(block.text) if d is not None]
        except yaml.YAMLError as err:
            problems.append(f"{block.where()}: not YAML ({err})")
            continue
        if block.marker == FRAGMENT:
            continue
        if block.marker == HELM_VALUES:
            problems += [f"{block.where()}: Helm values {err}" for d in docs for err in chart_values.errors(d)]
            continue
        for doc in docs:
            if not isinstance(doc, dict) or not {"apiVersion", "kind"} <= doc.keys():
                problems.append(f"{block.where()}: neither a whole object nor marked {FRAGMENT} or {HELM_VALUES}")
            elif (doc["apiVersion"], doc["kind"]) == (API_VERSION, KIND):
                try:
                    parse_rljob(doc)
                except ValueError as err:
                    problems.append(f"{block.where()}: {err}")
            elif "name" not in (doc.get("metadata") or {}):
                problems.append(f"{block.where()}: a {doc['kind']} without metadata.name")
    assert not problems, "\n".join(problems)


def _subcommand(parser: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The deepest subcommand ``words`` name, and the words after it."""
    while words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0] not in subs[0].choices:
            break
        parser, words = subs[0].choices[words[0]], words[1:]
    return parser, words


def _spotrl_commands() -> list[tuple[str, list[str]]]:
    out = []
    for path in doc_files():
        text = (REPO_ROOT / path).read_text()
        for block in blocks(text, path):
            if block.lang in SHELL_LANGS:
                out += [(block.where(), args) for line in command_lines(block) for args in spotrl_invocations(line)]
        out += [(str(path), args) for code in inline_commands(text, "spotrl") for args in spotrl_invocations(code)]
    return out


def test_every_spotrl_command_and_flag_the_docs_name_exists() -> None:
    commands = _spotrl_commands()
    assert len(commands) >= 20
    top = build_parser()
    problems = []
    for where, args in commands:
        words = [w for w in args if not w.startswith("<")]
        parser, rest = _subcommand(top, [w for w in words if w != "--debug"])
        if parser is top and rest and not rest[0].startswith("-"):
            problems.append(f"{where}: spotrl has no command {rest[0]!r}")
            continue
        for word in rest:
            flag = word.split("=", 1)[0]
            if flag.startswith("--") and flag not in parser._option_string_actions:
                problems.append(f"{where}: `{parser.prog}` has no flag {flag}")
    assert not problems, "\n".join(problems)


def test_every_helm_set_the_docs_show_is_a_value_of_the_chart() -> None:
    """``--set KEY=VALUE`` in the pages' commands and inline code (a command of another chart,
    Karpenter's, left out), each checked against values.schema.json as Helm types it."""
    found, problems = [], []
    for path in doc_files():
        text = (REPO_ROOT / path).read_text()
        shell = [block for block in blocks(text, path) if block.lang in SHELL_LANGS]
        lines = [(block.where(), line) for block in shell for line in command_lines(block)]
        lines += [(str(path), code) for code in INLINE_CODE.findall(text)]
        for where, line in lines:
            if "helm " in line and "charts/spotrl" not in line:
                continue
            for key, value in chart_values.set_flags(line):
                found.append(key)
                problems += [
                    f"{where}: --set {key}: {e}" for e in chart_values.errors(chart_values.set_values(key, value))
                ]
    assert {"image.repository", "storage.default", "kueue.enabled"} <= set(found), found
    assert not problems, "\n".join(problems)


def test_every_make_target_the_docs_name_exists() -> None:
    targets = make_targets((REPO_ROOT / "Makefile").read_text())
    named = []
    for path in doc_files():
        text = (REPO_ROOT / path).read_text()
        for block in blocks(text, path):
            if block.lang in SHELL_LANGS:
                named += [(block.where(), line) for line in command_lines(block) if line.startswith("make ")]
        named += [(str(path), code) for code in inline_commands(text, "make")]
    assert len(named) >= 10
    problems = []
    for where, line in named:
        words = [w for w in line.split()[1:] if "=" not in w and not w.startswith("-")]
        # `make install: missing libnuma1` quotes a message, not a command
        missing = [w for w in words[:1] if re.fullmatch(r"[a-z0-9][a-z0-9-]*", w) and w not in targets]
        problems += [f"{where}: no make target {w!r} ({line})" for w in missing]
    assert not problems, "\n".join(problems)


def _links(path: Path) -> set[Path]:
    """The Markdown pages a page links to (relative links, anchors dropped)."""
    text = (REPO_ROOT / path).read_text()
    out = set()
    for target in re.findall(r"\]\(([^)\s]+\.md)(?:#[^)]*)?\)", text):
        if "://" not in target:
            out.add(Path(*(path.parent / target).parts).resolve().relative_to(REPO_ROOT.resolve()))
    return out


@pytest.mark.parametrize(
    "page",
    [
        "docs/getting-started/local.md",
        "docs/getting-started/kind.md",
        "docs/getting-started/gpu.md",
        "docs/operations/kueue.md",
        "docs/operations/troubleshooting.md",
    ],
)
def test_a_newcomer_reaches_each_first_step_within_two_clicks_of_the_readme(page: str) -> None:
    first = _links(Path("README.md"))
    second = {p for f in first if (REPO_ROOT / f).exists() for p in _links(f)}
    assert Path(page) in first | second, f"{page} is more than two clicks from README.md"


def test_the_readme_is_short() -> None:
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; move detail into docs/"


def test_measured_timings_live_on_the_benchmarks_page_only() -> None:
    """A duration measured once goes stale in prose and comments; the benchmarks page dates it
    and names the machine. Code comments say why, not how long it took."""
    pages = [p for p in doc_files() if p != BENCHMARKS_PAGE]
    code = [
        p.relative_to(REPO_ROOT)
        for folder in ("runtime", "operator", "e2e", "bench", "charts", ".ci")
        for p in sorted((REPO_ROOT / folder).rglob("*"))
        if p.suffix in (".py", ".sh", ".yaml", ".tpl", "") and p.is_file() and "__pycache__" not in p.parts
    ] + [Path("Makefile")]
    found = [
        f"{path}:{n}: {phrase!r}"
        for path in [*pages, *code]
        for n, phrase in timing_phrases((REPO_ROOT / path).read_text(errors="replace"))
    ]
    assert not found, "move these to docs/benchmarks.md:\n" + "\n".join(found)


def test_no_page_counts_the_tests_by_hand() -> None:
    found = [
        f"{p}: {m.group(0)!r}"
        for p in doc_files()
        for code_free in [INLINE_CODE.sub("", (REPO_ROOT / p).read_text())]
        for m in HAND_COUNTED_TESTS.finditer(code_free)
    ]
    assert not found, "say `make test-count` instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("text", "phrases"),
    [
        ("slowed them by more (test_stop_signals 114 -> 333 s).", ["114 -> 333 s"]),
        ("took make test's start from 1707 s to 2884 s on one machine", ["from 1707 s to 2884 s"]),
        ("the build took about 350 s", ["took about 350 s"]),
        ("Keep it within 35 minutes warm", ["35 minutes warm"]),
        ("vLLM is 2x faster here", ["2x faster"]),
        ("barrierDeadlineSeconds defaults to 100 s, fitting AWS's 120 s notice", []),
        ("a leader silent for 15 s is replaced", []),
    ],
)
def test_the_timing_lint_tells_a_measurement_from_a_setting(text: str, phrases: list[str]) -> None:
    assert [p for _, p in timing_phrases(text)] == phrases


def test_the_block_reader_keeps_markers_and_indented_fences() -> None:
    text = (
        "a\n\n<!-- fragment -->\n```yaml\nx: 1\n```\n\n- item\n\n"
        "    ```bash\n    spotrl run -f a.yaml \\\n      --fresh\n    ```\n"
    )
    fragment, shell = list(blocks(text, Path("p.md")))
    assert (fragment.lang, fragment.marker, fragment.text, fragment.line) == ("yaml", FRAGMENT, "x: 1\n", 4)
    assert shell.marker is None
    assert [list(spotrl_invocations(line)) for line in command_lines(shell)] == [[["run", "-f", "a.yaml", "--fresh"]]]
    # a test runs the block after its marker, comments dropped
    runbook = "<!-- run:begin -->\n```console\n$ kubectl get rljobs -w  # watch it\n# NAME PHASE\n```\n"
    assert list(command_lines(marked_block(runbook, Path("p.md"), "<!-- run:begin -->"))) == ["kubectl get rljobs -w"]
    with pytest.raises(AssertionError, match="0 blocks after <!-- gone -->"):
        marked_block(runbook, Path("p.md"), "<!-- gone -->")
    # a release named spotrl is no spotrl command; a variable before the command is no reason to miss it
    assert list(spotrl_invocations("helm install spotrl charts/spotrl --wait")) == []
    assert list(spotrl_invocations("X=1 .venv/bin/spotrl ckpt list ./c | head && spotrl validate -f a")) == [
        ["ckpt", "list", "./c"],
        ["validate", "-f", "a"],
    ]
