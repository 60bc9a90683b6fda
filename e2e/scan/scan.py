"""Runs checkov and kube-score on the rendered chart and on the objects the operator creates
for each example (render.py), and fails on any finding that e2e/scan/allowlist.yaml does not
list with its reason, or on an allow-list entry that matches nothing any more.

    python e2e/scan/scan.py                      render, scan, compare (exit 1 on a problem)
    python e2e/scan/scan.py --rendered DIR       scan sets already rendered (render.py DIR)

A finding is (scanner, set, check id, Kind/name, container, message): checkov reports a
check once per object; kube-score a line per problem, naming the container where there is
one. Counts per object: checkov's failed checks; kube-score's checks graded CRITICAL or
WARNING, and the lines it prints for the critical ones. In-manifest suppressions
are not honoured (kube-score's ignore annotations are disabled, checkov's skips count as
findings): the allow-list is the one place a finding is accepted. Exit codes: 0 clean,
1 findings not allowed or stale entries, 2 a scanner or the allow-list could not be used.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ALLOWLIST = HERE / "allowlist.yaml"
CACHE = Path(os.environ.get("SPOTRL_SCAN_CACHE") or Path.home() / ".cache" / "spotrl" / "scan")
"""Scanner outputs by their inputs (:func:`_json_of`); ``SPOTRL_SCAN_CACHE`` moves it."""
SCANNERS = ("checkov", "kube-score")
KUBE_VERSION = "v1.35"
KUBE_SCORE_GRADES = {1: "critical", 5: "warning"}
"""kube-score's grades that are findings (7 is "almost OK", 10 "OK")."""


class ScanError(Exception):
    """A scanner or the allow-list could not be used (exit 2)."""


@dataclasses.dataclass(frozen=True, order=True)
class Finding:
    scanner: str
    set: str
    check: str
    object: str
    """Kind/name."""
    container: str = ""
    message: str = ""
    grade: str = dataclasses.field(default="", compare=False)
    """kube-score: critical or warning."""

    def __str__(self) -> str:
        where = f"{self.object}" + (f" container {self.container}" if self.container else "")
        grade = f" ({self.grade})" if self.grade else ""
        return f"{self.scanner} {self.check}{grade} {self.set} {where}: {self.message}"


@dataclasses.dataclass(frozen=True)
class Allowed:
    """One allow-list entry: the check exactly; patterns (fnmatch) for the set, object,
    container and message."""

    scanner: str
    check: str
    object: str
    reason: str
    set: str = "*"
    container: str | None = None
    message: str = "*"
    line: int = 0

    def matches(self, f: Finding) -> bool:
        return (
            f.scanner == self.scanner
            and f.check == self.check
            and fnmatch.fnmatchcase(f.set, self.set)
            and fnmatch.fnmatchcase(f.object, self.object)
            and (self.container is None or fnmatch.fnmatchcase(f.container, self.container))
            and fnmatch.fnmatchcase(f.message, self.message)
        )

    def __str__(self) -> str:
        container = f" container {self.container}" if self.container is not None else ""
        message = f": {self.message}" if self.message != "*" else ""
        return f"line {self.line}: {self.scanner} {self.check} {self.set} {self.object}{container}{message}"


def load_allowlist(path: Path) -> list[Allowed]:
    """The entries of ``path``; ScanError naming the entry and field that is wrong."""

    class _Loader(yaml.SafeLoader):
        pass

    def _mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[str, Any]:
        out = {str(k): v for k, v in loader.construct_mapping(node).items()}
        out["__line__"] = node.start_mark.line + 1
        return out

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
    doc = yaml.load(path.read_text(), Loader=_Loader) or {}
    entries = doc.get("allowed") or []
    out = []
    for e in entries:
        line = e.pop("__line__", 0)
        where = f"{path.name} line {line}"
        unknown = set(e) - {"scanner", "check", "object", "set", "container", "message", "reason"}
        if unknown:
            raise ScanError(f"{where}: unknown field(s) {sorted(unknown)}")
        for key in ("scanner", "check", "object", "reason"):
            if not isinstance(e.get(key), str) or not e[key].strip():
                raise ScanError(f"{where}: {key!r} is required (a non-empty string)")
        if e["scanner"] not in SCANNERS:
            raise ScanError(f"{where}: scanner must be one of {SCANNERS}, not {e['scanner']!r}")
        if any(c in e["check"] for c in "*?["):
            raise ScanError(f"{where}: check {e['check']!r} must name one check (no wildcards)")
        if e["scanner"] == "checkov" and "container" in e:
            raise ScanError(f"{where}: checkov reports a check once per object; drop 'container'")
        out.append(Allowed(**{k: str(v).strip() for k, v in e.items()}, line=line))
    return out


# ---------------------------------------------------------------- scanners


def tools() -> dict[str, str]:
    """CHECKOV and KUBE_SCORE: the environment's, else build.sh's paths."""
    listed = subprocess.run(
        [str(REPO / "e2e/toolchain/build.sh"), "--env"], check=True, capture_output=True, text=True
    ).stdout
    paths = dict(line.split("=", 1) for line in listed.splitlines())
    return {name: os.environ.get(name) or paths.get(name, "") for name in ("CHECKOV", "KUBE_SCORE")}


