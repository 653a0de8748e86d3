"""The network: pure PyTorch, no training code and no Lightning import.

Usage: `from model import GPT, GPTConfig`.
"""

from model.attention import ATTENTIONS
from model.config import GPTConfig
from model.gpt import GPT
from model.positions import SCHEMES

POS_ENCODINGS: tuple[str, ...] = tuple(SCHEMES)
"""The position schemes' names (`model.positions.SCHEMES`)."""

__all__ = ["ATTENTIONS", "GPT", "GPTConfig", "POS_ENCODINGS", "SCHEMES"]
