"""OpenAI's GPT-2 weights in this model: found in the Hugging Face cache or a directory, read with
safetensors (no transformers import), mapped onto this GPT's parameters. A model of another position
scheme is built as GPT-2, loaded, then switched to its scheme (`GPT.switch`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch
from torch import Tensor

from posgpt.core.errors import ConfigError, UserError
from posgpt.model.config import GPTConfig
from posgpt.model.gpt import GPT
from posgpt.model.positions import SCHEMES

GPT2_SHAPES = {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024), "gpt2-large": (36, 20, 1280),
               "gpt2-xl": (48, 25, 1600)}  # fmt: skip
"""OpenAI's GPT-2 models on the Hugging Face hub (`init_from`): (n_layer, n_head, n_embd)."""
WEIGHTS = "model.safetensors"
HUB_URL = "https://huggingface.co"
TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
"""GPT-2's Conv1D weights, stored (in, out) where a Linear keeps (out, in)."""
NAMES = {"ln_1": "ln_1", "ln_2": "ln_2", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
         "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}  # fmt: skip
"""A block's parameters: GPT-2's name -> this model's."""


class PretrainedError(UserError):
    """Pretrained weights that cannot be found, read or fitted to the configured model."""


def hub_cache() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    hub = os.environ.get("HF_HUB_CACHE")
    return Path(hub) if hub else Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"


def weights_file(source: str) -> Path:
    """The model.safetensors that `source` (a GPT-2 name or a directory) names."""
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / WEIGHTS).is_file():
            return path / WEIGHTS
        raise PretrainedError(f"--model.init_from {source}: the directory holds no {WEIGHTS}.")
    if source not in GPT2_SHAPES:
        raise PretrainedError(f"--model.init_from {source}: not a directory, a checkpoint (.ckpt) or one of "
                              f"{', '.join(GPT2_SHAPES)}.")  # fmt: skip
    repo = hub_cache() / f"models--{source}"
    ref = repo / "refs" / "main"
    snapshots = [repo / "snapshots" / ref.read_text().strip()] if ref.is_file() else []
    snapshots += sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for snapshot in snapshots:
        if (snapshot / WEIGHTS).is_file():
            return snapshot / WEIGHTS
    raise PretrainedError(
        f"--model.init_from {source}: no {WEIGHTS} in the Hugging Face cache ({repo}). Put {WEIGHTS} and "
        f"config.json from {HUB_URL}/openai-community/{source} (Files) in a directory and pass --model.init_from DIR, "
        f"or fetch them into the cache with `pip install huggingface_hub` and `hf download {source} {WEIGHTS} "
        "config.json`."
    )


def names_checkpoint(source: str | None) -> bool:
    """Whether `init_from` names a posgpt checkpoint to fine-tune: a file, or a name ending in .ckpt."""
    return bool(source) and (str(source).endswith(".ckpt") or Path(str(source)).expanduser().is_file())


def check_pretrained(config: GPTConfig) -> Path:
    """What `from_pretrained` would refuse, found from the file's header before any data is prepared, in one line
    naming the settings: weights that are not GPT-2's layout, or a model whose shape is not the weights'; the file."""
    source = config.init_from or ""
    path = weights_file(source)
    weights = read_weights(path, meta=True)
    heads, config_json = None, path.parent / "config.json"  # n_head: the weights do not record the head count
    if config_json.is_file():  # read (and refused when unreadable, not passed over) whatever the source
        try:
            settings = json.loads(config_json.read_text(encoding="utf-8"))
            problem = "" if isinstance(settings, dict) else "not a JSON object"
        except json.JSONDecodeError as error:
            problem = f"not valid JSON ({error}; a download cut short?)"
        except UnicodeDecodeError:
            problem = "not valid JSON (not UTF-8 text)"
        if problem:
            raise PretrainedError(
                f"--model.init_from {source}: {config_json} is {problem}. Fetch it again from where the weights came "
                "from, or delete it and pass the head count as --model.n_head."
            )
        heads = settings.get("n_head")
    layers = sorted({int(m.group(1)) for name in weights if (m := re.match(r"h\.(\d+)\.", name))})
    needed = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
    needed += [f"h.{i}.{theirs}.{kind}" for i in layers for theirs in NAMES for kind in ("weight", "bias")]
    missing = [name for name in needed if name not in weights]
    if missing or not layers:
        raise PretrainedError(
            f"--model.init_from {source}: not GPT-2's layout (GPT2LMHeadModel's tensor names), missing "
            f"{', '.join(missing[:3]) or 'h.0.*'}{' ...' if len(missing) > 3 else ''}."
        )
    vocab, width = weights["wte.weight"].shape
    positions = weights["wpe.weight"].shape[0]
    heads = GPT2_SHAPES[source][1] if source in GPT2_SHAPES else heads or config.n_head
    refuse_other_shape(config, source, (len(layers), heads, width), PretrainedError)
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
    return path


