"""Train a sentencepiece tokenizer on a text or jsonl corpus.

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix out/tok --vocab-size 8000

Writes ``out/tok.model`` and ``out/tok.vocab``.  A .jsonl input contributes the
field given by --json-key of every line; any other file contributes its lines.
"""

import sys

from megalite.cli import run_cli
from megalite.data.preprocess import read_texts
from megalite.data.tokenizer import train_sentencepiece
from megalite.flags import ArgumentParser


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="a .txt or .jsonl corpus")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}.model and {prefix}.vocab")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--model-type", default="bpe", choices=["bpe", "unigram", "char", "word"])
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--no-split-digits", action="store_true", help="let numbers merge into multi-digit pieces")
    args = parser.parse_args(argv)
    path = train_sentencepiece(read_texts(args.input, args.json_key), args.output_prefix, args.vocab_size,
                               model_type=args.model_type, split_digits=not args.no_split_digits)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
