"""What the API server does with an RLJob before it is stored, done here without one.

Pruning nulls, defaulting, the OpenAPI schema (strict about unknown fields, as
`kubectl apply` is by default) and the CEL rules. The real API server runs the same
documents in tests/cluster; this lets the model-vs-CRD check run in the unit suite.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema


def _prune_and_default(schema: dict[str, Any], obj: Any) -> Any:
    if not isinstance(obj, dict) or schema.get("type") != "object":
        if isinstance(obj, list) and schema.get("type") == "array":
            return [_prune_and_default(schema["items"], x) for x in obj]
        return obj
    props = schema.get("properties", {})
    out = {k: v for k, v in obj.items() if not (v is None and not schema.get("nullable"))}
    for name, sub in props.items():
        if name not in out and "default" in sub:
            out[name] = copy.deepcopy(sub["default"])
        if name in out:
            out[name] = _prune_and_default(sub, out[name])
    if "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
        addl = schema["additionalProperties"]
        out = {k: (v if k in props else _prune_and_default(addl, v)) for k, v in out.items()}
    return out


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """Unknown fields are errors (server-side field validation, kubectl's default)."""
    s = copy.deepcopy(schema)
    open_ended = "additionalProperties" in s or s.get("x-kubernetes-preserve-unknown-fields")
    if s.get("type") == "object" and "properties" in s and not open_ended:
        s["additionalProperties"] = False
    for k in ("properties",):
        for name in list(s.get(k, {})):
            s[k][name] = _strict(s[k][name])
    if "items" in s:
        s["items"] = _strict(s["items"])
    if isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = _strict(s["additionalProperties"])
    return s


def _has_value(value: Any) -> Any:
    """``optional.hasValue()``: on a create, ``oldSelf`` (bound to None) has none."""
    return celpy.celtypes.BoolType(value is not None)


def _rule_errors(schema: dict[str, Any], obj: Any, path: str) -> list[tuple[str, str]]:
    """The rules on this one node, as on a create (a transition rule runs on updates only,
    unless it has ``optionalOldSelf``: then its ``oldSelf`` is an optional without a value)."""
    errors: list[tuple[str, str]] = []
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"] and not rule.get("optionalOldSelf"):
            continue
        env = celpy.Environment()
        program = env.program(env.compile(rule["rule"]), functions={"hasValue": _has_value})
        if not bool(program.evaluate({"self": celpy.json_to_cel(obj), "oldSelf": None})):
            errors.append((path + rule.get("fieldPath", ""), rule["message"]))
    return errors


def _cel_errors(schema: dict[str, Any], obj: Any, path: str) -> list[tuple[str, str]]:
    errors: list[tuple[str, str]] = []
    if isinstance(obj, dict) and schema.get("type") == "object":
        errors += _rule_errors(schema, obj, path)
        for name, sub in schema.get("properties", {}).items():
            if name in obj:
                errors += _cel_errors(sub, obj[name], f"{path}.{name}")
    elif isinstance(obj, list) and schema.get("type") == "array":
        for i, item in enumerate(obj):
            errors += _cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def api_server_errors(crd: dict[str, Any], doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(field path, message) for each reason the API server would refuse `doc`."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    obj = _prune_and_default(schema, doc)
    errors = []
    for e in jsonschema.Draft4Validator(_strict(schema)).iter_errors(obj):
        errors.append((".".join(str(p) for p in e.absolute_path), e.message))
    if errors:  # the API server runs CEL only on schema-valid objects
        return errors
    # The root's rules (metadata.name), then the spec's; a root rule without a fieldPath is
    # reported at the root (""), as the API server reports it.
    return _rule_errors(schema, obj, "") + _cel_errors(schema["properties"]["spec"], obj.get("spec", {}), "spec")
