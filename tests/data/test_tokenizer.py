import pytest
import sentencepiece

from megalite.data.synthetic import generate_corpus
from megalite.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, build_tokenizer, train_sentencepiece


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓ 12+7=19"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.detokenize(ids) == text
    specials = {tok.eod, tok.pad, tok.bos}
    assert len(specials) == 3 and min(specials) >= 256 and max(specials) < tok.vocab_size == 259
    assert tok.detokenize([tok.bos] + ids + [tok.eod, tok.pad]) == text


def test_sentencepiece_round_trip_and_digits(tmp_path):
    model = train_sentencepiece(generate_corpus(300, seed=0), str(tmp_path / "tok"), vocab_size=120)
    tok = build_tokenizer(model)
    assert isinstance(tok, SentencePieceTokenizer)
    text = "Ada has 3 apples. 12+7=19"
    ids = tok.tokenize(text)
    assert tok.detokenize(ids) == text
    assert tok.detokenize(ids + [tok.eod, tok.pad]) == text
    assert (tok.eod, tok.pad, tok.bos) == (2, 3, 1)
    assert max(ids) < tok.vocab_size <= 120
    pieces = [tok._sp.id_to_piece(i) for i in tok.tokenize("12345")]
    assert [p.strip("▁") for p in pieces if p.strip("▁")] == list("12345")


def test_sentencepiece_without_pad_gets_an_appended_id(tmp_path):
    prefix = str(tmp_path / "nopad")
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(generate_corpus(100, seed=1)),
                                             model_prefix=prefix, vocab_size=60, hard_vocab_limit=False,
                                             minloglevel=2)
    tok = SentencePieceTokenizer(prefix + ".model")
    assert tok.pad == tok._sp.vocab_size() and tok.vocab_size == tok.pad + 1
    assert tok.eod == tok._sp.eos_id()


def test_build_tokenizer_kinds_and_errors(tmp_path):
    assert isinstance(build_tokenizer(None), ByteTokenizer)
    assert isinstance(build_tokenizer("ignored", kind="byte"), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match="missing.model"):
        build_tokenizer(str(tmp_path / "missing.model"))
    (tmp_path / "bad.model").write_text("not a model")
    with pytest.raises(ValueError, match="bad.model: not a valid sentencepiece model"):
        build_tokenizer(str(tmp_path / "bad.model"))
    with pytest.raises(ValueError, match="tokenizer kind"):
        build_tokenizer(None, kind="gpt2")
    with pytest.raises(ValueError, match="model path"):
        build_tokenizer(None, kind="sentencepiece")
