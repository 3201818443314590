"""SFT data: assistant-only loss masks as transformers gives them, packing, truncation, bad input, and packed
SFT at tp=2 x cp=2 equal to each conversation run alone on one rank."""

import json

import pytest
import torch
import torch.distributed as dist

from megalite import topology
from megalite.context_parallel import prepare_batch
from megalite.data.sft import ChatRenderer, SFTDataset, conversation_from_record, pack, read_jsonl
from megalite.data.tokenizer import HuggingFaceTokenizer
from megalite.models import GPTModel
from megalite.testing import run_distributed
from tests.data.sft_fixtures import CONVERSATION, EOT, chat_tokenizer
from tests.inference.chat_fixtures import trl_template
from tests.models.common import config


@pytest.mark.parametrize("family", ["llama3", "qwen2_5"])
def test_mask_is_each_assistant_turn(tmp_path, family):
    """Every assistant turn, and only those, carries loss; the packed label mask is transformers' mask shifted."""
    tokenizer = chat_tokenizer(tmp_path, family, trl_template(family + "_training"))
    renderer = ChatRenderer(tokenizer)
    ids, mask = renderer.render(CONVERSATION)
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append(tokenizer.detokenize(ids[start:i]))
            start = None
    turns = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    if family == "llama3":
        assert spans == [t + EOT[family] for t in turns]
    else:  # Qwen's marked block also holds the newline after the role and the one after <|im_end|>
        assert spans == ["\n" + t + EOT[family] + "\n" for t in turns]
    hf = tokenizer._tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    assert ids == list(hf["input_ids"]) and mask == list(hf["assistant_masks"])

    # Two copies packed into one sample: the label mask is the assistant mask one token on, per conversation.
    short = CONVERSATION[:3]
    ids2, mask2 = renderer.render(short)
    seq = len(ids) + len(ids2) + 3
    [(tokens, amask, docs)], dropped = pack([(ids, mask), (ids2, mask2)], seq, tokenizer.pad)
    assert dropped == 0 and tokens.tolist()[:len(ids) + len(ids2)] == ids + ids2
    batch = prepare_batch(tokens[None], assistant_mask=amask[None], documents=docs[None])
    want = mask[1:] + [0] + mask2[1:] + [0] * 4
    assert batch["loss_mask"][0].tolist() == want
    assert batch["position_ids"][0].tolist() == (list(range(len(ids))) + list(range(len(ids2)))
                                                 + list(range(3)))
    assert batch["loss_normalizer"].item() == sum(want)


def test_truncation_and_bad_input(tmp_path):
    tokenizer = chat_tokenizer(tmp_path, "llama3", trl_template("llama3_training"))
    renderer = ChatRenderer(tokenizer)
    ids, mask = renderer.render(CONVERSATION)
    first = mask.index(1)
    # Cut inside the first answer: kept, truncated; cut before it: dropped.
    kept, dropped = pack([(ids, mask)], first + 1, tokenizer.pad)
    assert dropped == 0 and kept[0][0].tolist() == ids[:first + 2]
    assert pack([(ids, mask), (ids, mask)], first - 2, tokenizer.pad) == ([], 2)
    with pytest.raises(ValueError, match="no conversation keeps an assistant token within --seq-length 3"):
        SFTDataset([renderer.render(CONVERSATION)], 3, tokenizer.pad)

    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "completion": "hello"}) + "\n\n"
                    + json.dumps({"messages": CONVERSATION[:2]}) + "\n")
    with pytest.raises(ValueError, match=r"data.jsonl:3: the conversation has no assistant turn"):
        read_jsonl(str(path))
    assert conversation_from_record({"prompt": "hi", "completion": "hello"}) == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(ValueError, match="role 'robot' is not one of system, user, assistant, tool"):
        conversation_from_record({"messages": [{"role": "robot", "content": "x"}]})
    with pytest.raises(ValueError, match="needs 'messages' or 'prompt' and 'completion' \\(has text\\)"):
        conversation_from_record({"text": "x"})
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        ChatRenderer(chat_tokenizer(tmp_path / "none", "llama3", None))
    with pytest.raises(ValueError, match="the chat template has no {% generation %} markers"):
        ChatRenderer(tokenizer, trl_template("llama3"))


SEQ = 128  # chunks of 32 tokens at cp2


def _conversations():
    system = {"role": "system", "content": "be brief."}
    return [CONVERSATION[:3], [system, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey."}],
            [system] + CONVERSATION[3:], [system, {"role": "user", "content": "ok?"},
                                          {"role": "assistant", "content": "ok."}]]


def _rank_fn(path):
    renderer = ChatRenderer(HuggingFaceTokenizer(path))
    rendered = [renderer.render(c) for c in _conversations()]
    samples, _ = pack(rendered, SEQ, renderer.tokenizer.pad)
    tokens, amask, docs = (torch.stack(x) for x in zip(*samples))
    cfg = config("llama", vocab_size=len(renderer.tokenizer._tok), max_position_embeddings=SEQ)
    # Unpacked, one rank: every conversation alone, the mean over all assistant labels.
    model = GPTModel(cfg)
    total, count = 0.0, 0
    for ids, mask in rendered:
        ids = torch.tensor(ids[:SEQ + 1])[None]
        loss = model(ids[:, :-1], ids[:, 1:])
        weight = torch.tensor(mask[1:SEQ + 1], dtype=torch.float32)
        total, count = total + (loss[0] * weight).sum(), count + weight.sum()
    reference = (total / count).item()
    # Packed, tp=2 x cp=2 with sequence parallelism.
    topo = topology.initialize(tp=2, cp=2)
    model = GPTModel(cfg, sequence_parallel=True)
    batch = prepare_batch(tokens, cp=2, cp_rank=topo.cp.rank, assistant_mask=amask, documents=docs)
    per_token = model(batch["tokens"], batch["labels"], position_ids=batch["position_ids"],
                      document_ids=batch["document_ids"])
    loss = (per_token * batch["loss_mask"]).sum() / batch["loss_normalizer"]
    dist.all_reduce(loss, group=topo.cp.group)
    return len(samples), reference, loss.item() / 2


@pytest.mark.slow
def test_packed_tp2_cp2_equals_unpacked_one_rank(tmp_path):
    path = chat_tokenizer(tmp_path, "qwen2_5", trl_template("qwen2_5_training")).path
    for count, reference, packed in run_distributed(_rank_fn, 4, path, timeout=240):
        assert count == 3  # packing put two of the four conversations into one sample
        assert abs(packed - reference) < 1e-5, (packed, reference)