def read_weights(path: Path, meta: bool = False) -> dict[str, Tensor]:
    """GPT-2's tensors by their GPT-2 names (without `transformer.`); with `meta`, on the meta device (nothing read)."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise PretrainedError("Reading GPT-2 weights needs the safetensors package: pip install safetensors.") from None
    try:
        with safe_open(str(path), "pt") as f:
            tensors = {
                name: torch.empty(f.get_slice(name).get_shape(), device="meta") if meta else f.get_tensor(name)
                for name in f.keys()
            }
    except Exception as error:  # safetensors raises its own SafetensorError for a damaged file
        raise PretrainedError(f"Cannot read {path}: {error}. Download it again (a download cut short?).") from None
    return {name.removeprefix("transformer."): t for name, t in tensors.items()}


def from_pretrained(config: GPTConfig) -> GPT:
    """A GPT of `config` holding the weights `config.init_from` names (see the module docstring): GPT-2's tensors
    copied into a model of GPT-2's scheme, the position table cut to block_size, then switched to `config`'s.
    Padded vocabulary rows get the mean row: a zero row's logit 0 would be far above GPT-2's mostly negative
    logits, while a mean row adds at most 47/50257 to the softmax's normaliser (Jensen)."""
    weights = read_weights(check_pretrained(config))
    as_gpt2 = dataclasses.replace(config, pos_encoding="learned")  # GPT-2's: a table of 1024 positions
    model = GPT(as_gpt2)
    state = model.state_dict()  # detached views of the parameters, copied into in place
    vocab = weights["wte.weight"].shape[0]
    state["wte.weight"][:vocab] = weights["wte.weight"]
    state["wte.weight"][vocab:] = weights["wte.weight"].to(torch.float64).mean(0)
    rows = min(config.block_size, weights["wpe.weight"].shape[0])
    state["pe.table.weight"][:rows] = weights["wpe.weight"][:rows]
    for kind in ("weight", "bias"):
        state[f"ln_f.{kind}"].copy_(weights[f"ln_f.{kind}"])
        for layer in range(config.n_layer):
            for theirs, ours in NAMES.items():
                tensor = weights[f"h.{layer}.{theirs}.{kind}"]
                state[f"blocks.{layer}.{ours}.{kind}"].copy_(tensor.t() if f"{theirs}.{kind}" in TRANSPOSED else tensor)
    if config.pos_encoding != as_gpt2.pos_encoding:
        model.switch(config)
    return model


def check_gpt2_shape(config: GPTConfig) -> None:
    """Refuse a model that the GPT-2 weights `config.init_from` names do not fit, when the run's config is built
    (the config says what the model is, not the weights)."""
    if config.init_from in GPT2_SHAPES:
        refuse_other_shape(config, config.init_from, GPT2_SHAPES[config.init_from], ConfigError)


def refuse_other_shape(config: GPTConfig, source: str, shape: tuple[int, int, int], error: type[Exception]) -> None:
    """Raise `error`, in one line naming every option to pass, when `config` is not a GPT-2 model of `shape`
    (n_layer, n_head, n_embd)."""
    layers, heads, width = shape
    wanted = {"n_layer": layers, "n_head": heads, "n_kv_head": heads, "n_embd": width, "bias": True,
              "gelu_approximate": "tanh"}  # fmt: skip
    actual = {**{k: getattr(config, k) for k in wanted}, "n_kv_head": config.kv_heads}  # GPT-2's heads are whole
    wrong = [k for k, v in wanted.items() if actual[k] != v]
    if wrong:
        flags = " ".join(f"--model.{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in wanted.items())
        raise error(
            f"--model.init_from {source} holds a model of {layers} layers, {heads} heads, {width} wide, with biases "
            f"and tanh GELU; this one differs in {', '.join(wrong)}: pass {flags} (and --data.tokenizer gpt2)."
        )
