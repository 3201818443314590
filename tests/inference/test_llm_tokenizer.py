"""``LLM(checkpoint)`` loads the tokenizer the checkpoint records (the trainer's flags, or Hugging Face tokenizer
files beside it), so text prompts, output text and the eos stop work without arguments; ``tokenizer=`` overrides."""

import os
import shutil

import pytest

from megalite.checkpoint import save_sharded
from megalite.data.synthetic import generate_corpus
from megalite.data.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer, train_sentencepiece
from megalite.inference import LLM, SamplingParams
from tests.data.megatron_fixture import FIXTURE_DIR
from tests.inference.common import tiny_model


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train_sentencepiece(generate_corpus(200, seed=0), str(tmp_path_factory.mktemp("sp") / "sp"), 100)


def test_checkpoint_tokenizer_from_the_trainer_flags_and_override(tmp_path, sp_model):
    model = tiny_model("gpt2", vocab_size=512)
    save_sharded(str(tmp_path / "ckpt"), 1, [model],
                 extra={"args": {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": sp_model}})
    llm = LLM(str(tmp_path / "ckpt"))
    assert isinstance(llm.tokenizer, SentencePieceTokenizer) and llm.engine.eos_token_ids == {llm.tokenizer.eod}
    out = llm.generate("Ada has", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.tokenize("Ada has")
    full = llm.tokenizer.detokenize(out.prompt_token_ids + out.outputs[0].token_ids)
    assert llm.tokenizer.detokenize(out.prompt_token_ids) + out.outputs[0].text == full
    eos = llm.generate("Ada", SamplingParams(max_tokens=4, logit_bias={llm.tokenizer.eod: 100.0}))[0].outputs[0]
    assert eos.token_ids == [llm.tokenizer.eod] and eos.finish_reason == "stop"

    hf_dir = os.path.join(FIXTURE_DIR, "hf_tokenizer")
    assert isinstance(LLM(str(tmp_path / "ckpt"), tokenizer=hf_dir).tokenizer, HuggingFaceTokenizer)
    with pytest.raises(ValueError, match="neither a Hugging Face tokenizer directory nor a sentencepiece model"):
        LLM(str(tmp_path / "ckpt"), tokenizer=str(tmp_path / "missing"))


def test_checkpoint_tokenizer_from_hugging_face_files_beside_it(tmp_path):
    save_sharded(str(tmp_path / "ckpt"), 1, [tiny_model("gpt2", vocab_size=512)])
    assert LLM(str(tmp_path / "ckpt")).tokenizer is None
    with pytest.raises(ValueError, match="string prompts need a tokenizer: this checkpoint records none"):
        LLM(str(tmp_path / "ckpt")).generate("text")
    for name in os.listdir(os.path.join(FIXTURE_DIR, "hf_tokenizer")):
        shutil.copy(os.path.join(FIXTURE_DIR, "hf_tokenizer", name), tmp_path / "ckpt")
    llm = LLM(str(tmp_path / "ckpt"))
    assert isinstance(llm.tokenizer, HuggingFaceTokenizer) and llm.tokenizer.eod in llm.engine.eos_token_ids
    assert llm.generate(["Hello world"], SamplingParams(max_tokens=3))[0].outputs[0].text is not None


@pytest.mark.parametrize("in_config", [False, True])
def test_hf_export_keeps_the_chat_template(tmp_path, in_config):
    """A run on a Hugging Face tokenizer with a chat template (its own file, extra named templates, or the
    tokenizer_config entry) exports to a directory whose template renders as the original, for transformers
    and for megalite's server."""
    transformers = pytest.importorskip("transformers")
    from megalite.checkpoint.hf import convert_megalite_to_hf
    from megalite.inference.chat_template import load_chat_template
    from tests.inference.chat_fixtures import tokenizer_dir

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ eos_token }}"
    extra = {} if in_config else {"tool_use": template + "tools"}  # transformers reads extra files or the entry
    source = tokenizer_dir(tmp_path, template, in_config=in_config, extra=extra)
    save_sharded(str(tmp_path / "ckpt"), 1, [tiny_model("gpt2", vocab_size=8)],
                 extra={"args": {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": source}})
    convert_megalite_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    messages = [{"role": "user", "content": "hello"}]
    original = transformers.AutoTokenizer.from_pretrained(source)
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    expected = original.apply_chat_template(messages, tokenize=False)
    assert expected == "<user>hello<|eot_id|>"
    assert exported.apply_chat_template(messages, tokenize=False) == expected
    assert load_chat_template(str(tmp_path / "hf")).render(messages, add_generation_prompt=False) == expected
    assert set(load_chat_template(str(tmp_path / "hf")).templates) == set(load_chat_template(source).templates)