def missing_tools() -> list[str]:
    return [f"{name} ({path})" for name, path in tools().items() if not os.access(path, os.X_OK)]


def _kind_name(kind: str, name: str) -> str:
    return f"{kind}/{name}"


def objects_by_line(manifest: Path) -> list[tuple[int, int, str]]:
    """(first line, last line, Kind/name) of each document of ``manifest``, lines from 1."""
    out = []
    for node in yaml.compose_all(manifest.read_text()):
        if not isinstance(node, yaml.MappingNode):
            continue
        doc = yaml.safe_load(yaml.serialize(node))
        name = _kind_name(doc.get("kind", "?"), (doc.get("metadata") or {}).get("name", "?"))
        out.append((node.start_mark.line + 1, node.end_mark.line + 1, name))
    return out


def _json_of(args: list[str], what: str, manifest: Path) -> Any:
    """What a scanner run writes to stdout, as JSON; its stderr in the error when it is not.

    Kept in :data:`CACHE` under a key of everything the output depends on (the scanner's
    executable, by its versioned path, size and time; its arguments; the manifest's bytes), so
    an unchanged chart and operator are not scanned again (checkov takes most of a minute)."""
    cached = CACHE / f"{_cache_key(args, manifest)}.json"
    with contextlib.suppress(OSError, json.JSONDecodeError):
        return json.loads(cached.read_text())
    proc = subprocess.run(args, capture_output=True, text=True)
    try:
        found = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise ScanError(f"{what} (exit {proc.returncode}) wrote no JSON: {proc.stderr[-2000:]}") from None
    with contextlib.suppress(OSError):  # a cache that cannot be written only costs the next run time
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(proc.stdout)
        partial.replace(cached)
    return found


def _cache_key(args: list[str], manifest: Path) -> str:
    tool = Path(args[0]).resolve()
    stat = tool.stat()
    parts = [str(tool), str(stat.st_size), str(stat.st_mtime_ns)]
    parts += ["<manifest>" if a == str(manifest) else a for a in args[1:]]
    digest = hashlib.sha256(json.dumps(parts).encode())
    digest.update(manifest.read_bytes())
    return digest.hexdigest()


def run_checkov(checkov: str, set_name: str, manifest: Path) -> list[Finding]:
    """checkov's failed (and in-manifest skipped) checks. The object is the document the
    check's lines are in: a graph check on a Deployment's pod template names a Pod that
    checkov makes up from the template's labels."""
    args = [checkov, "-f", str(manifest), "--framework", "kubernetes", "-o", "json"]
    args += ["--skip-download", "--compact", "--quiet"]
    report = _json_of(args, f"checkov on {set_name}", manifest)
    reports = report if isinstance(report, list) else [report]
    documents = objects_by_line(manifest)
    out = []
    for r in reports:
        if r.get("summary", {}).get("parsing_errors"):
            raise ScanError(f"checkov could not parse {manifest}: {r['results'].get('parsing_errors')}")
        results = r.get("results", {})
        for key, note in (("failed_checks", ""), ("skipped_checks", "suppressed in the manifest: ")):
            for c in results.get(key, []):
                first = c["file_line_range"][0]
                found = [name for start, end, name in documents if start <= first <= end]
                if not found:
                    raise ScanError(f"checkov {c['check_id']} on {c['resource']}: no document at line {first}")
                out.append(Finding("checkov", set_name, c["check_id"], found[0], message=note + c["check_name"]))
    return out


def run_kube_score(kube_score: str, set_name: str, manifest: Path) -> list[Finding]:
    args = [kube_score, "score", "-o", "json", "--kubernetes-version", KUBE_VERSION]
    args += ["--disable-ignore-checks-annotations", str(manifest)]
    objects = _json_of(args, f"kube-score on {set_name}", manifest)
    out = []
    for obj in objects:
        name = _kind_name(obj["type_meta"]["kind"], obj["object_meta"]["name"])
        for c in obj["checks"]:
            grade = KUBE_SCORE_GRADES.get(c["grade"])
            if c["skipped"] or grade is None:
                continue
            for comment in c.get("comments") or [{"path": "", "summary": c["check"]["name"]}]:
                container, message = comment.get("path") or "", comment["summary"]
                out.append(Finding("kube-score", set_name, c["check"]["id"], name, container, message, grade))
    return out


def scan(rendered: Path) -> list[Finding]:
    """Both scanners on every set under ``rendered`` (a folder per set, render.py's layout)."""
    paths = tools()
    sets = sorted(p.parent for p in rendered.glob("*/objects.yaml"))
    if not sets:
        raise ScanError(f"nothing to scan in {rendered} (expected <set>/objects.yaml)")
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        jobs = [pool.submit(run_checkov, paths["CHECKOV"], s.name, s / "objects.yaml") for s in sets]
        jobs += [pool.submit(run_kube_score, paths["KUBE_SCORE"], s.name, s / "objects.yaml") for s in sets]
        findings = [f for job in jobs for f in job.result()]
    return sorted(set(findings))


