"""The zero-shot retrieval probes (data/probes.py, evaluation/probes.py) and key-token perplexity: the references'
strings word for word, the needle at its depth, no answer outside its needle, prompts fitted to a length, scoring
through the sampler's batched padded decoding, and LongPPL's key tokens on a case where they are known."""

from __future__ import annotations

import random
import re
import string

import pytest
import torch
from torch import nn

from posgpt.data.probes import FILLER, PROBES, passkey, trials, variable_tracking
from posgpt.data.tokenizer import CharTokenizer
from posgpt.evaluation.extrapolation import evaluate_length
from posgpt.evaluation.probes import SEED, probe_rows
from posgpt.model import GPT, GPTConfig

CHARS = CharTokenizer(string.printable)
TEXT = "Alpha beta gamma. Delta epsilon zeta! Eta theta iota? Kappa lambda mu. " * 40


def test_passkey_is_the_landmark_and_yarn_prompt_word_for_word():
    """llama/run_test.py (landmark attention) and YaRN's eval/passkey.py: lines joined by new lines, the filler
    repeated with spaces and cut to characters before and after the key's line."""
    prompt, answers, _ = passkey(random.Random(3), 200, 0.25, "")
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    garbage = " ".join([filler] * 3)
    key = answers[0]
    assert prompt == "\n".join([
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz "
        "you about the important information there.",
        garbage[:50], f"The pass key is {key}. Remember it. {key} is the pass key.", garbage[:150],
        "What is the pass key? The pass key is",
    ])  # fmt: skip
    assert 1 <= int(key) <= 50000


@pytest.mark.parametrize(
    ("name", "value", "question"),
    [("niah_single_1", "number", "What is the special magic number for {q} mentioned in the provided text? The "
      "special magic number for {q} mentioned in the provided text is"),
     ("niah_multikey_3", "uuid", "What is the special magic uuid for {q} mentioned in the provided text? The special "
      "magic uuid for {q} mentioned in the provided text is"),
     ("niah_multivalue", "numbers", "What are all the special magic numbers for {q} mentioned in the provided text? "
      "The special magic numbers for {q} mentioned in the provided text are"),
     ("niah_multiquery", "numbers", "What are all the special magic numbers for {q} mentioned in the provided text? "
      "The special magic numbers for {q} mentioned in the provided text are")],
)  # fmt: skip
def test_ruler_needles_are_its_template_needle_and_singular_form_word_for_word(name, value, question):
    """NVIDIA/RULER scripts/data/synthetic/constants.py (template + answer prefix) and niah.py (needle, query, the
    singular form of a one-answer template)."""
    prompt, answers, needles = PROBES[name].make(random.Random(1), 30, 0.5, TEXT)
    head = "Some special magic numbers are hidden" if value == "numbers" else f"A special magic {value} is hidden"
    assert prompt.startswith(f"{head} within the following text. Make sure to memorize it. I will quiz you about the "
                             f"{value} afterwards.\n")  # fmt: skip
    keys = [re.search(r"for (\S+) is: ", n).group(1) for n in needles]
    asked = [k for k, n in zip(keys, needles, strict=True) if any(a in n for a in answers)]
    query = ", ".join(dict.fromkeys(asked))
    query = re.sub(r", ([^,]+)$", r", and \1", query) if name == "niah_multiquery" else query
    assert prompt.endswith("\n" + question.format(q=query))
    plural = value if value.endswith("s") else value + "s"
    assert all(re.fullmatch(rf"One of the special magic {plural} for \S+ is: \S+\.", n) for n in needles)
    assert len(answers) == (4 if name in ("niah_multivalue", "niah_multiquery") else 1)


def test_variable_tracking_is_rulers_template_chain_and_one_shot_example():
    """NVIDIA/RULER variable_tracking.py: the chain `VAR X = value`, `VAR Y = VAR X `, the template with its answer
    prefix, and the one-shot example (its answer after it) before the task."""
    prompt, names, chain = variable_tracking(random.Random(2), 6, 0.5)
    value = chain[0].split("= ")[1]
    assert chain == [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4)]
    assert prompt.startswith("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n")
    assert prompt.endswith(f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
                           "Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
                           f"are assigned the value {value}, they are: ")  # fmt: skip
    assert all(len(n) == 5 and n.isupper() for n in names) and prompt.count(FILLER) == 6
    cell = trials("vt", 2000, 0.5, 1, CHARS.encode, SEED)
    shown, task = cell[0].text.split("\n\nMemorize and track")  # the example's own new line, and one to join it
    assert shown.startswith("Memorize and track") and re.fullmatch(r".*they are:  [A-Z]{3}( [A-Z]{3}){4}", shown, re.S)
    assert len(CHARS.encode(shown)) <= 500  # RULER's budget for the example


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_the_needle_sits_at_the_asked_depth_and_its_answer_nowhere_else(depth):
    """Within one unit of the haystack (a line of the filler or of other needles, a sentence of the user's text;
    passkey: the character); and no answer appears outside its needle(s), in every probe."""
    for name, probe in PROBES.items():
        prompt, answers, needles = probe.make(random.Random(5), 40, depth, TEXT)
        outside = prompt
        for needle in needles:
            outside = outside.replace(needle, "", 1)
        assert not any(a in outside for a in answers), name
        first = next(n for n in needles if answers[0] in n)  # the first asked: at the depth
        if probe.haystack and depth in (0.0, 1.0):  # RULER joins the cut text's pieces and the needles by spaces
            assert ("afterwards.\n One of" if depth == 0 else ". \nWhat") in prompt, name
        if name == "passkey":
            assert prompt.split("\n")[1] == " ".join([FILLER] * 2)[: round(40 * depth)]
            continue
        context = prompt.split("afterwards.\n" if "afterwards" in prompt else "text.\n\n")[-1].split("\nWhat")[0]
        context = context.split("\nQuestion")[0]
        before, after = context.split(first, 1)
        for needle in needles:  # the haystack alone, before and after the needle
            before, after = before.replace(needle, ""), after.replace(needle, "")
        units = re.split(r"(?<=[.!?])\s+" if probe.haystack else "\n", before + after)
        longest = max(len(u) for u in units) + 2
        assert abs(len(before) - depth * len(before + after)) <= longest, (name, len(before), len(before + after))


