"""Incremental detokenization and stop-string handling for one sequence."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Turns generated token ids into text as they arrive and finds stop strings.

    Text that might be the start of a stop string is held back from streaming until it is
    known not to be one, so a client never sees part of a stop string.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._checked = 0  # the text's length at the last token: a stop string must end past it
        self.text = ""
        self._sent = 0

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Add one token; return True when a stop string was found (the text is cut before it, or
        after it where asked). Without `check_stop` (a request below its min_tokens) a stop string
        in the new text does not count."""
        piece = self._stream.step(self._tokenizer, token_id)
        self.text += piece or ""
        search_from = max(0, self._checked - self._holdback)  # a stop string may straddle the pieces
        self._checked = len(self.text)
        if not check_stop or not self._stop:
            return False
        hits = [(i, len(s)) for s in self._stop if (i := self.text.find(s, search_from)) != -1]
        if not hits:
            return False
        start, length = min(hits)
        self.text = self.text[: start + length * self._include_stop]
        return True

    def delta(self, final: bool) -> str:
        """Text not yet sent; while not final, keep back the end of the text that could begin a stop string."""
        end = len(self.text) if final else max(self._sent, len(self.text) - self._could_begin_stop())
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def _could_begin_stop(self) -> int:
        """Characters at the text's end that are the start of some stop string (the longest such end);
        only these need holding back, however long the stop strings are."""
        longest = 0
        for stop in self._stop:
            tail = self.text[len(self.text) - min(len(stop) - 1, len(self.text)) :]
            start = tail.find(stop[0])
            while start != -1 and len(tail) - start > longest:
                if stop.startswith(tail[start:]):
                    longest = len(tail) - start
                    break
                start = tail.find(stop[0], start + 1)
        return longest
