"""Zero-shot retrieval probes, as extrapolation papers score a language model never trained on them (docs/probes.md):
`passkey`, Mohtashami & Jaggi's prompt as the landmark-attention code (`llama/run_test.py`) and YaRN's
`eval/passkey.py` build it; RULER's needles (NVIDIA/RULER `scripts/data/synthetic/niah.py`, `constants.py`,
`synthetic.yaml`; those on the essays there take the user's text here) and variable tracking (`vt`,
`variable_tracking.py`). Each generator takes a seeded `random.Random`, the haystack's size (characters, lines or
words) and the depth of the (first asked) needle (None: the reference's draw), and returns the prompt, the answers
and the needles; `trials` fits prompts to a length, leaving room for the answer, as RULER's search does.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass

PASSKEY_TASK = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you "
    "about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz "
    "you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} "
    "mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: "
    "Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the "
    "value {query}, they are: "
)
VT_EXAMPLE_TOKENS = 500
"""RULER's budget for variable tracking's one-shot example."""
RULER_DEPTHS = [round(100 * i / 39) for i in range(40)]
"""RULER's 40 depths (%), from which the needles not placed at an asked depth are drawn."""
ADJECTIVES = (
    "able bitter brave bright calm cheap clever cold curious dark deep eager early empty fancy fierce gentle "
    "glad grand green happy heavy hollow honest huge jolly kind large lazy lively lucky mighty modern narrow noisy "
    "odd plain polite proud quick quiet rapid rare rich rough round royal rusty shiny silent simple sleepy slow "
    "smooth soft solid spicy steady strange strong sunny sweet swift tall tender tiny vast warm wild wise young"
).split()
NOUNS = (
    "anchor apple arrow badge banana basket beacon bell blanket bottle bridge bucket button camera candle canyon "
    "castle cattle chair cherry cloud compass copper cradle crystal desert diamond dragon drum eagle engine feather "
    "fence forest fountain garden giraffe glacier harbor helmet island jacket kettle ladder lantern lemon magnet "
    "meadow mirror monkey needle oasis orchard otter parrot pebble pencil piano pillow planet pocket puzzle rabbit "
    "ribbon river rocket saddle sailor shadow shelf signal spider spoon statue tiger tower turtle valley violin "
    "wagon walnut whistle window wizard"
).split()


Made = tuple[str, list[str], list[str]]
"""A generator's prompt, its answers and its needles (the lines that hold the answers)."""


@dataclass(frozen=True)
class Probe:
    """A probe: its generator (rng, haystack size, depth or None for the reference's draw, haystack text) ->
    `Made`, the tokens the reference generates, and how an answer is scored."""

    make: Callable[[random.Random, int, float | None, str], Made]
    answer_tokens: int
    score: Callable[[str, list[str]], float]
    haystack: bool = False
    """Whether it needs the user's text as its haystack."""


def first_integer(prediction: str, answers: list[str]) -> float:
    """YaRN's and the landmark code's scoring: the first integer of the answer is the key."""
    found = re.search(r"\d+", prediction)
    return float(found is not None and int(found.group()) == int(answers[0]))


