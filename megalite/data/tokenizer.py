"""Tokenizers, chosen by Megatron's ``--tokenizer-type`` names, each a thin wrapper over its library.

Every tokenizer exposes the small interface the data pipeline and trainer use:
``vocab_size``, ``eod``, ``pad``, ``bos`` (None when absent), ``tokenize(text,
add_special_tokens=True)`` (False: none of the bos/eos a Hugging Face tokenizer adds)
and ``detokenize(ids)``.  The ids are exactly those of the reference library
(sentencepiece, transformers); only ``ByteTokenizer`` (UTF-8 bytes, megalite's
default when no tokenizer is named) and ``NullTokenizer`` (ids written as
numbers) need none.  transformers is the optional ``[hf]`` extra.
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

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
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

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def detokenize(self, ids) -> str:
        """Decode the ids, dropping eod, pad and bos."""
        kept = [int(i) for i in ids if int(i) not in self._specials and int(i) < self._model_size]
        return self._sp.decode(kept)


class NullTokenizer:
    """Megatron's NullTokenizer: the text is space-separated ids; ``eod`` is ``vocab_size`` (one extra id)."""

    def __init__(self, vocab_size: int):
        if vocab_size is None or vocab_size < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self.eod = self.pad = int(vocab_size)
        self.bos = None
        self.vocab_size = int(vocab_size) + 1

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def _transformers(kind: str):
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{kind} needs the transformers package: pip install 'megalite[hf]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


class HuggingFaceTokenizer:
    """A local Hugging Face tokenizer directory, loaded with ``AutoTokenizer`` (as Megatron does).

    ``eod`` is the tokenizer's ``eos_token_id``; ``vocab_size`` is ``len(tokenizer)``
    (added tokens included); ``tokenize`` is ``tokenizer(text).input_ids``.
    """

    _FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "tokenizer_config.json")

    def __init__(self, path: str):
        transformers = _transformers("HuggingFaceTokenizer")
        if path is None or not os.path.isdir(path):
            raise ValueError(f"HuggingFaceTokenizer needs --tokenizer-model to be a local directory, got {path!r}")
        if not any(os.path.isfile(os.path.join(path, name)) for name in self._FILES):
            raise ValueError(f"{path} holds no Hugging Face tokenizer (none of {', '.join(self._FILES)})")
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: cannot load a Hugging Face tokenizer ({str(err).splitlines()[0]})") from None
        if self._tok.eos_token_id is None:
            raise ValueError(f"{path}: the tokenizer has no eos token, which marks the end of a document")
        self.path = path
        self.eod = self._tok.eos_token_id
        self.bos = self._tok.bos_token_id
        self.pad = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eod
        self.vocab_size = len(self._tok)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; ``add_special_tokens=False`` leaves out the bos/eos the tokenizer would add (a
        rendered chat template already holds them: Llama 3 would otherwise start with two bos)."""
        return self._tok(text, add_special_tokens=add_special_tokens).input_ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file`` (merges.txt).

    Like Megatron's (OpenAI's) encoder it gives special-token text no special
    treatment; ``eod`` is the id of ``<|endoftext|>``.  Runs on the tokenizers library.
    """

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if path is None or not os.path.isfile(path):
                raise ValueError(f"GPT2BPETokenizer needs {flag} to name an existing file, got {path!r}")
        try:
            import tokenizers
        except ImportError:
            raise ValueError("GPT2BPETokenizer needs the tokenizers package: pip install 'megalite[hf]'") from None
        self._tok = tokenizers.ByteLevelBPETokenizer(vocab_file, merge_file)
        eod = self._tok.token_to_id("<|endoftext|>")
        if eod is None:
            raise ValueError(f"{vocab_file} has no <|endoftext|> token")
        self.eod = self.pad = eod
        self.bos = None
        self.vocab_size = self._tok.get_vocab_size()

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer",
                   "ByteTokenizer")


def build_tokenizer(tokenizer_model: str | None = None, tokenizer_type: str | None = None, *,
                    vocab_file: str | None = None, merge_file: str | None = None, vocab_size: int | None = None):
    """The tokenizer Megatron's flags describe.

    ``tokenizer_type`` None means SentencePieceTokenizer when ``tokenizer_model``
    is given and ByteTokenizer otherwise.  Bad names or missing files raise
    ValueError (FileNotFoundError for a missing sentencepiece model).
    """
    if tokenizer_type is None:
        tokenizer_type = "SentencePieceTokenizer" if tokenizer_model is not None else "ByteTokenizer"
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_model is None:
        raise ValueError("SentencePieceTokenizer needs --tokenizer-model, got None")
    return SentencePieceTokenizer(tokenizer_model)


def tokenizer_from_args(args):
    """``build_tokenizer`` from the Megatron flags on ``args``."""
    return build_tokenizer(args.tokenizer_model, args.tokenizer_type, vocab_file=args.vocab_file,
                           merge_file=args.merge_file, vocab_size=args.vocab_size)


def tokenizer_from_saved_args(run_args: dict):
    """``build_tokenizer`` from the flags a trainer saved in its checkpoint (a dict; absent ones are None)."""
    return build_tokenizer(run_args.get("tokenizer_model"), run_args.get("tokenizer_type"),
                           vocab_file=run_args.get("vocab_file"), merge_file=run_args.get("merge_file"),
                           vocab_size=run_args.get("vocab_size"))


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
