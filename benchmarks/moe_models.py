"""A DeepSeek-V3-style model: one training step in megalite vs torchtitan's ``deepseek_v3``, and the EP all-to-all
bytes under group-limited routing.

    PYTHONPATH=/tmp/tt_site python benchmarks/moe_models.py [--hidden 512] [--layers 4] [--experts 16] [--topk 4]
        [--groups 4] [--group-topk 2] [--seq-length 256] [--batch 4] [--repeats 5] [--threads 1] [--skip-ep]

1. ep=1, fp32, CPU: torchtitan's ``DeepSeekV3Model`` (MLA with q/kv low rank and YaRN, a dense first layer,
   sigmoid routing over expert groups with the expert bias, a shared expert, its grouped-mm experts) is built
   with its own initialisation and expert biases drawn at random, written out by its own
   ``DeepSeekV3StateDictAdapter.to_hf`` (Hugging Face names, DeepSeek's interleaved RoPE rows) and read into
   megalite by megalite's Hugging Face converter; megalite's experts use its grouped GEMM.  Two changes to
   torchtitan, both needed to run it here: attention is its ``ScaledDotProductAttention`` (causal) because its
   language-model backends cannot train on a CPU (FlexAttention has no CPU backward, varlen is CUDA only);
   and, for the "fp32 experts" column, its ``GroupedExperts`` runs the same three ``torch._grouped_mm`` calls
   without casting to bfloat16 (as shipped it always computes experts in bfloat16).  The losses of megalite and
   fp32-expert torchtitan must agree to 1e-5 relative before anything is timed.  Each side steps in
   alternating rounds and keeps its fastest step, timed in CPU seconds of this process (one thread by
   default, so that is the step's work, not the waits a loaded machine adds); printed: tokens per CPU second
   and the ratio megalite / torchtitan.
2. ep=4 (4 gloo ranks, one MoE layer, groups aligned to the EP ranks): the hidden-state bytes each rank's
   dispatch sends to other EP ranks (the dispatcher's ``last_bytes_sent``, the payload it hands the
   all-to-all), beside the exact volume of a dispatch that sends each token once per other EP rank holding
   one of its experts (what megalite's all-to-all does): (distinct (token, other rank) pairs, from the routing)
   x hidden x 4; and the analytic bounds for that rank's T tokens: T x topk x hidden x 4 (one row per chosen
   expert) and T x min(topk, group_topk) x hidden x 4 (one row per chosen rank, the own rank included), and
   the most EP ranks any token touched (at most group_topk).  The same layer without group limiting is
   printed beside it.

torchtitan is optional: install it outside the shared environment
(``pip install --no-deps --target /tmp/tt_site torchtitan==0.3.0 tyro docstring_parser spmd_types==0.2.3``)
and put that folder on PYTHONPATH; without it part 1 is skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
import warnings

import torch
import torch.nn.functional as F

ROPE_FACTOR, ORIGINAL_CONTEXT = 4.0, 256


def _titan_model(args):
    """torchtitan's DeepSeekV3Model at the benchmark size (its own init; random expert biases), and its config."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import (_EMBEDDING_INIT, _NORM_INIT, DeepSeekV3Model, _build_dsv3_layers,
                                               _output_linear_init)

    h = args.hidden
    layers = _build_dsv3_layers(
        n_layers=args.layers, n_dense_layers=1, dim=h, n_heads=h // 64, q_lora_rank=h // 2, kv_lora_rank=h // 4,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, mscale=1.0, dense_hidden_dim=2 * h,
        moe_hidden_dim=h // 2, num_experts=args.experts, num_shared_experts=1, router_top_k=args.topk,
        router_score_func="sigmoid", router_num_expert_groups=args.groups, router_num_limited_groups=args.group_topk,
        router_route_scale=2.5, router_route_norm=True, attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=32, max_seq_len=4 * ORIGINAL_CONTEXT, theta=10000.0, scaling="yarn",
                                rope_factor=ROPE_FACTOR, beta_fast=32.0, beta_slow=1.0,
                                original_seq_len=ORIGINAL_CONTEXT))
    for layer in layers:  # FlexAttention has no backward on a CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = DeepSeekV3Model.Config(
        vocab_size=args.vocab, dim=h, layers=layers, norm=RMSNorm.Config(normalized_shape=h, param_init=_NORM_INIT),
        tok_embeddings=Embedding.Config(num_embeddings=args.vocab, embedding_dim=h, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=h, out_features=args.vocab, param_init=_output_linear_init(h)))
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias_E"):
                buffer.copy_(0.01 * torch.rand(args.experts))
    return model.train(), config


