"""Tokenize a jsonl corpus into a memory-mapped indexed dataset (PREFIX.bin + PREFIX.idx).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-model tok.model --workers 4 --append-eod

Every line is a JSON object whose --json-key field (default "text") is one
document.  Progress goes to stderr.
"""

import argparse
import sys

from megalite.data.preprocess import preprocess_jsonl


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="a .jsonl corpus")
    parser.add_argument("--output-prefix", required=True)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer-model", help="a sentencepiece .model file")
    which.add_argument("--tokenizer", choices=["byte"], help="the byte-level tokenizer, which needs no model")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod id")
    parser.add_argument("--json-key", default="text")
    args = parser.parse_args(argv)
    kind = "byte" if args.tokenizer == "byte" else "sentencepiece"
    try:
        prefix = preprocess_jsonl(args.input, args.output_prefix, tokenizer_model=args.tokenizer_model,
                                  tokenizer_kind=kind, workers=args.workers, append_eod=args.append_eod,
                                  key=args.json_key)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
