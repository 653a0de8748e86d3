"""What each `GPTConfig` field is to the rest of the code (a kind may set it, a switch or a resume may change it,
...), declared once on the field with `role` and read with `GPTConfig.fields_with`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from enum import Enum
from typing import Any


class Role(Enum):
    """What a `GPTConfig` field is to the rest of the code, declared on the field (`role`), read by `fields_with`."""

    KIND = "a kind of a layout may set it for its layers (model/layout.py)"
    SWITCH = "`GPT.switch` may change it (DroPE): no weight changes shape or meaning"
    RESUME = "a resumed run may change it: the weights keep their shapes and meaning (RoPE scaling: fine-tuning longer)"
    QUERY = "it acts on a score's queries (and keys): refused where the attention function scores no pairs"
    SCALE = "it scales the query of a dot-product score"
    LAYER = "an option of the attention layer itself, beside scheme, mask and function: test matrices run each value"


def role(
    default: Any, *roles: Role, scheme: str | None = None, before: tuple[Any, Callable[[dict], bool]] | None = None
) -> Any:
    """A field's default and what the field is: its `roles`; `scheme`, the position scheme that reads it (so a
    switch may change it and a kind may set it); `before`, the value recorded configs that lack the field had, where
    the field changed what a model computes when it was added, and which recorded configs it applies to."""
    roles += (Role.SWITCH, Role.KIND) if scheme else ()
    return field(default=default, metadata={"roles": frozenset(roles), "scheme": scheme, "before": before})
