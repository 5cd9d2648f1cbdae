from __future__ import annotations

from app.detokenizer import IncrementalDetokenizer


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
