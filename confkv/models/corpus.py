"""Natural English text that ships with Python: the docstrings of standard library modules.

Benchmarks build prompts from it, so nothing is downloaded and every run sees the same text.
"""

from __future__ import annotations

import importlib
import inspect
import re
from functools import cache

# Modules with long, well-written prose docstrings, in a fixed order.
MODULES = (
    "argparse",
    "asyncio.events",
    "calendar",
    "collections",
    "csv",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "json",
    "logging",
    "mailbox",
    "pathlib",
    "pickle",
    "pydoc",
    "random",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "threading",
    "typing",
    "unittest.case",
    "urllib.parse",
    "zipfile",
)


@cache
def paragraphs() -> tuple[str, ...]:
    """Prose paragraphs (three lines or more, few symbols) from the modules above."""
    found: list[str] = []
    for name in MODULES:
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module) or ""]
        for _, obj in sorted(vars(module).items()):
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == name:
                docs.append(inspect.getdoc(obj) or "")
        for doc in docs:
            for para in re.split(r"\n\s*\n", doc):
                text = " ".join(line.strip() for line in para.splitlines())
                if len(text) > 200 and sum(c in "{}[]()=<>_*|" for c in text) < len(text) / 40:
                    found.append(text)
    return tuple(found)


def text_of_tokens(tokenizer, num_tokens: int, offset: int = 0) -> list[int]:
    """About `num_tokens` token ids of corpus text, starting at paragraph `offset`."""
    paras = paragraphs()
    ids: list[int] = []
    i = offset
    while len(ids) < num_tokens:
        ids.extend(tokenizer(paras[i % len(paras)] + "\n\n", add_special_tokens=False).input_ids)
        i += 1
    return ids[:num_tokens]
