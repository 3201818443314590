"""PEFT's format: exported adapters load with peft.PeftModel on the converted HF model and give megalite's
logits; adapters made by PEFT import into megalite and give PEFT's logits."""

import json
import os

import pytest
import torch

from megalite.checkpoint.hf import megalite_to_hf, write_hf_tensors
from megalite.lora import apply_lora, LoRAConfig
from megalite.lora.peft import export_peft, import_peft
from megalite.lora.state import global_adapters, load_global_adapters
from megalite.models.gpt import GPTModel
from tests.lora.test_adapters import _config, _random_b, _tokens

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

FAMILIES = {
    "llama": {},
    "gpt2": dict(position_embedding_type="learned_absolute", normalization="LayerNorm", activation="gelu",
                 add_bias_linear=True, num_query_groups=4),
}


def _hf_base(config, model, path):
    """The HF checkpoint of ``model`` (tp = 1, so its state dict holds the global tensors), loaded."""
    hf_config, tensors = megalite_to_hf(config, dict(model.state_dict()))
    os.makedirs(path)
    write_hf_tensors(path, tensors, 1 << 30)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exported_adapters_load_in_peft_with_equal_logits(tmp_path, family):
    config = _config(**FAMILIES[family])
    model = GPTModel(config).eval()
    hf = _hf_base(config, model, str(tmp_path / "base"))
    lora = apply_lora(model, LoRAConfig(rank=4, alpha=8))
    tensors = _random_b(lora)
    load_global_adapters(lora, tensors)
    export_peft(str(tmp_path / "adapter"), lora.config, config, global_adapters(lora))
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids = _tokens(8)[0][:, :-1]
    with torch.no_grad():
        ours, theirs = model(input_ids=ids), peft_model(input_ids=ids).logits
    assert (ours - theirs).abs().max() <= 1e-5, (ours - theirs).abs().max()
    with peft_model.disable_adapter(), torch.no_grad():
        assert (peft_model(input_ids=ids).logits - ours).abs().max() > 1e-3  # the adapters were applied
    # Importing the export gives back the same adapters.
    imported_config, imported = import_peft(str(tmp_path / "adapter"), config)
    assert (imported_config.rank, imported_config.alpha) == (4, 8)
    assert imported.keys() == tensors.keys()
    for name in tensors:
        assert torch.equal(imported[name], tensors[name]), name


def test_adapters_made_by_peft_import_with_equal_logits(tmp_path):
    config = _config()
    model = GPTModel(config).eval()
    hf = _hf_base(config, model, str(tmp_path / "base"))
    torch.manual_seed(3)
    peft_config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"],
                                  init_lora_weights=False)
    peft_model = peft.get_peft_model(hf, peft_config).eval()
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    lora_config, tensors = import_peft(str(tmp_path / "adapter"), config)
    # q and v have their own A: stacked to rank 4, alpha scaled so alpha / rank stays 3.
    assert lora_config.target_modules == ("linear_qkv", "linear_proj", "linear_fc1")
    assert (lora_config.rank, lora_config.alpha / lora_config.rank) == (4, 3.0)
    lora = apply_lora(model, lora_config)
    load_global_adapters(lora, tensors)
    ids = _tokens(9)[0][:, :-1]
    with torch.no_grad():
        ours, theirs = model(input_ids=ids), peft_model(input_ids=ids).logits
    assert (ours - theirs).abs().max() <= 1e-5, (ours - theirs).abs().max()
    with peft_model.disable_adapter(), torch.no_grad():
        assert (peft_model(input_ids=ids).logits - ours).abs().max() > 1e-3


def test_unsupported_peft_adapter_is_refused(tmp_path):
    os.makedirs(tmp_path / "dora")
    with open(tmp_path / "dora" / "adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "use_dora": True}, f)
    with pytest.raises(ValueError, match="use_dora=true"):
        import_peft(str(tmp_path / "dora"), _config())
