"""Incremental detokenisation and stop strings: unicode split over tokens, sentencepiece spaces, stops spanning
tokens (cut, or kept with include_stop_str_in_output), nothing of a stop string streamed before it completes."""

import pytest

from megalite.data.synthetic import generate_corpus
from megalite.data.tokenizer import ByteTokenizer, build_tokenizer, train_sentencepiece
from megalite.inference.detokenizer import IncrementalDetokenizer


def _stream(tokenizer, prompt, ids, stop=(), include=False):
    """Feed ``ids`` one at a time; returns the streamed pieces, the final text and the stop string hit."""
    detok = IncrementalDetokenizer(tokenizer, prompt, list(stop), include)
    pieces, sent, hit = [], 0, None
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        hit = detok.add(token, check_stop=True)
        if hit is None and last:
            detok.flush()
        text = detok.stable(finished=hit is not None or last)
        pieces.append(text[sent:])
        sent = len(text)
        if hit is not None:
            break
    return pieces, detok.text, hit


def test_multibyte_characters_split_over_byte_tokens():
    tok = ByteTokenizer()
    text = "héllo ✓ wörld"
    pieces, final, hit = _stream(tok, tok.tokenize("say: "), tok.tokenize(text))
    assert final == text and "".join(pieces) == text and hit is None
    assert all("\ufffd" not in p for p in pieces)
    # The 3-byte check mark arrives as one piece, after its last byte.
    assert "✓" in pieces


def test_sentencepiece_spaces_survive_streaming(tmp_path):
    tok = build_tokenizer(train_sentencepiece(generate_corpus(200, seed=0), str(tmp_path / "sp"), vocab_size=100))
    prompt, completion = tok.tokenize("Ada has"), tok.tokenize(" 3 apples and 12 pears.")
    pieces, final, _ = _stream(tok, prompt, completion)
    full = tok.detokenize(prompt + completion)
    assert tok.detokenize(prompt) + final == full
    assert "".join(pieces) == final and final.startswith(" ")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_is_cut_and_never_streamed(include):
    tok = ByteTokenizer()
    ids = tok.tokenize("abc\n\ndef")
    pieces, final, hit = _stream(tok, [65], ids, stop=["xyz", "c\n\nd"], include=include)
    assert hit == "c\n\nd"
    assert final == ("abc\n\nd" if include else "ab")
    assert "".join(pieces) == final
    # Nothing past "ab" went out before the stop completed.
    assert "".join(pieces[:-1]) in ("", "a", "ab")


def test_earliest_stop_string_wins():
    tok = ByteTokenizer()
    _, final, hit = _stream(tok, [65], tok.tokenize("one, two. three"), stop=[".", ","])
    assert (final, hit) == ("one", ",")
