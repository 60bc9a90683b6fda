"""Cross-field rules of the RLJob API, written once for both validators.

A field's own type, range and enum live on the pydantic field. A rule that relates two
fields lives here as a :class:`Rule`: a CEL expression the Kubernetes API server evaluates
(``x-kubernetes-validations`` in the CRD) and the same relation as a Python predicate the
model evaluates. ``tests/unit/api`` checks that the two agree on a corpus of documents.
"""

from __future__ import annotations

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
