"""One architecture comparison for the checkpoint loader and the trainer.

A checkpoint loads only into a model whose every architecture field (megalite.models.architecture) matches:
the loader names each differing field, and the trainer names the same fields by their flags.
"""

import pytest
import torch

from megalite.checkpoint import CheckpointReader, load_sharded, load_model, save_sharded
from megalite.models import GPTConfig, GPTModel
from megalite.models.architecture import (ARCHITECTURE_FIELDS, MOE_ARCHITECTURE_FIELDS, Difference,
                                          compare_architecture, config_from_dict, config_to_dict)
from megalite.moe import MoEConfig
from megalite.training.arguments import architecture_differences


def _rope(**changes):
    return GPTConfig(**{"vocab_size": 30, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                        "position_embedding_type": "rope", "make_vocab_size_divisible_by": 8, "seed": 7, **changes})


def _moe(**changes):
    return _rope(moe=MoEConfig(**{"num_experts": 4, "ffn_hidden_size": 16, "topk": 2, **changes}))


def test_a_checkpoint_with_another_rotary_percent_is_one_error_naming_the_field(tmp_path):
    """rotary_percent changes no weight shape, so the load used to succeed into a model computing another
    function; it is now one ValueError naming the field, and the model is unchanged."""
    path = str(tmp_path / "ckpt")
    save_sharded(path, 1, [GPTModel(_rope(rotary_percent=0.5))])
    target = GPTModel(_rope(rotary_percent=1.0, seed=3))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError) as error:
        load_sharded(path, [target])
    assert str(error.value) == (f"checkpoint {tmp_path / 'ckpt' / 'iter_0000001'} holds a different architecture: "
                                "rotary_percent is 0.5 in the checkpoint but 1.0 in the model")
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    assert load_model(path).config.rotary_percent == 0.5


def test_the_loader_names_every_differing_field_including_head_dim_and_moe_routing(tmp_path):
    path = str(tmp_path / "ckpt")
    save_sharded(path, 1, [GPTModel(_moe(pre_softmax=False))])
    with pytest.raises(ValueError, match="holds a different architecture: kv_channels is 8 in the checkpoint but 16 "
                                         "in the model; moe.pre_softmax is False in the checkpoint but "
                                         "True in the model$"):
        load_sharded(path, [GPTModel(_rope(kv_channels=16, moe=MoEConfig(num_experts=4, ffn_hidden_size=16,
                                                                           pre_softmax=True)))])
    with pytest.raises(ValueError, match="different architecture: moe.num_experts is 4 in the checkpoint but None"):
        load_sharded(path, [GPTModel(_rope())])


def test_the_trainer_names_the_same_differences_by_their_flags(tmp_path):
    path = str(tmp_path / "ckpt")
    save_sharded(path, 1, [GPTModel(_moe(add_bias=True))])
    saved = CheckpointReader(path).config_dict
    assert architecture_differences(saved, _moe(add_bias=True)) == []
    assert architecture_differences(saved, _moe(topk=1, add_bias=False)) == [
        "--moe-router-topk is 2 in the checkpoint but 1 in this run",
        "moe.add_bias is True in the checkpoint but False in this run"]
    assert architecture_differences(saved, _rope(rotary_percent=0.5, kv_channels=4)) == [
        "--kv-channels is 8 in the checkpoint but 4 in this run",
        "--rotary-percent is 1.0 in the checkpoint but 0.5 in this run",
        "--num-experts is 4 in the checkpoint but None in this run"]


def test_compare_architecture_covers_exactly_the_architecture_fields():
    """Each architecture field, changed alone, is the one difference; a training-only field is none."""
    base = _moe()
    changed = {"vocab_size": 31, "num_layers": 3, "hidden_size": 64, "num_attention_heads": 2, "ffn_hidden_size": 64,
               "num_query_groups": 2, "kv_channels": 4, "max_position_embeddings": 64,
               "position_embedding_type": "learned_absolute", "rotary_base": 500000.0, "rotary_percent": 0.5,
               "normalization": "RMSNorm", "norm_eps": 1e-6, "activation": "swiglu", "add_bias_linear": False,
               "untie_embeddings_and_output_weights": True, "moe_layer_freq": 2, "rotary_interleaved": True,
               "rope_scaling": "llama3", "rope_scaling_factor": 4.0, "rope_low_freq_factor": 2.0,
               "rope_high_freq_factor": 8.0, "rope_original_max_position_embeddings": 32, "yarn_beta_fast": 16.0,
               "yarn_beta_slow": 2.0, "yarn_attention_factor": 1.5, "yarn_truncate": False, "yarn_mscale": 0.7,
               "yarn_mscale_all_dim": 0.7, "add_qkv_bias": True, "qk_layernorm": True, "window_size": 3,
               "multi_latent_attention": True, "q_lora_rank": 16, "kv_lora_rank": 8, "qk_head_dim": 4,
               "qk_pos_emb_head_dim": 2, "v_head_dim": 4, "mtp_num_layers": 1}
    assert sorted(changed) == sorted(ARCHITECTURE_FIELDS)
    for name, value in changed.items():
        assert compare_architecture(base, GPTConfig(**{**vars(base), name: value})) == [
            Difference(name, getattr(base, name), value)]
    moe_changed = {"num_experts": 8, "ffn_hidden_size": 32, "topk": 1, "activation": "swiglu", "add_bias": True,
                   "pre_softmax": True, "shared_expert_intermediate_size": 8, "shared_expert_gate": True,
                   "score_function": "sigmoid", "enable_expert_bias": True, "routed_scaling_factor": 2.5,
                   "num_groups": 2, "group_topk": 1}
    assert sorted(moe_changed) == sorted(MOE_ARCHITECTURE_FIELDS)
    for name, value in moe_changed.items():
        other = GPTConfig(**{**vars(base), "moe": MoEConfig(**{**vars(base.moe), name: value})})
        assert compare_architecture(base, other) == [Difference(f"moe.{name}", getattr(base.moe, name), value)]
    free = GPTConfig(**{**vars(base), "hidden_dropout": 0.1, "init_method_std": 0.5, "seed": 1,
                        "mtp_loss_scaling_factor": 0.5,
                        "make_vocab_size_divisible_by": 64, "recompute_granularity": "full",
                        "moe": MoEConfig(**{**vars(base.moe), "aux_loss_coeff": 0.1, "dispatcher": "allgather"})})
    assert compare_architecture(base, free) == []
    assert compare_architecture(base, config_from_dict(config_to_dict(base))) == []


def test_a_saved_config_with_an_unknown_field_is_one_clear_error():
    values = {**config_to_dict(_rope()), "sliding_window": 128}
    with pytest.raises(ValueError, match="the saved GPTConfig has fields this megalite does not know: sliding_window"):
        config_from_dict(values)


def test_a_config_saved_with_the_old_router_order_loads_as_renormalised_top_k():
    """Both old router orders renormalised the top-k weights: pre_softmax=False, not an unknown field."""
    values = config_to_dict(_moe())
    del values["moe"]["pre_softmax"]
    for order in ("softmax_topk", "topk_softmax"):
        values["moe"]["router_order"] = order
        assert compare_architecture(config_from_dict(values), _moe()) == []