def _hf_config(args) -> dict:
    """The Hugging Face DeepSeek-V3 config.json (a dict) of ``_titan_model``'s architecture."""
    h = args.hidden
    return {"model_type": "deepseek_v3", "vocab_size": args.vocab, "hidden_size": h, "intermediate_size": 2 * h,
            "moe_intermediate_size": h // 2, "num_hidden_layers": args.layers, "num_attention_heads": h // 64,
            "num_key_value_heads": h // 64, "n_shared_experts": 1, "n_routed_experts": args.experts,
            "routed_scaling_factor": 2.5, "q_lora_rank": h // 2, "kv_lora_rank": h // 4, "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 32, "v_head_dim": 64, "n_group": args.groups, "topk_group": args.group_topk,
            "num_experts_per_tok": args.topk, "first_k_dense_replace": 1, "norm_topk_prob": True,
            "max_position_embeddings": 4 * ORIGINAL_CONTEXT, "rope_interleave": True, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": ROPE_FACTOR,
                                "original_max_position_embeddings": ORIGINAL_CONTEXT, "mscale": 1.0,
                                "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}}


def _megalite_model(titan, titan_config, args):
    """megalite's GPTModel with ``titan``'s weights: torchtitan's to_hf, then megalite's HF converter."""
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    from megalite.checkpoint.hf import hf_to_megalite
    from megalite.models import GPTModel

    hf = DeepSeekV3StateDictAdapter(titan_config, None).to_hf(
        {name: tensor.detach().clone() for name, tensor in titan.state_dict().items()})
    config, tensors, _ = hf_to_megalite(_hf_config(args), hf)
    # The global tensors hold the vocabulary unpadded; this model keeps it so (no padded rows to fill).
    model = GPTModel(dataclasses.replace(config, make_vocab_size_divisible_by=1,
                                         moe=dataclasses.replace(config.moe, grouped_gemm=True)))
    result = model.load_state_dict(tensors, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise SystemExit(f"error: the converted weights do not fit megalite's model: {result}")
    return model.train()


def _fp32_experts(self, x, counts):
    """torchtitan's GroupedExperts.forward (the same three grouped GEMMs) without its cast to bfloat16."""
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate = torch._grouped_mm(x, self.w1_EFD.transpose(-2, -1), offs=offsets)
    up = torch._grouped_mm(x, self.w3_EFD.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(F.silu(gate) * up, self.w2_EDF.transpose(-2, -1), offs=offsets)


def _set_titan_experts(model, fp32: bool) -> None:
    """Run torchtitan's experts as shipped (bfloat16) or in fp32 (``_fp32_experts``)."""
    import types

    from torchtitan.models.common.moe import GroupedExperts

    for module in model.modules():
        if isinstance(module, GroupedExperts):
            if fp32:
                module.forward = types.MethodType(_fp32_experts, module)
            else:
                module.__dict__.pop("forward", None)


def _cpu_seconds(step) -> float:
    """CPU seconds of one call of ``step`` (this process): unlike wall time, not stretched by other jobs on a
    shared machine while this single-threaded step waits for a core."""
    start = time.process_time()
    step()
    return time.process_time() - start


def compare_step(args) -> None:
    # torchtitan's router asks for an fp32 autocast region, which a CPU declines with a warning every call.
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    titan, titan_config = _titan_model(args)
    ours = _megalite_model(titan, titan_config, args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_length + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def titan_step(fp32):
        def step():
            _set_titan_experts(titan, fp32)
            titan.zero_grad(set_to_none=True)
            logits = titan(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            return loss.item()
        return step

    def our_step():
        ours.zero_grad(set_to_none=True)
        loss = ours(inputs, labels=labels).mean()
        loss.backward()
        return loss.item()

    steps = {"torchtitan (bf16 experts, as shipped)": titan_step(False), "torchtitan (fp32 experts)": titan_step(True),
             "megalite (fp32)": our_step}
    losses = {name: step() for name, step in steps.items()}
    want, got = losses["torchtitan (fp32 experts)"], losses["megalite (fp32)"]
    print("first losses: " + ", ".join(f"{name} {loss:.7f}" for name, loss in losses.items()))
    if abs(got - want) > 1e-5 * abs(want):
        raise SystemExit(f"error: losses differ (torchtitan fp32 experts {want}, megalite {got})")
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(_cpu_seconds(step))
    tokens = args.batch * args.seq_length
    best = {name: min(values) for name, values in times.items()}
    print(f"{'model':38} {'tokens/CPU s':>12} {'megalite CPU time / this':>25}")
    for name, seconds in best.items():
        print(f"{name:38} {tokens / seconds:12.0f} {best['megalite (fp32)'] / seconds:25.2f}")


def _ep_bytes(hidden, experts, topk, groups, group_topk, tokens):
    """One MoE layer at ep=4: (bytes this rank's dispatch sent to other ranks, most EP ranks a token touched)."""
    import torch.distributed as dist

    from megalite import topology
    from megalite.moe import MoEConfig, MoELayer

    torch.set_num_threads(1)
    topo = topology.initialize(ep=4)
    results = {}
    for name, limited in (("group-limited", True), ("not limited", False)):
        torch.manual_seed(0)
        config = MoEConfig(num_experts=experts, ffn_hidden_size=hidden // 2, topk=topk, score_function="sigmoid",
                           enable_expert_bias=True, routed_scaling_factor=2.5, num_groups=groups if limited else None,
                           group_topk=group_topk if limited else None, init_method_std=0.5, grouped_gemm=True)
        layer = MoELayer(hidden, config)
        x = torch.randn(tokens, 1, hidden, generator=torch.Generator().manual_seed(dist.get_rank()))
        layer(x).sum().backward()
        ranks = layer.router(x.view(tokens, hidden)).indices // (experts // topo.ep.size)
        touched = max(len(set(row.tolist())) for row in ranks)
        pairs = sum(len(set(row.tolist()) - {topo.ep.rank}) for row in ranks)
        results[name] = (layer.dispatcher.last_bytes_sent, touched, pairs * hidden * 4)
    return results


def compare_ep_bytes(args) -> None:
    from megalite.testing import run_distributed

    h, t, k, g = args.hidden, args.batch * args.seq_length, args.topk, args.group_topk
    per_rank = run_distributed(_ep_bytes, 4, h, args.experts, k, args.groups, g, t, timeout=600)
    print(f"ep=4, one MoE layer, {t} tokens per rank, hidden {h}, top-{k} of {args.experts} experts in "
          f"{args.groups} groups (one per EP rank), group top-{g}; bytes one dispatch sends to other ranks (fp32)")
    print(f"  bound, one row per chosen expert: T x topk x h x 4 = {t * k * h * 4}")
    print(f"  bound, one row per chosen rank:   T x min(topk, group_topk) x h x 4 = {t * min(k, g) * h * 4}")
    for name in ("group-limited", "not limited"):
        sent = [rank[name][0] for rank in per_rank]
        touched = max(rank[name][1] for rank in per_rank)
        exact = [rank[name][2] for rank in per_rank]
        print(f"  {name:13}: sent per rank {sent} (mean {sum(sent) / len(sent):.0f}); "
              f"(token, other rank) pairs x h x 4: {exact}; most EP ranks one token touched: {touched}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-topk", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-ep", action="store_true", help="only the ep=1 step comparison")
    args = parser.parse_args()
    problem = None
    if args.hidden % 64 or args.seq_length > 4 * ORIGINAL_CONTEXT:
        problem = (f"--hidden must be a multiple of 64 (heads of 64) and --seq-length at most {4 * ORIGINAL_CONTEXT}, "
                   f"got {args.hidden} and {args.seq_length}")
    elif not args.skip_ep and args.groups != 4:
        problem = f"the EP part aligns the groups with 4 EP ranks, so --groups must be 4, got {args.groups}"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(args.threads)
    print(f"{args.layers} layers (the first dense), hidden {args.hidden}, {args.experts} experts top-{args.topk} in "
          f"{args.groups} groups (top-{args.group_topk}), batch {args.batch} x {args.seq_length}, fp32, "
          f"{args.threads} thread(s); best of {args.repeats} steps each")
    if importlib.util.find_spec("torchtitan") is None:
        print("note: torchtitan is not importable, so the step comparison is skipped (see this file's docstring)")
    else:
        compare_step(args)
    if not args.skip_ep:
        compare_ep_bytes(args)


if __name__ == "__main__":
    main()
