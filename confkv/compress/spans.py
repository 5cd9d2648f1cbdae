"""Spans: the runs of tokens that retention keeps or drops together (`retention_unit`).

A number is several tokens (this family of tokenizers writes every digit apart), and so are a UUID
and a rare name. Kept or dropped one entry at a time, a value loses its middle while its neighbours
survive, and the model copies what is left: a confident, wrong answer. With `word`, every entry of
a layer is ranked as the best-ranked entry of its word that the layer holds (a word: a token whose
text begins with whitespace and the tokens after it up to the next such, so a number's digits, a
UUID's pieces and a name's word pieces are one span), so a word is kept whole or dropped whole,
except the one at the budget's margin. `chunk` ranks fixed runs of `chunk_tokens` positions
together whatever the text (ChunkKV). `token` is each entry on its own.

Pooling over a span differs from pooling over neighbours (`dynamic`'s `kernel_size`): a window
joins a peak with whatever lies next to it, spending bytes on the neighbours of every peak; a word
joins only tokens that the text itself joins, and most words of prose are one or two tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

RetentionUnit = Literal["token", "word", "chunk"]
# An unbroken run of tokens longer than this (code, a URL, a hash) is cut into spans of this many, so
# that no single span outweighs a budget; a UUID is 37 tokens here.
LONGEST_SPAN = 48


def word_starts(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """[vocabulary] True where a token begins a word: its text begins with whitespace, is empty, or
    it is a special token (never joined to its neighbours)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    special = set(tokenizer.all_special_ids)
    return torch.tensor([not text or text[0].isspace() or i in special for i, text in enumerate(texts)])


def span_ids(
    unit: RetentionUnit, token_ids: Sequence[int], starts: torch.Tensor | None, chunk_tokens: int
) -> torch.Tensor:
    """[len(token_ids)] the span of each position, numbered in order (`token`: each its own)."""
    n = len(token_ids)
    if unit == "token":
        return torch.arange(n)
    if unit == "chunk":
        return torch.arange(n) // chunk_tokens
    if starts is None:
        raise ValueError("retention_unit 'word' needs the tokenizer's word starts: give the tokenizer")
    begins = starts[torch.tensor(token_ids, dtype=torch.long)] if n else torch.zeros(0, dtype=torch.bool)
    if n:
        begins[0] = True
    word = torch.cumsum(begins, 0) - 1
    offset = torch.arange(n) - torch.nonzero(begins).view(-1)[word]  # position within its word
    return torch.cumsum(begins | (offset % LONGEST_SPAN == 0), 0) - 1


def pool_over_spans(scores: torch.Tensor, spans: torch.Tensor, held: torch.Tensor | None = None) -> torch.Tensor:
    """Each entry's score raised to the best score among the entries of its span (`spans`: the span
    of each entry, aligned with `scores` [..., n]), row by row (`held`: the entries of padded rows,
    the only ones that count)."""
    if scores.numel() == 0:
        return scores
    if held is not None:
        scores = scores.masked_fill(~held, float("-inf"))
    count = int(spans.max()) + 1  # spans are numbered from 0: a row's span is its slot among `count`
    rows = torch.arange(scores.numel() // scores.shape[-1], device=scores.device).view(-1, 1) * count
    slots = (spans.reshape(-1, scores.shape[-1]) + rows).view(-1)
    best = torch.full((rows.numel() * count,), float("-inf"), dtype=scores.dtype, device=scores.device)
    return best.scatter_reduce(0, slots, scores.reshape(-1), "amax")[slots].view(scores.shape)