# ---------------------------------------------------------------- report


@dataclasses.dataclass
class Outcome:
    findings: list[Finding]
    not_allowed: list[Finding]
    stale: list[Allowed]
    allowed_by: dict[Finding, Allowed]


def compare(findings: Iterable[Finding], allowlist: list[Allowed]) -> Outcome:
    findings = list(findings)
    allowed_by: dict[Finding, Allowed] = {}
    used: set[int] = set()
    for f in findings:
        for i, a in enumerate(allowlist):
            if a.matches(f):
                allowed_by.setdefault(f, a)
                used.add(i)
    return Outcome(
        findings,
        [f for f in findings if f not in allowed_by],
        [a for i, a in enumerate(allowlist) if i not in used],
        allowed_by,
    )


def part(set_name: str) -> str:
    return "chart" if set_name.startswith("chart") else "operator"


COLUMNS = ("checkov", "kube-score critical", "kube-score critical lines", "kube-score warning")


def counts(findings: Iterable[Finding]) -> dict[str, Any]:
    """Per scanner and part (chart, operator): checkov failed checks, kube-score checks
    graded critical and warning (a check once per object, whatever its containers) and the
    lines kube-score prints for the critical ones; and the same per set and object."""
    totals: Counter[str] = Counter()
    per_object: dict[str, Counter[str]] = {}

    def add(key: str, set_name: str, obj: str, n: int = 1) -> None:
        totals[f"{key} {part(set_name)}"] += n
        per_object.setdefault(f"{set_name} {obj}", Counter())[key] += n

    findings = list(findings)
    for scanner, set_name, obj, _check, grade in {(f.scanner, f.set, f.object, f.check, f.grade) for f in findings}:
        add("checkov" if scanner == "checkov" else f"kube-score {grade}", set_name, obj)
    for f in findings:
        if f.grade == "critical":
            add("kube-score critical lines", f.set, f.object)
    return {"totals": dict(sorted(totals.items())), "per_object": {k: dict(v) for k, v in sorted(per_object.items())}}


def report(outcome: Outcome, out: Any = sys.stdout) -> None:
    c = counts(outcome.findings)
    print("Per object: checkov failed checks; kube-score checks graded critical (and the lines it", file=out)
    print("prints for them), and warning:", file=out)
    print(f"  {'set / object':<60} {'checkov':>8} {'ks-crit':>8} {'(lines)':>8} {'ks-warn':>8}", file=out)
    for key, row in c["per_object"].items():
        print(f"  {key:<60} " + " ".join(f"{row.get(col, 0):>8}" for col in COLUMNS), file=out)
    print("Totals:", file=out)
    for p in ("chart", "operator"):
        line = ", ".join(f"{col} {c['totals'].get(f'{col} {p}', 0)}" for col in COLUMNS)
        print(f"  {p:<9} {line}", file=out)
    allowed = len(outcome.findings) - len(outcome.not_allowed)
    print(f"{len(outcome.findings)} findings: {allowed} allowed by {ALLOWLIST.name}", file=out)
    if outcome.not_allowed:
        print(
            f"\nNOT ALLOWED ({len(outcome.not_allowed)}): fix them, or add each to {ALLOWLIST.name} with its reason",
            file=out,
        )
        for f in outcome.not_allowed:
            print(f"  {f}", file=out)
    if outcome.stale:
        print(f"\nSTALE allow-list entries ({len(outcome.stale)}): they match no finding; remove them", file=out)
        for a in outcome.stale:
            print(f"  {a}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rendered", type=Path, help="scan these sets instead of rendering them (render.py DIR)")
    parser.add_argument("--allowlist", type=Path, default=ALLOWLIST)
    parser.add_argument("--json", type=Path, help="also write the counts and findings here")
    args = parser.parse_args(argv)
    try:
        allowlist = load_allowlist(args.allowlist)
        missing = missing_tools()
        if missing:
            raise ScanError(f"scanners missing: {', '.join(missing)}; run `make toolchain`")
        with tempfile.TemporaryDirectory(prefix="spotrl-scan-") as tmp:
            rendered = args.rendered
            if rendered is None:
                rendered = Path(tmp)
                subprocess.run([sys.executable, str(HERE / "render.py"), str(rendered)], check=True)
            outcome = compare(scan(rendered), allowlist)
    except ScanError as err:
        print(f"scan: {err}", file=sys.stderr)
        return 2
    report(outcome)
    if args.json:
        args.json.write_text(json.dumps(summary(outcome), indent=1))
    return 1 if outcome.not_allowed or outcome.stale else 0


def summary(outcome: Outcome) -> Mapping[str, Any]:
    return {
        **counts(outcome.findings),
        "findings": [dataclasses.asdict(f) for f in outcome.findings],
        "not_allowed": [str(f) for f in outcome.not_allowed],
        "stale": [str(a) for a in outcome.stale],
    }


if __name__ == "__main__":
    sys.exit(main())