def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER's: the share of the answers found in the prediction (case ignored), after RULER's clean-up (control
    characters to new lines, stripped)."""
    cleaned = re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip().lower()
    return sum(answer.lower() in cleaned for answer in answers) / len(answers)


def at_depth(count: int, depth: float | None, rng: random.Random) -> int:
    """Where among `count` places the needle goes: nearest `depth` (0 = start, 1 = end), or uniform (None)."""
    return rng.randint(0, count) if depth is None else round(depth * count)


def passkey(rng: random.Random, size: int, depth: float | None, haystack: str) -> Made:
    key = rng.randint(1, 50000)
    garbage = " ".join([FILLER] * (size // len(FILLER) + 1))
    before, line = at_depth(size, depth, rng), PASSKEY_LINE.format(key=key)
    return (
        "\n".join([PASSKEY_TASK, garbage[:before], line, garbage[: size - before], PASSKEY_QUESTION]),
        [str(key)],
        [line],
    )


def draw(kind: str, rng: random.Random) -> str:
    """RULER's keys and values: 7-digit numbers, adjective-noun words (from the lists above, for wonderwords'),
    UUIDs."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def niah(haystack_kind: str, key_kind: str, value_kind: str, keys: int = 1, values: int = 1, queries: int = 1):
    """A RULER needle task of `synthetic.yaml`'s arguments (`type_haystack`, `type_needle_k`, `type_needle_v`,
    `num_needle_k`, `num_needle_v`, `num_needle_q`)."""
    keys = max(keys, queries)

    def make(rng: random.Random, size: int, depth: float | None, text: str) -> Made:
        key_list = [draw(key_kind, rng) for _ in range(keys)]
        value_lists = [[draw(value_kind, rng) for _ in range(values)] for _ in key_list]
        needles = [NEEDLE.format(type_needle_v=value_kind, key=k, value=v)
                   for k, vs in zip(key_list, value_lists, strict=True) for v in vs]  # fmt: skip
        asked = rng.sample(range(keys), queries)  # in the order the question names them
        first = needles[asked[0] * values]  # at the asked depth; the others where RULER draws them
        others = [n for n in needles if n != first]
        rng.shuffle(others)
        if haystack_kind == "essay":  # RULER's words, then its sentences (split by a rule here, nltk's there)
            words = re.sub(r"\s+", " ", text).split(" ")
            words = (words * (size // max(1, len(words)) + 1))[:size]
            units = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(words).strip()) if s]
        elif haystack_kind == "noise":
            units = [FILLER] * size
        else:  # needle: other keys' needles, none with an asked key or value
            units = []
            while len(units) < size:
                k, v = draw(key_kind, rng), draw(value_kind, rng)
                if k not in key_list and all(v not in vs for vs in value_lists):
                    units.append(NEEDLE.format(type_needle_v=value_kind, key=k, value=v))
        places = [at_depth(len(units), depth, rng)]
        places += [int(len(units) * d / 100) for d in rng.sample(RULER_DEPTHS, len(others))]
        placed = sorted(zip(places, [first, *others], strict=True), key=lambda p: p[0])
        query_keys = [key_list[i] for i in asked]
        query = ", ".join(query_keys[:-1]) + ", and " + query_keys[-1] if queries > 1 else query_keys[0]
        template, kind = NIAH_TEMPLATE + NIAH_ANSWER_PREFIX, value_kind
        if queries * values == 1:  # RULER's singular form
            for plural, singular in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template = template.replace(plural, singular)
            kind = value_kind[:-1]
        if haystack_kind == "essay":  # RULER's: the text cut where the needles go, pieces and needles joined by spaces
            cuts = [0, *(place for place, _ in placed), len(units)]
            context = " ".join(units[: cuts[1]])
            for (_, needle), start, end in zip(placed, cuts[1:-1], cuts[2:], strict=True):
                context += f" {needle} {' '.join(units[start:end])}"
        else:
            for place, needle in reversed(placed):  # from the end: each place counts the haystack's units before it
                units.insert(place, needle)
            context = "\n".join(units)
        prompt = template.format(type_needle_v=kind, context=context, query=query)
        return prompt, [v for i in asked for v in value_lists[i]], needles

    return make


