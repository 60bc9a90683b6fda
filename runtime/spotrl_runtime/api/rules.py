"""Cross-field rules of the RLJob API, written once for both validators.

A field's own type, range and enum live on the pydantic field. A rule that relates two
fields lives here as a :class:`Rule`: a CEL expression the Kubernetes API server evaluates
(``x-kubernetes-validations`` in the CRD) and the same relation as a Python predicate the
model evaluates. ``tests/unit/api`` checks that the two agree on a corpus of documents.

One rule is on the whole document rather than on an object of the spec: :data:`JOB_NAME_RULE`,
on ``metadata.name`` (an untyped object in the CRD's schema; CEL at the schema's root reads
``self.metadata.name``). :func:`~spotrl_runtime.api.rljob.parse_rljob` does not run it: a local
``spotrl run`` makes no Service, and takes any DNS-1123 subdomain.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError


@dataclass(frozen=True)
class Rule:
    """A relation between fields of one object of the spec."""

    cel: str
    """CEL over ``self`` (the object the rule is attached to), as the API server runs it."""
    check: Callable[[Any], bool]
    """The same relation over the pydantic object."""
    message: str
    """Shown to the user by both validators; says what is allowed."""
    field: str
    """The field the message is about, relative to the object (camelCase, no leading dot)."""


def exactly_one(first: str, second: str, message: str = "") -> Rule:
    """The rule that exactly one of two optional fields (their Python names) is set; the message
    names both unless ``message`` says it better."""
    a, b = to_camel(first), to_camel(second)
    return Rule(
        cel=f"has(self.{a}) != has(self.{b})",
        check=lambda o: (getattr(o, first) is None) != (getattr(o, second) is None),
        message=message or f"set exactly one of {a} and {b}",
        field=a,
    )


class ApiObject(BaseModel):
    """Base of every object in the RLJob API: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        validate_default=True,
    )

    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> ApiObject:
        for rule in type(self).rules:
            if not rule.check(self):
                raise PydanticCustomError("rljob_rule", rule.message, {"field": rule.field})
        return self


# The longest RLJob name whose every derived name and label Kubernetes accepts. What the
# operator derives from the name (spotrl_operator.resources: names(), the pod name builders,
# labels(), event(); queueing.workload_name()), with what Kubernetes allows each:
# - the Service, named <job>: a DNS-1035 label, at most 63 characters;
# - label values (spotrl.dev/job, app.kubernetes.io/instance, spotrl.dev/retention-of), <job>:
#   at most 63 characters;
# - the ServiceAccount, Role and RoleBinding <job>-runtime, the PodDisruptionBudget
#   <job>-controller, the NetworkPolicy <job>, the pods <job>-controller-<attempt>,
#   <job>-{worker,trainer}-<attempt>-<index> and <job>-retention-<try>, the Events
#   <job>.<16 hex digits>: DNS-1123 subdomains, at most 253 characters, so a name of 63 leaves
#   190 for the suffix (the longest: an Event's, 17, or a node pod's, "-trainer-" and "-" and
#   an index under 1024, 14 plus the attempt's digits); the Kueue Workload cuts the name to fit.
# So the name itself, as the Service's name and a label value, decides: 63. (A pod name over
# 63 characters is allowed: the kubelet cuts the pod's hostname to 63, which nothing resolves.)
JOB_NAME_MAX = 63
JOB_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A DNS-1035 label (the Service's name): a lowercase letter first, then lowercase letters,
digits and '-', a letter or digit last."""


def job_name_ok(name: Any) -> bool:
    """Whether ``name`` is an RLJob name the operator can make every object of the job for."""
    return isinstance(name, str) and len(name) <= JOB_NAME_MAX and re.fullmatch(JOB_NAME, name) is not None


JOB_NAME_RULE = Rule(
    cel=f"size(self.metadata.name) <= {JOB_NAME_MAX} && self.metadata.name.matches('{JOB_NAME}')",
    check=lambda job: job_name_ok(job.metadata.get("name")),
    message=(
        f"metadata.name must be at most {JOB_NAME_MAX} characters of lowercase letters, digits and '-', "
        "starting with a letter and ending with a letter or digit (a DNS-1035 label: the job's Service "
        "is named after it and its labels carry it); pick a shorter name of lowercase letters, digits "
        "and '-', starting with a letter"
    ),
    field="metadata.name",
)
"""On the whole RLJob document (``check``: over :class:`~spotrl_runtime.api.rljob.RLJob`); in the
CRD at the schema's root, checked when the job is created (its name never changes after)."""
