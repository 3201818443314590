"""Tokenize a corpus into Megatron indexed datasets, with Megatron's preprocess_data.py flags.

    python tools/preprocess_data.py --input docs.jsonl --json-keys text --output-prefix data/docs \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model hf_tokenizer/ --append-eod --workers 4

writes data/docs_text_document.{bin,idx}.  A tqdm bar on stderr tracks the input
bytes; the last line of stdout sums up documents, tokens, tokens/s and outputs.
"""

import argparse
import sys

from megalite.cli import run_cli
from megalite.data.preprocess import INPUT_FORMATS, preprocess
from megalite.data.tokenizer import TOKENIZER_TYPES
from megalite.flags import ArgumentParser


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--input", required=True, help="a jsonl corpus, or plain text with --input-format")
    parser.add_argument("--input-format", choices=INPUT_FORMATS, default="jsonl",
                        help="jsonl; lines: one document per line; blocks: documents separated by blank lines")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl fields, one dataset each")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                        help="None: SentencePieceTokenizer with --tokenizer-model, else ByteTokenizer")
    parser.add_argument("--tokenizer-model", default=None, help="sentencepiece file or HF tokenizer directory")
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    parser.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod id")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    spec = {"tokenizer_type": args.tokenizer_type, "tokenizer_model": args.tokenizer_model,
            "vocab_file": args.vocab_file, "merge_file": args.merge_file, "vocab_size": args.vocab_size}
    summary = preprocess(args.input, args.output_prefix, spec, json_keys=args.json_keys,
                         input_format=args.input_format, workers=args.workers, append_eod=args.append_eod)
    seconds = max(summary["seconds"], 1e-9)
    outputs = ", ".join(f"{p}.bin/.idx" for p in summary["prefixes"])
    print(f"{summary['documents']} documents, {summary['tokens']} tokens in {seconds:.1f} s "
          f"({summary['tokens'] / seconds:.0f} tokens/s); wrote {outputs}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
