import json
import sys

import pytest
import sentencepiece

from megalite.data.synthetic import generate_corpus
from megalite.data.tokenizer import ByteTokenizer, SentencePieceTokenizer, build_tokenizer, train_sentencepiece
from tests.data.megatron_fixture import FIXTURE_DIR


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


def test_build_tokenizer_types_and_errors(tmp_path, monkeypatch):
    assert isinstance(build_tokenizer(None), ByteTokenizer)
    assert isinstance(build_tokenizer("ignored", "ByteTokenizer"), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match="missing.model"):
        build_tokenizer(str(tmp_path / "missing.model"))
    (tmp_path / "bad.model").write_text("not a model")
    with pytest.raises(ValueError, match="bad.model: not a valid sentencepiece model"):
        build_tokenizer(str(tmp_path / "bad.model"))
    with pytest.raises(ValueError, match="unknown tokenizer type 'GPT3Tokenizer'; choose one of Sentence"):
        build_tokenizer(None, "GPT3Tokenizer")
    with pytest.raises(ValueError, match="SentencePieceTokenizer needs --tokenizer-model"):
        build_tokenizer(None, "SentencePieceTokenizer")
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --merge-file to name an existing file"):
        build_tokenizer(tokenizer_type="GPT2BPETokenizer", vocab_file=__file__, merge_file=str(tmp_path / "no.txt"))
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --vocab-file"):
        build_tokenizer(tokenizer_type="GPT2BPETokenizer")
    with pytest.raises(ValueError, match=f"{tmp_path} holds no Hugging Face tokenizer"):
        build_tokenizer(str(tmp_path), "HuggingFaceTokenizer")
    with pytest.raises(ValueError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer(tokenizer_type="NullTokenizer")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError, match=r"HuggingFaceTokenizer needs the transformers package: pip install "
                                         r"'megalite\[hf\]'"):
        build_tokenizer(FIXTURE_DIR + "/hf_tokenizer", "HuggingFaceTokenizer")


TEXTS = ["Hello world, héllo ✓ 12+7=19", "  two  spaces\n\nand a blank line", "<|endoftext|> inside", ""]


def test_ids_equal_the_reference_libraries(tmp_path):
    """Every type against its library, called directly: tokenizers for the HF files, transformers' GPT-2
    tokenizer with special tokens split (as Megatron's OpenAI encoder does), sentencepiece."""
    import tokenizers
    import transformers

    hf_dir = FIXTURE_DIR + "/hf_tokenizer"
    hf = build_tokenizer(hf_dir, "HuggingFaceTokenizer")
    reference = tokenizers.Tokenizer.from_file(hf_dir + "/tokenizer.json")
    texts = TEXTS + [json.loads(line)["text"] for line in open(FIXTURE_DIR + "/docs.jsonl")][:50]
    assert (hf.eod, hf.vocab_size) == (0, 512)
    for text in texts:
        assert hf.tokenize(text) == reference.encode(text).ids, text
    reference.model.save(str(tmp_path))
    gpt2 = build_tokenizer(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                           merge_file=str(tmp_path / "merges.txt"))
    bpe = transformers.GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert (gpt2.eod, gpt2.vocab_size) == (bpe.convert_tokens_to_ids("<|endoftext|>"), 512)
    for text in texts:
        assert gpt2.tokenize(text) == bpe.encode(text, split_special_tokens=True), text
    null = build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=100)
    assert null.tokenize("3 17  5\n99") == [3, 17, 5, 99] and (null.eod, null.vocab_size) == (100, 101)
    assert null.detokenize([3, 17]) == "3 17"
    model = train_sentencepiece(generate_corpus(200, seed=0), str(tmp_path / "sp"), vocab_size=100)
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    for text in texts:
        assert build_tokenizer(model, "SentencePieceTokenizer").tokenize(text) == sp.encode(text), text


def test_hf_tokenize_without_special_tokens(tmp_path):
    """A tokenizer that prepends bos (as Llama 3's does): ``add_special_tokens=False`` leaves it out, as
    transformers' own call does, so a rendered chat template (which already holds bos) gets one, not two."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(str(tmp_path))
    hf = build_tokenizer(str(tmp_path), "HuggingFaceTokenizer")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.tokenize("<s> hello world") == reference("<s> hello world").input_ids == [0, 0, 3, 4]
    assert hf.tokenize("<s> hello world", add_special_tokens=False) == [0, 3, 4]
    assert reference("<s> hello world", add_special_tokens=False).input_ids == [0, 3, 4]
    for tokenizer in (ByteTokenizer(), build_tokenizer(tokenizer_type="NullTokenizer", vocab_size=10)):
        assert tokenizer.tokenize("1 2", add_special_tokens=False) == tokenizer.tokenize("1 2")
