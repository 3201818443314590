"""Supervised fine-tuning data: chat jsonl rendered with the model's chat template, packed into fixed-length samples.

A jsonl line holds either ``messages`` (OpenAI chat format: system, user, assistant and tool roles) or a
``prompt``/``completion`` pair (each a string, or a list of messages as TRL's conversational form).  A
conversation is rendered and tokenized by transformers' ``apply_chat_template`` with
``return_assistant_tokens_mask=True``, so the loss covers exactly the tokens the template emits inside its
``{% generation %}`` blocks: every assistant turn of a multi-turn conversation, nothing the user, system or
tools said.  A template without generation markers cannot say which tokens are the assistant's, so it is an
error (TRL ships marked "training" variants of common templates; pass one with ``chat_template=``).

Truncation policy: a conversation longer than a sample (``seq_length + 1`` tokens) keeps its first
``seq_length + 1`` tokens; one with no assistant token left after that is dropped (and counted in
``SFTDataset.dropped``).  Packing: conversations go, in file order, into the current sample while they fit,
otherwise a new sample starts; the tail of a sample is padding in a document of its own with no loss.
Each sample carries ``document_ids`` so attention stays inside a conversation and positions restart at
each one (:func:`megalite.context_parallel.prepare_batch`); end-of-turn tokens inside a conversation do
not split it, as the eod-derived documents of pretraining would.
"""

from __future__ import annotations

import json

import torch

from megalite.data.tokenizer import HuggingFaceTokenizer

ROLES = ("system", "user", "assistant", "tool")


def conversation_from_record(record: dict, where: str = "record") -> list[dict]:
    """The messages of one jsonl record (``messages``, or ``prompt`` + ``completion``), checked."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        if not isinstance(prompt, list) or not isinstance(completion, list):
            raise ValueError(f"{where}: prompt and completion must be strings or lists of messages")
        messages = prompt + completion
    else:
        raise ValueError(f"{where}: needs 'messages' or 'prompt' and 'completion' (has {', '.join(record) or 'none'})")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ValueError(f"{where}: message role {role!r} is not one of {', '.join(ROLES)}")
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError(f"{where}: the conversation has no assistant turn, so nothing to train on")
    return messages


def jsonl_records(path: str):
    """``(where, record)`` for each non-blank line of a jsonl file; ``where`` is ``path:line`` for errors."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None


def read_jsonl(path: str) -> list[list[dict]]:
    """Every conversation of a jsonl file, each checked (errors name the file and line)."""
    conversations = [conversation_from_record(record, where) for where, record in jsonl_records(path)]
    if not conversations:
        raise ValueError(f"{path} holds no conversations")
    return conversations


class ChatRenderer:
    """Token ids and the assistant-token mask of a conversation under a tokenizer's chat template."""

    def __init__(self, tokenizer: HuggingFaceTokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        hf = tokenizer._tok
        template = chat_template if chat_template is not None else hf.chat_template
        if not template:
            raise ValueError(f"{tokenizer.path}: the tokenizer has no chat template; pass one (a .jinja file)")
        if isinstance(template, dict):
            template = template.get("default")
        if not template or "generation" not in template or "endgeneration" not in template:
            raise ValueError("the chat template has no {% generation %} markers, so the assistant tokens are "
                             "unknown; pass a training template that marks them (e.g. TRL's *_training.jinja)")
        self.template = template

    def render(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """``(ids, mask)``: the conversation's token ids and 1 where the token is the assistant's."""
        out = self.tokenizer._tok.apply_chat_template(messages, chat_template=self.template, tokenize=True,
                                                      return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        if not any(mask):
            raise ValueError("the chat template marks no assistant token in a conversation with an assistant turn")
        return ids, mask


def pack(rendered: list[tuple[list[int], list[int]]], seq_length: int, pad_id: int):
    """Samples of ``seq_length + 1`` tokens: ``(tokens, assistant_mask, document_ids, dropped)``.

    See the module docstring for the truncation and packing policy.
    """
    size = seq_length + 1
    samples, current, dropped = [], [], 0

    def close():
        tokens = [t for ids, _ in current for t in ids]
        mask = [m for _, ms in current for m in ms]
        docs = [d for d, (ids, _) in enumerate(current) for _ in ids]
        fill = size - len(tokens)
        samples.append((tokens + [pad_id] * fill, mask + [0] * fill, docs + [len(current)] * fill))

    for ids, mask in rendered:
        ids, mask = ids[:size], mask[:size]
        if not any(mask[1:]):  # the first token is never a label
            dropped += 1
            continue
        if current and sum(len(i) for i, _ in current) + len(ids) > size:
            close()
            current = []
        current.append((ids, mask))
    if current:
        close()
    tensors = [tuple(torch.tensor(x, dtype=torch.long) for x in sample) for sample in samples]
    return tensors, dropped


class SFTDataset:
    """Packed SFT samples ``{"tokens", "assistant_mask", "document_ids"}``, each ``[seq_length + 1]``.

    ``documents``: each conversation's ``(ids, mask)`` as :meth:`ChatRenderer.render` gives them (rendered now,
    or read back from preprocessed files by :mod:`megalite.data.sft_indexed`).  ``num_samples`` > the packed
    count repeats the samples in order (epochs), as the trainer asks for a fixed number of samples per split.
    """

    packed_documents = True  # the trainer derives positions, documents and the loss mask from the sample

    def __init__(self, documents: list[tuple[list[int], list[int]]], seq_length: int, pad_id: int,
                 num_samples: int | None = None):
        self.samples, self.dropped = pack(documents, seq_length, pad_id)
        if not self.samples:
            raise ValueError(f"no conversation keeps an assistant token within --seq-length {seq_length}")
        self.num_samples = num_samples or len(self.samples)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens, mask, docs = self.samples[index % len(self.samples)]
        return {"tokens": tokens, "assistant_mask": mask, "document_ids": docs}
