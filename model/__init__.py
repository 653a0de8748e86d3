"""The network: pure PyTorch, no training code and no Lightning import.

Usage: `from posgpt.model import GPT, GPTConfig`. Importing `GPTConfig` imports no attention kernel (nor
torch's FlexAttention): the model and the registries are imported when first named here.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from posgpt.model.config import GPTConfig

if __name__ != "posgpt.model":  # `import model` from the checkout's root: a second copy of every module
    raise ImportError("this package is posgpt.model: import posgpt.model")

if TYPE_CHECKING:  # what __getattr__ returns, for type checkers and editors
    from posgpt.model.attention import ATTENTIONS
    from posgpt.model.gpt import GPT
    from posgpt.model.positions import SCHEMES

    POS_ENCODINGS: tuple[str, ...]

_WHERE = {"GPT": "posgpt.model.gpt", "ATTENTIONS": "posgpt.model.attention", "SCHEMES": "posgpt.model.positions"}


def __getattr__(name: str) -> Any:
    if name == "POS_ENCODINGS":  # the position schemes' names (`model.positions.SCHEMES`)
        return tuple(import_module("posgpt.model.positions").SCHEMES)
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ATTENTIONS", "GPT", "GPTConfig", "POS_ENCODINGS", "SCHEMES"]
