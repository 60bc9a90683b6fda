"""Generates the RLJob CustomResourceDefinition and its reference from the Python model.

``python -m spotrl_runtime.api.crd`` rewrites ``crds/rljobs.spotrl.dev.yaml`` (and its copy
in the Helm chart); ``--check`` fails when either is out of date (``make lint``). The RLJob's
reference page is written from the same schema by :mod:`spotrl_runtime.api.reference`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from spotrl_runtime.api import rljob
from spotrl_runtime.api.rules import JOB_NAME_RULE, ApiObject

CRD_FILE = "crds/rljobs.spotrl.dev.yaml"
CHART_CRD_FILE = "charts/spotrl/crds/rljobs.spotrl.dev.yaml"  # Helm installs CRDs from here

MIRROR_MARK = "as in the Pod API (core/v1 "
"""In a field's description: its type mirrors a Kubernetes type, whose fields the reference does not list."""

_KEEP = (
    "type",
    "description",
    "default",
    "enum",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
)


def _rules_by_title() -> dict[str, ApiObject]:
    out: dict[str, Any] = {}
    stack: list[type[ApiObject]] = [rljob.RLJobSpec, rljob.RLJobStatus]
    while stack:
        cls = stack.pop()
        if cls.__name__ in out:
            continue
        out[cls.__name__] = cls
        for field in cls.model_fields.values():
            for arg in _types_in(field.annotation):
                if isinstance(arg, type) and issubclass(arg, ApiObject):
                    stack.append(arg)
    return out


def _types_in(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    return [t for a in args for t in _types_in(a)]


def structural(schema: dict[str, Any], defs: dict[str, Any], classes: dict[str, Any]) -> dict[str, Any]:
    """Converts pydantic's JSON Schema into a Kubernetes structural OpenAPI v3 schema."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        merged = {**defs[name], **{k: v for k, v in schema.items() if k != "$ref"}}
        return structural(merged, defs, classes)
    if "anyOf" in schema:
        # Optional[X] is X: the API server drops nulls of non-nullable fields, and the
        # model reads a missing field and a null one alike.
        options = [s for s in schema["anyOf"] if s.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express union {schema['anyOf']} structurally")
        extra = {k: v for k, v in schema.items() if k not in ("anyOf", "default") or v is not None}
        extra.pop("anyOf")
        return structural({**options[0], **extra}, defs, classes)
    out: dict[str, Any] = {}
    if "const" in schema:
        out["enum"] = [schema["const"]]
    for key in _KEEP:
        if key in schema and schema[key] is not None:
            out[key] = schema[key]
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in schema:  # JSON Schema 2020 number form -> OpenAPI 3.0 boolean form
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = schema[key]
            out[key] = True
    if out.get("type") == "object" or "properties" in schema:
        out["type"] = "object"
        props = schema.get("properties", {})
        if props:
            out["properties"] = {}
            for name, sub in props.items():
                conv = structural(sub, defs, classes)
                if "default" not in conv and conv.get("type") == "object" and sub.get("$ref"):
                    # An optional object whose fields all have defaults defaults to itself,
                    # written out in full: the API server checks a default against the
                    # object's CEL rules, and an empty {} lacks the keys the rules read.
                    ref = sub["$ref"].rsplit("/", 1)[-1]
                    cls = classes.get(ref)
                    optional = name not in schema.get("required", [])
                    if optional and cls is not None and not any(f.is_required() for f in cls.model_fields.values()):
                        conv["default"] = cls().model_dump(mode="json", by_alias=True, exclude_none=True)
                out["properties"][name] = conv
        if schema.get("required"):
            out["required"] = list(schema["required"])
        addl = schema.get("additionalProperties")
        if isinstance(addl, dict):
            out["additionalProperties"] = structural(addl, defs, classes)
        title = schema.get("title")
        cls = classes.get(title) if title else None
        if cls is not None and cls.rules:
            out["x-kubernetes-validations"] = [
                {"rule": r.cel, "message": r.message, "fieldPath": "." + r.field} for r in cls.rules
            ]
    if out.get("type") == "array":
        out["items"] = structural(schema["items"], defs, classes)
    if "type" not in out:
        raise ValueError(f"schema without a type: {schema}")
    return out


def _schema_of(cls: type[ApiObject]) -> dict[str, Any]:
    raw = cls.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}), _rules_by_title())


def openapi_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the RLJob resource."""
    status = _schema_of(rljob.RLJobStatus)
    # Kopf keeps handler progress under status.kopf; let it through untyped.
    status["properties"]["kopf"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "type": "object",
        "description": "An RL post-training run that survives spot preemptions.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _schema_of(rljob.RLJobSpec),
            "status": status,
        },
        "x-kubernetes-validations": [_root_rule()],
    }


def _root_rule() -> dict[str, Any]:
    """:data:`~spotrl_runtime.api.rules.JOB_NAME_RULE` at the root, where CEL reads
    ``self.metadata.name``. Checked when the job is created only (``optionalOldSelf``: on a
    create ``oldSelf`` has no value): the name never changes, and an update of a job created
    before the rule (whose objects the operator cannot make) must still go through, or the
    operator could not take its finalizer off and it could never be deleted. No fieldPath: the
    schema declares no ``metadata.name`` for it to point at; the message names the field."""
    return {
        "rule": f"oldSelf.hasValue() || ({JOB_NAME_RULE.cel})",
        "optionalOldSelf": True,
        "message": JOB_NAME_RULE.message,
    }


def crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{rljob.PLURAL}.{rljob.GROUP}"},
        "spec": {
            "group": rljob.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": rljob.KIND,
                "plural": rljob.PLURAL,
                "singular": rljob.SINGULAR,
                "shortNames": list(rljob.SHORT_NAMES),
                "listKind": f"{rljob.KIND}List",
                "categories": ["spotrl"],
            },
            "versions": [
                {
                    "name": rljob.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                        {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
                        {"name": "Total", "type": "integer", "jsonPath": ".spec.training.totalSteps"},
                        {"name": "Last-Cut", "type": "string", "jsonPath": ".status.lastCut.id"},
                        {"name": "Preemptions", "type": "integer", "jsonPath": ".status.preemptions"},
                        {"name": "Queue", "type": "string", "jsonPath": ".status.queue.name", "priority": 1},
                        # Set only while the operator cannot write the job's objects (actuate.STUCK).
                        {
                            "name": "Error",
                            "type": "string",
                            "jsonPath": '.status.conditions[?(@.type=="ReconcileError")].reason',
                        },
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                        {
                            "name": "Lost",
                            "type": "integer",
                            "priority": 1,
                            "jsonPath": ".status.accounting.promptsLost",
                        },
                        {
                            "name": "Retrained",
                            "type": "integer",
                            "priority": 1,
                            "jsonPath": ".status.accounting.stepsRetrained",
                        },
                        {"name": "Standby", "type": "string", "priority": 1, "jsonPath": ".status.standbyPod"},
                        {"name": "Message", "type": "string", "priority": 1, "jsonPath": ".status.message"},
                    ],
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated from runtime/spotrl_runtime/api/rljob.py by `make generate`. Do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)


def _fmt_type(s: dict[str, Any]) -> str:
    t = s.get("type", "")
    if t == "array":
        return f"[]{_fmt_type(s['items'])}"
    if t == "object" and "additionalProperties" in s:
        return f"map[string]{_fmt_type(s['additionalProperties'])}"
    return str(t)


def _fmt_constraints(s: dict[str, Any]) -> str:
    parts = []
    if "enum" in s:
        parts.append(" \\| ".join(f"`{v}`" for v in s["enum"]))
    lo, hi = s.get("minimum"), s.get("maximum")
    if lo is not None:
        parts.append(f"{'>' if s.get('exclusiveMinimum') else '≥'} {lo}")
    if hi is not None:
        parts.append(f"{'<' if s.get('exclusiveMaximum') else '≤'} {hi}")
    if "maxItems" in s:
        parts.append(f"≤ {s['maxItems']} items")
    return ", ".join(parts)


def reference_markdown(section: str = "spec") -> str:
    """A table of every field of ``section`` (spec or status): path, type, default, allowed values,
    meaning; then the rules between fields."""
    rows = ["| field | type | default | allowed | description |", "|---|---|---|---|---|"]
    rules: list[str] = []

    def walk(path: str, s: dict[str, Any], required: bool) -> None:
        if path:
            default = s.get("default")
            shown = (
                "required"
                if required
                else ("" if default is None or isinstance(default, dict) else f"`{json.dumps(default)}`")
            )
            desc = s.get("description", "").replace("|", "\\|").replace("\n", " ")
            rows.append(f"| `{path}` | {_fmt_type(s)} | {shown} | {_fmt_constraints(s)} | {desc} |")
        if MIRROR_MARK in s.get("description", "") or s.get("x-kubernetes-preserve-unknown-fields"):
            return  # a Pod API type (its reference is the Kubernetes API's), or Kopf's own
        for v in s.get("x-kubernetes-validations", []):
            rules.append(f"- `{path}{v['fieldPath']}`: {v['message']}")
        req = set(s.get("required", []))
        for name, sub in s.get("properties", {}).items():
            walk(f"{path}.{name}" if path else name, sub, name in req)
        if s.get("type") == "array" and "properties" in s["items"]:
            for v in s["items"].get("x-kubernetes-validations", []):
                rules.append(f"- `{path}[]{v['fieldPath']}`: {v['message']}")
            req = set(s["items"].get("required", []))
            for name, sub in s["items"]["properties"].items():
                walk(f"{path}[].{name}", sub, name in req)

    top = openapi_schema()["properties"][section]
    for v in top.get("x-kubernetes-validations", []):
        rules.append(f"- `{section}{v['fieldPath']}`: {v['message']}")
    for name, sub in top["properties"].items():
        walk(f"{section}.{name}", sub, name in top.get("required", []))
    if not rules:
        return "\n".join(rows)
    return "\n".join([*rows, "", "Rules between fields (checked by the API server and by the model):", "", *rules])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", default=".", help="repository root")
    ap.add_argument("--check", action="store_true", help="fail if the generated files are out of date")
    args = ap.parse_args(argv)
    root = Path(args.root)
    return write_generated({root / CRD_FILE: crd_yaml(), root / CHART_CRD_FILE: crd_yaml()}, check=args.check)


def write_generated(wanted: Mapping[Path, str], check: bool) -> int:
    """Writes each file whose text differs from ``wanted``; ``check``: writes nothing and
    returns 1 naming each such file (``make lint``), 0 when every one is current."""
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if check:
        for p in stale:
            print(f"{p} is out of date: run `make generate`", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(wanted[p])
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
