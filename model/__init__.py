"""The network: pure PyTorch, no training code and no Lightning import.

Usage: `from model import GPT, GPTConfig`.
"""

from model.config import ATTN_BACKENDS, POS_ENCODINGS, GPTConfig
from model.gpt import GPT

__all__ = ["ATTN_BACKENDS", "GPT", "GPTConfig", "POS_ENCODINGS"]
