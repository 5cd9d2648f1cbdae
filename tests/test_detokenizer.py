from __future__ import annotations

from confkv.engine.detokenizer import IncrementalDetokenizer


def feed(tokenizer, text: str, stop=()):
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, tuple(stop))
    deltas, stopped = [], False
    for token in tokenizer(text, add_special_tokens=False).input_ids:
        stopped = detok.add(token)
        deltas.append(detok.delta(final=stopped))
        if stopped:
            break
    if not stopped:
        deltas.append(detok.delta(final=True))
    return detok.text, deltas, stopped


def test_streams_the_exact_text_including_multibyte(tokenizer):
    text = "Hello world, naïve café 日本語!"
    full, deltas, stopped = feed(tokenizer, text)
    assert full == text and "".join(deltas) == text and not stopped


def test_stop_string_cuts_and_is_never_streamed(tokenizer):
    full, deltas, stopped = feed(tokenizer, "one two three four five", stop=["thr", "nothing"])
    assert stopped and full == "one two "
    assert "".join(deltas) == "one two "
    assert not any("t" in d and "thr" in d for d in deltas)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    full, _, stopped = feed(tokenizer, "alpha beta gamma delta", stop=["delta", "beta"])
    assert stopped and full == "alpha "


def test_stop_strings_kept_where_asked_and_not_matched_below_min_tokens(tokenizer):
    ids = tokenizer("one, two, three, four", add_special_tokens=False).input_ids
    kept = IncrementalDetokenizer(tokenizer.backend_tokenizer, (", three",), include_stop=True)
    assert any(kept.add(i) for i in ids) and kept.text == "one, two, three"
    late = IncrementalDetokenizer(tokenizer.backend_tokenizer, ("two",))
    stops = [late.add(i, check_stop=n >= 4) for n, i in enumerate(ids, start=1)]
    assert not any(stops) and late.text == "one, two, three, four"  # "two" came before the 4th token


def test_special_tokens_are_left_out_unless_asked_for(tokenizer):
    ids = tokenizer("<|im_start|>hi", add_special_tokens=False).input_ids
    texts = []
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, skip_special_tokens=skip)
        for i in ids:
            detokenizer.add(i)
        texts.append(detokenizer.text)
    assert texts == ["hi", "<|im_start|>hi"]


def test_a_long_stop_string_holds_back_only_text_that_could_begin_it(tokenizer):
    """Only the end of the text that is the start of a stop string waits; the rest streams as it comes,
    however long the stop string (a 200-character one once held back the whole stream)."""
    stop = "END OF THE DOCUMENT" + "x" * 200
    text = "one two three four five six seven eight nine ten. END OF THE"
    _, deltas, stopped = feed(tokenizer, text, stop=[stop])
    assert not stopped and "".join(deltas) == text
    streamed_before_last = "".join(deltas[:-1])  # what went out before the final flush
    assert streamed_before_last.startswith("one two three four five six seven eight nine ten.")
    assert deltas[-1] == "END OF THE"  # held back while it could still begin the stop string
    # and a stop string reached across those pieces is still found, and never streamed
    full, deltas, stopped = feed(tokenizer, text + " DOCUMENT" + "x" * 200 + " more", stop=[stop])
    assert stopped and full == "one two three four five six seven eight nine ten. "
    assert "END" not in "".join(deltas)