def test_a_prompt_fills_its_length_and_leaves_room_for_the_answer():
    for name in ("passkey", "niah_multikey_2", "vt"):
        for trial in trials(name, 1500, 0.5, 2, CHARS.encode, SEED, TEXT):
            assert len(trial.prompt) + PROBES[name].answer_tokens <= 1500
            assert len(trial.prompt) + PROBES[name].answer_tokens > 1500 - 200  # the largest haystack that fits
    assert "needs" in trials("niah_single_1", 200, 0.5, 1, CHARS.encode, SEED)  # the template alone is longer
    assert "cannot encode" in probe_rows(GPT(CONFIG), CharTokenizer("abc "), ["passkey"], [64], [0.5], 1)[0]["reason"]


CONFIG = GPTConfig(vocab_size=len(CHARS.chars), block_size=32, n_layer=1, n_head=2, n_embd=16, pos_encoding="rope")


class Oracle(GPT):
    """A real GPT whose logits are replaced by one-hot ones spelling each row's `answers[prompt]`: the sampler's
    batched, padded, cached decoding runs as for any model, and the answer is what the probe then scores."""

    def __init__(self, answers: dict[str, str]) -> None:
        super().__init__(CONFIG)
        self.answers, self.rows = answers, []

    def forward(self, idx, targets=None, cache=None, last_only=False, positions=None, lengths=None):
        logits, _ = super().forward(idx, cache=cache, last_only=last_only, lengths=lengths)
        if lengths is not None:  # the prefill: each row's prompt
            self.rows = [[CHARS.decode(row[:n].tolist()), 0] for row, n in zip(idx, lengths.tolist(), strict=True)]
        out = torch.full_like(logits, -1e4)
        for b, row in enumerate(self.rows):
            text = self.answers[row[0]] + "." * 200
            out[b, -1, CHARS.encode(text[row[1]])[0]] = 0.0
            row[1] += 1
        return out, None


@pytest.mark.parametrize(("name", "right"), [("passkey", 1.0), ("niah_multivalue", 1.0), ("niah_multivalue", 0.5),
                                             ("niah_single_1", 0.0)])  # fmt: skip
def test_scoring_through_the_samplers_padded_batched_decoding(name, right):
    """An oracle that answers right scores 100%, one that answers wrong 0%; multi-value answered in half: 50%."""
    cell = trials(name, 700, 0.5, 3, CHARS.encode, SEED, TEXT)
    said = {t.text: " " + ", ".join(t.answers[: int(len(t.answers) * right)] or ["1234567"]) for t in cell}
    row = probe_rows(Oracle(said), CHARS, [name], [700], [0.5], 3, TEXT)[0]
    assert row["applicable"] and row["score"] == pytest.approx(right)


class Copier(GPT):
    """Predicts each token perfectly where its copy `PERIOD` tokens back is in view, else uniformly."""

    PERIOD = 24

    def __init__(self) -> None:
        super().__init__(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=1, n_embd=8, pos_encoding="none"))
        self.lm_head = nn.Identity()

    def hidden_states(self, idx):
        B, T = idx.shape
        out = torch.zeros(B, T, self.config.padded_vocab_size)
        seen = torch.arange(T) + 1 - self.PERIOD >= 0  # the copy of token t + 1 at t + 1 - PERIOD is in view
        out[:, seen] = 30 * nn.functional.one_hot(idx[:, : int(seen.sum())], self.config.padded_vocab_size).float()
        return out


def test_key_tokens_are_those_the_long_context_predicts_and_a_short_one_cannot():
    """A text of period 24, a short window of 16: every token from the second period on is key (its copy out of
    the short window's reach), none before; their perplexity is the long context's, about 1."""
    tokens = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(0)).repeat(20).numpy()
    result = evaluate_length(Copier(), tokens, 96, token_budget=96 * 4, short_window=16)
    assert result.key_tokens == 4 * (96 - 23) and result.key_ppl == pytest.approx(1.0, abs=1e-6)
    assert result.ppl > 2  # the first period's tokens are guessed
