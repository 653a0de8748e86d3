"""The network: pure PyTorch, no training code and no Lightning import.

Usage: `from posgpt.model import GPT, GPTConfig`. Importing `GPTConfig` imports no attention kernel (nor
torch's FlexAttention): the model and the registries are imported when first named here.
"""

from importlib import import_module
from typing import Any

from posgpt.model.config import GPTConfig

_WHERE = {"GPT": "posgpt.model.gpt", "ATTENTIONS": "posgpt.model.attention", "SCHEMES": "posgpt.model.positions"}


def __getattr__(name: str) -> Any:
    if name == "POS_ENCODINGS":  # the position schemes' names (`model.positions.SCHEMES`)
        return tuple(import_module("posgpt.model.positions").SCHEMES)
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ATTENTIONS", "GPT", "GPTConfig", "POS_ENCODINGS", "SCHEMES"]