def variable_tracking(rng: random.Random, size: int, depth: float | None, example: bool = False,
                      hops: int = 4) -> Made:  # fmt: skip
    """RULER's `vt`, one chain: variables of 5 capitals (3 in the example, whose value is 12345) assigned along the
    chain among `size` lines of the filler; the chain's first line at `depth` and the rest after it, or all where
    RULER draws them (None)."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=3 if example else 5))
        names += [name] if name not in names else []
    value = "12345" if example else str(rng.randint(10000, 99998))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    if depth is None:  # RULER's draw (with replacement here: a haystack of fewer lines than the chain fits too)
        places = sorted(rng.choices(range(size + 1), k=len(chain)))
    else:
        first = at_depth(size, depth, rng)
        places = [first, *sorted(rng.randint(first, size) for _ in range(hops))]
    lines = [FILLER] * size
    for j, (place, line) in enumerate(zip(places, chain, strict=True)):
        lines.insert(place + j, line)
    context = "\n".join(lines).replace(". \n", ".\n")
    return (VT_TEMPLATE + VT_ANSWER_PREFIX).format(context=context, query=value, num_v=hops + 1), names, chain


def with_example(rng: random.Random, size: int, depth: float | None, example_size: int) -> Made:
    """`vt` with its one-shot example before the task (RULER's `add_fewshot`): the example's prompt and answer, its
    names and value drawn anew (RULER's `randomize_icl`)."""
    shown, names, _ = variable_tracking(rng, example_size, None, example=True)
    shown = f"{shown} {' '.join(names)}\n\n"  # RULER's example ends in a new line, and another joins it
    for name in names:
        shown = shown.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    shown = shown.replace("12345", str(rng.randint(10000, 99998)))
    prompt, answers, chain = variable_tracking(rng, size, depth)
    return shown + prompt, answers, chain


PROBES: dict[str, Probe] = {
    "passkey": Probe(passkey, 10, first_integer),
    "niah_single_1": Probe(niah("noise", "words", "numbers"), 128, string_match_all),
    "niah_multikey_2": Probe(niah("needle", "words", "numbers"), 128, string_match_all),
    "niah_multikey_3": Probe(niah("needle", "uuids", "uuids"), 128, string_match_all),
    "niah_multikey_1": Probe(niah("essay", "words", "numbers", keys=4), 128, string_match_all, haystack=True),
    "niah_multivalue": Probe(niah("essay", "words", "numbers", values=4), 128, string_match_all, haystack=True),
    "niah_multiquery": Probe(niah("essay", "words", "numbers", queries=4), 128, string_match_all, haystack=True),
    "vt": Probe(lambda rng, size, depth, text: with_example(rng, size, depth, 0), 30, string_match_all),
}
"""Each probe by name, with RULER's `tokens_to_generate` (passkey: YaRN's `max_new_tokens`)."""


@dataclass(frozen=True)
class Trial:
    """One prompt of a probe, fitted to a length: its tokens, text, answers and haystack size."""

    prompt: list[int]
    text: str
    answers: list[str]
    size: int


def fit(make: Callable[[int], Made], encode: Callable[[str], list[int]], room: int) -> Trial | None:
    """The prompt of the largest haystack `make(size)` gives whose tokens fit `room` (a binary search, as RULER's);
    None where not even an empty haystack fits, or where that prompt holds an answer outside its needles."""
    low, high = 0, 1
    while high <= 8 * room and len(encode(make(high)[0])) <= room:  # double until it no longer fits, then bisect
        low, high = high, high * 2
    while low < high - 1:
        mid = (low + high) // 2
        low, high = (mid, high) if len(encode(make(mid)[0])) <= room else (low, mid)
    text, answers, needles = make(low)
    outside = text
    for needle in needles:
        outside = outside.replace(needle, "", 1)
    ids = encode(text)
    return Trial(ids, text, answers, low) if len(ids) <= room and not any(a in outside for a in answers) else None


def trials(name: str, length: int, depth: float | None, count: int, encode: Callable[[str], list[int]], seed: int,
           haystack: str = "") -> list[Trial] | str:  # fmt: skip
    """`count` seeded prompts of probe `name`, each fitted to `length` tokens with room for its answer (a prompt
    with an answer outside its needles is drawn again); or why the cell cannot run."""
    probe, room = PROBES[name], length - PROBES[name].answer_tokens
    if probe.haystack and not haystack.strip():
        return "no text for its haystack"
    make = probe.make
    if name == "vt":  # the one-shot example: RULER's 500 tokens where the cell has room for them, else shrunk
        bare = len(encode(variable_tracking(random.Random(seed), 0, None)[0]))
        shown = fit(lambda n: variable_tracking(random.Random(seed), n, None, example=True), encode,
                    min(VT_EXAMPLE_TOKENS, room - bare))  # fmt: skip
        if shown is None:
            return f"variable tracking and its example need {2 * bare} tokens, the cell has {room} before the answer"
        make = lambda rng, size, depth, text: with_example(rng, size, depth, shown.size)  # noqa: E731
    out = []
    for trial in range(count):
        for attempt in range(100):
            key = f"{seed}:{name}:{length}:{depth}:{trial}:{attempt}"
            fitted = fit(lambda size, key=key: make(random.Random(key), size, depth, haystack), encode, room)
            if fitted is not None:
                out.append(fitted)
                break
            if len(encode(make(random.Random(key), 0, depth, haystack)[0])) > room:
                return f"the template needs more than {room} tokens (and {probe.answer_tokens} for the answer)"
        else:
            return "no prompt without its answers outside their needles in 100 draws"
    return out
