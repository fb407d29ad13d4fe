import pytest
from transformers import AutoTokenizer

from engine.model.detokenizer import IncrementalDetokenizer
from engine.model.loader import resolve_model_dir


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def feed(detok, ids):
    """Feed ids one at a time; return the deltas and the stop string (if any)."""
    deltas = []
    for tid in ids:
        delta, stop = detok.update([tid])
        deltas.append(delta)
        if stop is not None:
            return deltas, stop
    deltas.append(detok.flush())
    return deltas, None


def tokens_covering(tokenizer, ids, start, end):
    """How many tokens of ids carry some of the characters text[start:end]."""
    count, pos = 0, 0
    for i in range(len(ids)):
        new_pos = len(tokenizer.decode(ids[: i + 1]))
        count += new_pos > start and pos < end
        pos = new_pos
    return count


@pytest.mark.parametrize(
    ("text", "splits_chars"),
    [("日本語のテキスト", True), ("👍🏽🎉 done", True), ("Crème brûlée, naïve café", False)],
)
def test_multibyte_never_emits_replacement_char(tokenizer, text, splits_chars):
    ids = tokenizer.encode(text)
    # Guard: CJK and emoji really put one character's bytes into several tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) == splits_chars
    detok = IncrementalDetokenizer(tokenizer)
    deltas, stop = feed(detok, ids)
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
    assert detok.output_token_ids == ids


def test_long_output_matches_full_decode(tokenizer):
    text = "Résumé: 日本語 👍🏽 and more text. " * 40
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas, _ = feed(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    # The decode window stays small however long the output is.
    assert len(ids) - detok._prefix_offset <= 8


@pytest.mark.parametrize("chunk", [2, 3, 6, 7])
def test_several_ids_per_update(tokenizer, chunk):
    ids = tokenizer.encode("日本語 👍🏽 x café 🎉 テキスト" * 20)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.update(ids[i : i + chunk])[0] for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids)


def test_invalid_bytes_do_not_grow_the_window(tokenizer):
    # A run of lone UTF-8 continuation bytes never completes a character.
    ids = [tokenizer.convert_tokens_to_ids("ĳ")] * 40 + tokenizer.encode(" ok 日本")
    detok = IncrementalDetokenizer(tokenizer)
    deltas, _ = feed(detok, ids)
    assert any(d for d in deltas[:40])  # released while the junk still streams in
    assert detok.text == tokenizer.decode(ids)
    assert detok.text.endswith(" ok 日本")


def test_multi_token_stop_string_never_leaks(tokenizer):
    before = "The answer is 42."
    stop = "\n\nUser:"
    ids = tokenizer.encode(before + stop + " what else?")
    assert tokens_covering(tokenizer, ids, len(before), len(before + stop)) >= 2
    detok = IncrementalDetokenizer(tokenizer, stop=["never", stop])
    deltas, matched = feed(detok, ids)
    assert matched == stop
    assert detok.text == "".join(deltas) == before
    assert all(stop not in d for d in deltas)
    # No part of the stop string leaked before the match: nothing after `before`.
    emitted = ""
    for d in deltas:
        emitted += d
        assert before.startswith(emitted)
    with pytest.raises(RuntimeError):
        detok.update([ids[-1]])


def test_stop_string_split_inside_a_token(tokenizer):
    # "Hello" is one token; stop "lo wor" starts in its middle and ends in " world".
    ids = tokenizer.encode("Hello world, friend")
    assert tokens_covering(tokenizer, ids, 3, 9) == 2
    detok = IncrementalDetokenizer(tokenizer, stop=("lo wor",))
    deltas, matched = feed(detok, ids)
    assert matched == "lo wor"
    assert detok.text == "Hel"
    assert all("lo" not in d for d in deltas)


def test_stop_lookalike_prefix_is_flushed(tokenizer):
    ids = tokenizer.encode("Say Hel")
    detok = IncrementalDetokenizer(tokenizer, stop=["Hello!"])
    streamed = "".join(detok.update([i])[0] for i in ids)
    assert streamed == "Say "  # "Hel" is held back: it could still become "Hello!"
    assert detok.flush() == "Hel"
    assert detok.text == "Say Hel" == tokenizer.decode(ids)


def test_lookalike_released_once_it_diverges(tokenizer):
    ids = tokenizer.encode("Hello world")
    detok = IncrementalDetokenizer(tokenizer, stop=["Hello!"])
    deltas, matched = feed(detok, ids)
    assert matched is None
    assert deltas[0] == ""  # "Hello" alone is a prefix of the stop string
    assert deltas[1] == "Hello world"
    assert detok.text == "Hello world"


def test_special_tokens_skipped(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hi there") + [eos]
    detok = IncrementalDetokenizer(tokenizer)
    deltas, _ = feed(detok, ids)
    assert detok.text == "Hi there" == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("<|" not in d for d in deltas)

    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    feed(kept, ids)
    assert kept.text == "Hi there<|im_end|>"


def test_empty_stop_string_rejected(tokenizer):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tokenizer, stop=[""])
