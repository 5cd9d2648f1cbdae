"""Quality task set, generated from text that ships with Python (`confkv.models.corpus`); nothing is downloaded.

- Needle in natural text: a fact ("The secret password for the <place> is <word>-<number>.") hidden at
  a chosen depth in 1-2k tokens of prose, asked for at the end through the chat template.
- Generation fidelity: summarise a passage; the compressed output is compared with the uncompressed one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from confkv.models.corpus import paragraphs

PLACES = (
    "archive",
    "boathouse",
    "observatory",
    "greenhouse",
    "lighthouse",
    "library",
    "workshop",
    "cellar",
    "museum",
    "bakery",
    "harbour",
    "studio",
    "garage",
    "chapel",
    "warehouse",
)
WORDS = (
    "pelican",
    "orchid",
    "granite",
    "saffron",
    "glacier",
    "lantern",
    "walnut",
    "comet",
    "marble",
    "falcon",
    "cobalt",
    "juniper",
    "harbor",
    "velvet",
    "thistle",
)


@dataclass
class NeedleCase:
    name: str
    messages: list[dict]
    answer: str  # e.g. "pelican-42"
    context_tokens: int
    depth: float

    def correct(self, text: str) -> bool:
        word, number = self.answer.split("-")
        lowered = text.lower()
        return word in lowered and number in lowered


@dataclass
class FidelityCase:
    name: str
    messages: list[dict]


def _haystack(tokenizer, num_tokens: int, rng: random.Random) -> list[str]:
    paras = list(paragraphs())
    rng.shuffle(paras)
    chosen, total = [], 0
    for p in paras:
        if total >= num_tokens:
            break
        chosen.append(p)
        total += len(tokenizer(p, add_special_tokens=False).input_ids) + 2
    return chosen


def needle_cases(tokenizer, count: int = 30, lengths: tuple[int, ...] = (1000, 1500, 2000)) -> list[NeedleCase]:
    cases = []
    for i in range(count):
        rng = random.Random(1000 + i)
        length = lengths[i % len(lengths)]
        depth = round(0.1 + 0.8 * ((i * 7) % 9) / 8, 2)
        place, word, number = PLACES[i % len(PLACES)], rng.choice(WORDS), rng.randrange(10, 100)
        hay = _haystack(tokenizer, length, rng)
        needle = f"The secret password for the {place} is {word}-{number}."
        hay.insert(round(depth * len(hay)), needle)
        question = f"What is the secret password for the {place}? Answer with the password only."
        content = "\n\n".join(hay) + "\n\n" + question
        cases.append(
            NeedleCase(
                f"needle-{length}-{i}", [{"role": "user", "content": content}], f"{word}-{number}", length, depth
            )
        )
    return cases


def fidelity_cases(tokenizer, count: int = 8, length: int = 800) -> list[FidelityCase]:
    cases = []
    for i in range(count):
        rng = random.Random(5000 + i)
        text = "\n\n".join(_haystack(tokenizer, length, rng))
        content = f"Summarize the following text in a few sentences.\n\n{text}"
        cases.append(FidelityCase(f"summary-{i}", [{"role": "user", "content": content}]))
    return cases
