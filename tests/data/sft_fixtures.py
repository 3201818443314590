"""A character-level Hugging Face tokenizer directory with Llama 3's and Qwen's special tokens, and a
multi-turn conversation, for the SFT tests."""

import os

import pytest

from megalite.data.tokenizer import HuggingFaceTokenizer

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 \n.,?!:'"
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
EOT = {"llama3": "<|eot_id|>", "qwen2_5": "<|im_end|>"}
CONVERSATION = [
    {"role": "system", "content": "you are terse."},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "four."},
    {"role": "user", "content": "and times three?"},
    {"role": "tool", "content": "12"},
    {"role": "assistant", "content": "twelve, said the tool."},
]


def chat_tokenizer(tmp_path, family: str, template: str | None) -> HuggingFaceTokenizer:
    """A character-level HF tokenizer (vocabulary < 100) with both families' special tokens and ``template``."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    eos = EOT[family]
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos,
                                 bos_token="<|begin_of_text|>", additional_special_tokens=SPECIALS)
    path = str(tmp_path / family)
    hf.save_pretrained(path)
    if template is not None:
        with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as handle:
            handle.write(template)
    return HuggingFaceTokenizer(path)
