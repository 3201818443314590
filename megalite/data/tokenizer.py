"""Tokenizers: a byte-level one that needs no training, and a sentencepiece wrapper.

Both expose the same small interface the data pipeline and trainer use:
``vocab_size``, ``eod``, ``pad``, ``bos`` (None when absent), ``tokenize(text)``
and ``detokenize(ids)``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, followed by the special ids eod, pad and bos."""

    def __init__(self):
        self.eod = 256
        self.pad = 257
        self.bos = 258
        self.vocab_size = 259

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        """Decode the byte ids, dropping special ids; invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A trained sentencepiece model.

    The end-of-document id is the model's eos id and the padding id its pad id;
    a model trained without one of them gets it appended after the model's own
    pieces, so every id the pipeline writes stays below ``vocab_size``.
    """

    def __init__(self, model_path: str):
        import sentencepiece

        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"sentencepiece model {model_path!r} does not exist")
        self.model_path = model_path
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
        except RuntimeError as err:
            raise ValueError(f"{model_path}: not a valid sentencepiece model ({err})") from None
        size = self._sp.vocab_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            self.eod, size = size, size + 1
        self.pad = self._sp.pad_id()
        if self.pad < 0:
            self.pad, size = size, size + 1
        self.bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.vocab_size = size
        self._model_size = self._sp.vocab_size()
        self._specials = {self.eod, self.pad} | ({self.bos} if self.bos is not None else set())

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def detokenize(self, ids) -> str:
        """Decode the ids, dropping eod, pad and bos."""
        kept = [int(i) for i in ids if int(i) not in self._specials and int(i) < self._model_size]
        return self._sp.decode(kept)


def build_tokenizer(tokenizer_model: str | None, kind: str = "auto"):
    """Make a tokenizer: ``kind`` is "byte", "sentencepiece" or "auto".

    "auto" gives the byte tokenizer when ``tokenizer_model`` is None and a
    sentencepiece tokenizer loaded from it otherwise.
    """
    if kind not in ("auto", "byte", "sentencepiece"):
        raise ValueError(f"tokenizer kind must be 'auto', 'byte' or 'sentencepiece', got {kind!r}")
    if kind == "byte" or (kind == "auto" and tokenizer_model is None):
        return ByteTokenizer()
    if tokenizer_model is None:
        raise ValueError("a sentencepiece tokenizer needs a model path, got None")
    return SentencePieceTokenizer(tokenizer_model)


def train_sentencepiece(texts: Iterable[str], model_prefix: str, vocab_size: int,
                        model_type: str = "bpe", split_digits: bool = True) -> str:
    """Train a sentencepiece model on ``texts``; return the path of the ``.model`` file.

    Ids 0-3 are unk, bos, eos (used as end-of-document) and pad.  The vocabulary
    may come out smaller than ``vocab_size`` on a small corpus rather than fail.
    Digits are split so that numbers tokenize digit by digit.  Each line of a
    text is one training sentence, since sentencepiece skips very long ones.
    """
    import sentencepiece

    if vocab_size < 8:
        raise ValueError(f"vocab_size must be at least 8, got {vocab_size}")
    directory = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(directory, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=(line for t in texts for line in t.splitlines() if line.strip()), model_prefix=model_prefix,
        vocab_size=vocab_size, model_type=model_type, split_digits=split_digits,
        character_coverage=1.0, hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        minloglevel=2)
    return model_prefix + ".model"
