"""Tokenize a corpus into Megatron indexed datasets, with Megatron's preprocess_data.py flags.

    python tools/preprocess_data.py --input docs.jsonl --json-keys text --output-prefix data/docs \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model hf_tokenizer/ --append-eod --workers 4

writes data/docs_text_document.{bin,idx}.  A tqdm bar on stderr tracks the input
bytes; the last line of stdout sums up documents, tokens, tokens/s and outputs.

    python tools/preprocess_data.py --chat --input chats.jsonl --output-prefix data/chats \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model hf_tokenizer/ [--chat-template T.jinja]

renders SFT conversations with the chat template (as examples/sft.py does) into data/chats_text_document and
data/chats_loss_mask_document (the assistant-token mask), one document per conversation; examples/sft.py
takes ``--sft-data data/chats`` (see megalite/data/sft_indexed.py).
"""

import argparse
import sys
import time

from megalite.cli import run_cli
from megalite.data.preprocess import INPUT_FORMATS, preprocess
from megalite.data.tokenizer import TOKENIZER_TYPES
from megalite.flags import ArgumentParser


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--input", required=True, help="a jsonl corpus, or plain text with --input-format")
    parser.add_argument("--input-format", choices=INPUT_FORMATS, default="jsonl",
                        help="jsonl; lines: one document per line; blocks: documents separated by blank lines")
    parser.add_argument("--json-keys", nargs="+", default=None, help="jsonl fields, one dataset each; none given: text")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                        help="None: SentencePieceTokenizer with --tokenizer-model, else ByteTokenizer")
    parser.add_argument("--tokenizer-model", default=None, help="sentencepiece file or HF tokenizer directory")
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    parser.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod id")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--chat", action="store_true",
                        help="SFT chat jsonl: render with the chat template into {prefix}_text_document and "
                             "{prefix}_loss_mask_document (HuggingFaceTokenizer, one process)")
    parser.add_argument("--chat-template", default=None,
                        help="with --chat: a .jinja template with {%% generation %%} markers, instead of "
                             "the tokenizer's")
    args = parser.parse_args(argv)
    if args.chat:
        return _chat(args)
    if args.chat_template is not None:
        raise ValueError("--chat-template needs --chat")
    args.json_keys = args.json_keys or ["text"]
    spec = {"tokenizer_type": args.tokenizer_type, "tokenizer_model": args.tokenizer_model,
            "vocab_file": args.vocab_file, "merge_file": args.merge_file, "vocab_size": args.vocab_size}
    summary = preprocess(args.input, args.output_prefix, spec, json_keys=args.json_keys,
                         input_format=args.input_format, workers=args.workers, append_eod=args.append_eod)
    seconds = max(summary["seconds"], 1e-9)
    outputs = ", ".join(f"{p}.bin/.idx" for p in summary["prefixes"])
    print(f"{summary['documents']} documents, {summary['tokens']} tokens in {seconds:.1f} s "
          f"({summary['tokens'] / seconds:.0f} tokens/s); wrote {outputs}")
    return 0


def _chat(args) -> int:
    """``--chat``: render every conversation and write tokens and loss mask, then the summary line."""
    from megalite.data.sft_indexed import render_documents, write_documents  # torch: only --chat needs it
    from megalite.training.sft import renderer_from_args

    unused = [flag for flag, value in (("--json-keys", args.json_keys), ("--append-eod", args.append_eod),
                                       ("--workers", args.workers != 1),
                                       ("--input-format", args.input_format != "jsonl")) if value]
    if unused:
        raise ValueError(f"--chat renders whole conversations in one process; drop {', '.join(unused)}")
    start = time.perf_counter()
    renderer = renderer_from_args(args)
    summary = write_documents(args.output_prefix, render_documents(args.input, renderer),
                              renderer.tokenizer.vocab_size)
    seconds = max(time.perf_counter() - start, 1e-9)
    outputs = ", ".join(f"{p}.bin/.idx" for p in summary["prefixes"])
    print(f"{summary['documents']} conversations, {summary['tokens']} tokens ({summary['assistant_tokens']} "
          f"assistant) in {seconds:.1f} s; wrote {outputs}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
