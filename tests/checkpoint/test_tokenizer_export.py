"""megalite's own sentencepiece tokenizer (the Quickstart's) exported as a working Hugging Face tokenizer.

Before, the export carried only ``tokenizer.model`` under a gpt2 model type, so ``AutoTokenizer`` built a
GPT2Tokenizer with other ids and generation decoded to garbage.  Now ``AutoTokenizer`` on the export
encodes and decodes exactly as megalite's tokenizer, config.json names its eos/bos ids, and transformers'
greedy generation equals megalite's engine.
"""

import json

import pytest
import torch

from megalite.checkpoint import save_global_checkpoint
from megalite.checkpoint.hf import convert_megalite_to_hf
from megalite.data.synthetic import build_default_data, generate_corpus
from megalite.data.tokenizer import SentencePieceTokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")


@pytest.mark.slow
def test_quickstart_tokenizer_exports_as_a_working_hf_tokenizer(tmp_path):
    from megalite.inference import LLM, EngineConfig, SamplingParams
    from megalite.models import GPTConfig, GPTModel

    _, spm = build_default_data(str(tmp_path / "data"), seed=3, num_docs=1500, vocab_size=200)
    ours = SentencePieceTokenizer(spm)
    config = GPTConfig(vocab_size=ours.vocab_size, num_layers=2, hidden_size=32, num_attention_heads=4,
                       max_position_embeddings=64, activation="gelu_tanh", seed=7)
    model = GPTModel(config).eval()
    weights = torch.Generator().manual_seed(7)  # not the global stream: what ran before in the worker moves it
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3, generator=weights)
    tensors = dict(model.state_dict())
    tensors["embedding.word_embeddings.weight"] = tensors["embedding.word_embeddings.weight"][:config.vocab_size]
    save_global_checkpoint(str(tmp_path / "ckpt"), config, tensors,
                           extra={"args": {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": spm}})
    convert_megalite_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))

    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    texts = generate_corpus(20, seed=9) + ["two spaces, tabs\tand\nnew lines", "12+345=357", "", "naïve ü"]
    for text in texts:
        ids = ours.tokenize(text)
        assert theirs(text).input_ids == ids, text
        if 0 not in ids:  # an unknown character decodes as sentencepiece's " ⁇ " in megalite, dropped in HF
            assert (theirs.decode(ids + [ours.eod], skip_special_tokens=True)
                    == ours.detokenize(ids + [ours.eod])), text
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (exported["eos_token_id"], exported["bos_token_id"]) == (ours.eod, ours.bos)
    assert (theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id) == (ours.eod, ours.bos, ours.pad)
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == ours.eod

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    prompt = ours.tokenize("7+8=")
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=10, min_new_tokens=10, eos_token_id=None,
                      pad_token_id=ours.pad)
    expected = out[0, len(prompt):].tolist()
    llm = LLM(str(tmp_path / "ckpt"), engine_config=EngineConfig(block_size=4, num_blocks=32))
    got = llm.generate([prompt], [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)])[0].outputs[0].token_ids
    assert got == expected
    # sentencepiece's decode drops control tokens (the end-of-document a random model may emit); HF's does with
    # skip_special_tokens, as the texts above are compared
    assert theirs.decode(expected, skip_special_tokens=True) == ours.detokenize(expected)

    small = GPTConfig(**{**vars(config), "vocab_size": ours.vocab_size - 1})
    tensors["embedding.word_embeddings.weight"] = tensors["embedding.word_embeddings.weight"][:small.vocab_size]
    save_global_checkpoint(str(tmp_path / "small"), small, tensors,
                           extra={"args": {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": spm}})
    with pytest.raises(ValueError, match=f"has {ours.vocab_size} ids, more than the model's vocab_size "
                                         f"{small.vocab_size}"):
        convert_megalite_to_hf(str(tmp_path / "small"), str(tmp_path / "hf_small"))
