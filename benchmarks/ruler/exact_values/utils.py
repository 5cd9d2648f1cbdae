"""Exact values in long contexts: lm-eval tasks in RULER's form whose needle is a value a user copies
whole (a 7-10 digit number, a UUID, a name of several word pieces), hidden in repeated or in natural
filler. Scored three ways: exact (the value appears in the answer), partial (not exact, but the
answer holds at least half of the value's characters in order: the shape eviction leaves when it
drops a span's middle), miss.

Data are generated here from `seed` (lm-eval's `--metadata`, with `max_seq_lengths` and the
`tokenizer` that sizes each prompt), so a fresh seed gives cases no run has seen.
"""

from __future__ import annotations

import difflib
import random
import sys
import uuid
from functools import cache
from pathlib import Path

import datasets
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from confkv.models.corpus import paragraphs  # noqa: E402

LENGTHS = (4096, 8192, 16384)
CASES = 40  # per length; lm-eval's --limit takes the first ones
ANSWER_TOKENS = 32
TEMPLATE = (
    "A special magic {kind} is hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {kind} afterwards.\n{context}\nWhat is the special magic {kind} for {key} mentioned in the "
    "provided text?"
)
ANSWER_PREFIX = "The special magic {kind} for {key} mentioned in the provided text is"
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
REPEATED = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEYS_A = ("amber", "brisk", "candid", "dusty", "eager", "frosty", "gentle", "hollow", "ivory", "jolly", "keen")
KEYS_B = ("anchor", "badger", "canyon", "dagger", "ember", "falcon", "garnet", "harbor", "island", "jigsaw")
FIRST = ("Thaddeus", "Perpetua", "Ignatius", "Wilhelmina", "Bartholomew", "Eustacia", "Leopoldo", "Ottoline")
SYLLABLES = ("vrel", "ost", "kaz", "mun", "dra", "quil", "zeb", "orn", "tav", "hul", "pex", "gri", "lom", "sk")


def value_of(kind: str, rng: random.Random) -> str:
    if kind == "number":
        digits = rng.randint(7, 10)
        return str(rng.randrange(10 ** (digits - 1), 10**digits))
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    surname = "-".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).title() for _ in range(2))
    return f"{rng.choice(FIRST)} {surname}"


def filler(kind: str, rng: random.Random) -> list[str]:
    """Sentences of filler: RULER's repeated lines, or consecutive paragraphs of real prose."""
    if kind == "repeat":
        return [REPEATED] * 2000
    texts = paragraphs()
    start = rng.randrange(len(texts))
    return [texts[(start + i) % len(texts)] for i in range(len(texts))]


@cache
def tokenizer_of(name: str):
    return AutoTokenizer.from_pretrained(name)


def case(kind: str, haystack: str, length: int, index: int, seed: int, tokenizer) -> dict:
    rng = random.Random(f"{kind}/{haystack}/{length}/{seed}/{index}")
    value, key = value_of(kind, rng), f"{rng.choice(KEYS_A)}-{rng.choice(KEYS_B)}"
    units = filler(haystack, rng)
    needle = NEEDLE.format(kind=kind, key=key, value=value)
    depth = rng.random()

    def prompt(n: int) -> str:
        context = units[:n]
        context.insert(int(depth * n), needle)
        return TEMPLATE.format(kind=kind, context=" ".join(context), key=key)

    low, high = 1, len(units)  # the most filler units that fit the length with the answer
    while low < high:
        mid = (low + high + 1) // 2
        fits = len(tokenizer(prompt(mid)).input_ids) + ANSWER_TOKENS + 16 <= length
        low, high = (mid, high) if fits else (low, mid - 1)
    return {
        "input": prompt(low),
        "gen_prefix": ANSWER_PREFIX.format(kind=kind, key=key),
        "outputs": value,
        "max_length": length,
        "depth": depth,
    }


def dataset(kind: str, haystack: str, **metadata) -> dict[str, datasets.Dataset]:
    tokenizer = tokenizer_of(metadata.get("tokenizer") or metadata["pretrained"])
    seed = int(metadata.get("seed", 0))
    lengths = metadata.get("max_seq_lengths", LENGTHS)
    rows = [case(kind, haystack, n, i, seed, tokenizer) for n in lengths for i in range(CASES)]
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def exact_number_repeat(**metadata):
    return dataset("number", "repeat", **metadata)


def exact_number_prose(**metadata):
    return dataset("number", "prose", **metadata)


def exact_uuid_repeat(**metadata):
    return dataset("uuid", "repeat", **metadata)


def exact_uuid_prose(**metadata):
    return dataset("uuid", "prose", **metadata)


def exact_name_repeat(**metadata):
    return dataset("name", "repeat", **metadata)


def exact_name_prose(**metadata):
    return dataset("name", "prose", **metadata)


def judge(value: str, answer: str) -> str:
    """exact, partial or miss (see the module's docstring)."""
    answer = answer.strip().splitlines()[0] if answer.strip() else ""
    if value.lower() in answer.lower():
        return "exact"
    blocks = difflib.SequenceMatcher(None, value.lower(), answer.lower(), autojunk=False).get_matching_blocks()
    return "partial" if sum(b.size for b in blocks) * 2 >= len(value) else "miss"


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval's metrics of one case: exact and partial at its length, -1 at the others (RULER's way)."""
    metrics = {f"{name}_{n}": -1.0 for n in LENGTHS for name in ("exact", "partial")}
    verdict = judge(doc["outputs"], results[0])
    metrics[f"exact_{doc['max_length']}"] = float(verdict == "exact")
    metrics[f"partial_{doc['max_length']}"] = float(verdict == "partial")
    return metrics


def aggregate(values: list[float]) -> float:
    known = [v for v in values if v != -1]
    return sum(known) / len(known) if known else -1
