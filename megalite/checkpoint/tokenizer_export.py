"""What a Hugging Face export takes from the tokenizer of the run that saved a checkpoint.

The trainer stores its flags in the checkpoint; from ``--tokenizer-type``/``--tokenizer-model``
(or ``--vocab-file``/``--merge-file``) the export copies the tokenizer files under the names
Hugging Face loads (a Hugging Face directory's chat templates too: ``chat_template.jinja``,
``additional_chat_templates/`` and ``tokenizer_config.json``'s entry, so the exported model chats
the same), and writes the bos/eos ids into config.json.  A tokenizer that no longer exists where
the run found it is left out.
"""

from __future__ import annotations

import os

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                       "vocab.json", "merges.txt", "tokenizer.model", "spiece.model")


def _chat_template_files(directory: str) -> list[str]:
    """The chat templates a Hugging Face tokenizer directory keeps in files of their own (relative names)."""
    extra = os.path.join(directory, "additional_chat_templates")
    names = sorted(n for n in os.listdir(extra) if n.endswith(".jinja")) if os.path.isdir(extra) else []
    return ["chat_template.jinja"] + [os.path.join("additional_chat_templates", n) for n in names]


def run_tokenizer(run_args: dict | None) -> tuple[list[tuple[str, str]], dict]:
    """``([(source path, file name in the export)], {"bos_token_id": .., "eos_token_id": ..})`` of a run."""
    from megalite.data.tokenizer import tokenizer_from_saved_args

    if not run_args:
        return [], {}
    kind, model = run_args.get("tokenizer_type"), run_args.get("tokenizer_model")
    if kind is None and model is None:
        return [], {}
    files = []
    if kind == "HuggingFaceTokenizer" and model and os.path.isdir(model):
        names = list(_HF_TOKENIZER_FILES) + _chat_template_files(model)
        files = [(os.path.join(model, n), n) for n in names if os.path.isfile(os.path.join(model, n))]
    elif kind == "GPT2BPETokenizer":
        files = [(run_args.get("vocab_file"), "vocab.json"), (run_args.get("merge_file"), "merges.txt")]
    elif kind in (None, "SentencePieceTokenizer") and model:
        files = [(model, "tokenizer.model")]
    files = [(src, name) for src, name in files if src and os.path.isfile(src)]
    try:
        tokenizer = tokenizer_from_saved_args(run_args)
    except (OSError, ValueError):
        return files, {}
    ids = {"eos_token_id": tokenizer.eod}
    if tokenizer.bos is not None:
        ids["bos_token_id"] = tokenizer.bos
    return files, ids
