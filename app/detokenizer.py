"""Incremental detokenization and stop-string handling for one sequence."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Turns generated token ids into text as they arrive and finds stop strings.

    Text that might be the start of a stop string is held back from streaming until it is
    known not to be one, so a client never sees part of a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._sent = 0

    def add(self, token_id: int) -> bool:
        """Add one token; return True when a stop string was found (the text is cut before it)."""
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return False
        search_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i != -1]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def delta(self, final: bool) -> str:
        """Text not yet sent; while not final, keep back what could begin a stop string."""
        end = len(self.text) if final else max(self._sent, len(self.text) - self._holdback)
        out = self.text[self._sent : end]
        self._sent = end
        return out
