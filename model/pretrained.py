"""OpenAI's GPT-2 weights in this model: found in the Hugging Face cache or a directory, read with the
safetensors package (no transformers import), mapped onto this GPT's parameters.

GPT-2 is this architecture with learned positions, biases, a tied head and the tanh approximation of
GELU (`gelu_approximate: tanh`); its attention and MLP matrices are stored transposed (Conv1D, (in, out)).
A model of another position scheme is built as GPT-2 (learned positions), loaded, then switched to its
scheme (`GPT.switch`): the blocks keep GPT-2's weights, the position table goes, a scheme's own
parameters start fresh, as a switch mid-training does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch
from torch import Tensor

from core.errors import UserError
from model.config import GPTConfig
from model.gpt import GPT
from model.positions import SCHEMES

VARIANTS = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
            "gpt2-xl": (48, 25, 1600)}  # fmt: skip
"""OpenAI's GPT-2 models on the Hugging Face hub: (n_layer, n_head, n_embd)."""
GPT2_POSITIONS = "learned"
"""GPT-2's position scheme: a learned table of 1024 positions."""
WEIGHTS = "model.safetensors"
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
"""GPT-2's Conv1D weights, stored (in, out) where a Linear keeps (out, in)."""
NAMES = {"ln_1": "ln_1", "ln_2": "ln_2", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
         "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}  # fmt: skip
"""A block's parameters: GPT-2's name -> this model's."""


class PretrainedError(UserError):
    """Pretrained weights that cannot be found, read or fitted to the configured model."""


def hub_cache() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home) / "hub"


def weights_file(source: str) -> Path:
    """The model.safetensors that `source` (a GPT-2 name or a directory) names."""
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / WEIGHTS).is_file():
            return path / WEIGHTS
        raise PretrainedError(f"--model.init_from {source}: the directory holds no {WEIGHTS}.")
    if source not in VARIANTS:
        raise PretrainedError(
            f"--model.init_from {source}: neither a directory nor one of {', '.join(VARIANTS)}."
        )
    repo = hub_cache() / f"models--{source}"
    ref = repo / "refs" / "main"
    snapshots = [repo / "snapshots" / ref.read_text().strip()] if ref.is_file() else []
    snapshots += sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for snapshot in snapshots:
        if (snapshot / WEIGHTS).is_file():
            return snapshot / WEIGHTS
    raise PretrainedError(
        f"--model.init_from {source}: no {WEIGHTS} in the Hugging Face cache ({repo}). Download it once with "
        f"`huggingface-cli download {source} {WEIGHTS} config.json`, or pass a directory that holds it."
    )


def read_weights(path: Path) -> dict[str, Tensor]:
    """GPT-2's tensors by their GPT-2 names (a `transformer.` prefix, as GPT2LMHeadModel saves them, dropped)."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise PretrainedError("Reading GPT-2 weights needs the safetensors package: pip install safetensors.") from None
    try:
        tensors = load_file(str(path))
    except Exception as error:  # safetensors raises its own SafetensorError for a damaged file
        raise PretrainedError(f"Cannot read {path}: {error}") from None
    return {name.removeprefix("transformer."): t for name, t in tensors.items()}


def config_heads(path: Path) -> int | None:
    """n_head from the config.json beside the weights, when there is one."""
    config = path.parent / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("n_head")


def check_shape(config: GPTConfig, weights: dict[str, Tensor], source: str, heads: int | None) -> None:
    """Refuse, in one line naming the settings, a model whose shape is not the weights'."""
    vocab, width = weights["wte.weight"].shape
    positions = weights["wpe.weight"].shape[0]
    layers = len({int(m.group(1)) for name in weights if (m := re.match(r"h\.(\d+)\.", name))})
    heads = VARIANTS[source][1] if source in VARIANTS else heads or config.n_head
    wanted = {"n_layer": layers, "n_head": heads, "n_embd": width, "bias": True, "gelu_approximate": "tanh"}
    wrong = {k: v for k, v in wanted.items() if getattr(config, k) != v}
    if wrong:
        flags = " ".join(f"--model.{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in wanted.items())
        raise PretrainedError(
            f"--model.init_from {source} holds a model of {layers} layers, {heads} heads, {width} wide, with biases "
            f"and tanh GELU; this one differs in {', '.join(wrong)}: pass {flags} (configs/finetune_gpt2.yaml has "
            "GPT-2 small's)."
        )
    if config.vocab_size != vocab:
        raise PretrainedError(
            f"--model.init_from {source} has a vocabulary of {vocab} tokens, the data's tokenizer {config.vocab_size}: "
            "pass --data.tokenizer gpt2."
        )
    if SCHEMES[config.pos_encoding].longest(config) is not None and config.block_size > positions:  # a table
        raise PretrainedError(
            f"--model.init_from {source} has {positions} learned positions: pass --model.block_size {positions} or "
            "less, or another --model.pos_encoding (its table is then replaced)."
        )


def gpt2_state(weights: dict[str, Tensor], model: GPT) -> dict[str, Tensor]:
    """This model's state dict filled from GPT-2's tensors (the vocabulary padded with zero rows, the
    position table cut to block_size)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    vocab = weights["wte.weight"].shape[0]
    state["wte.weight"][:vocab] = weights["wte.weight"]
    state["wte.weight"][vocab:] = 0
    state["lm_head.weight"] = state["wte.weight"]
    rows = min(model.config.block_size, weights["wpe.weight"].shape[0])  # more rows: a table switched away
    state["pe.table.weight"][:rows] = weights["wpe.weight"][:rows]
    for name in ("weight", "bias"):
        state[f"ln_f.{name}"] = weights[f"ln_f.{name}"]
    for layer in range(model.config.n_layer):
        for theirs, ours in NAMES.items():
            for kind in ("weight", "bias"):
                tensor = weights[f"h.{layer}.{theirs}.{kind}"]
                state[f"blocks.{layer}.{ours}.{kind}"] = tensor.t() if f"{theirs}.{kind}" in TRANSPOSED else tensor
    return state


def from_pretrained(config: GPTConfig) -> GPT:
    """A GPT of `config` holding the weights `config.init_from` names (see the module docstring)."""
    source = config.init_from or ""
    path = weights_file(source)
    weights = read_weights(path)
    check_shape(config, weights, source, config_heads(path))
    as_gpt2 = dataclasses.replace(config, pos_encoding=GPT2_POSITIONS)
    model = GPT(as_gpt2)
    with torch.no_grad():
        model.load_state_dict({k: v.to(torch.float32) for k, v in gpt2_state(weights, model).items()})
    if config.pos_encoding != as_gpt2.pos_encoding:
        model.switch(config)
    return model
