"""``python -m megalite.plan``: rank the parallel layouts of a model on N GPUs before launching it.

The model is a preset (``--model llama3-70b``, see ``presets.json``), a Hugging Face ``config.json``
(``--hf-config``, GPT-2 and Llama families), or the pretraining flags
themselves (``--num-layers 24 --hidden-size 2048 ... --vocab-size 50257``); every pretraining flag is
accepted, so a launch line can be planned as it is: its own layout is estimated first ("as given").
``--json`` prints ``{"as_given", "layouts": [...], "infeasible": [...]}``; ``--calibrate`` measures
this machine and writes a hardware profile.
"""

from __future__ import annotations

import json
import os
import sys

from megalite.cli import run_cli
from megalite.hardware import load_hardware, profile_names

PRESETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets.json")
GIB = 2 ** 30


def _planner_flags(parser):
    group = parser.add_argument_group("planner")
    group.add_argument("--model", default=None, help="a preset: " + ", ".join(preset_names()))
    group.add_argument("--hf-config", default=None, metavar="PATH",
                       help="a Hugging Face config.json (GPT-2 or Llama family) as the model")
    group.add_argument("--num-gpus", type=int, default=None, help="GPUs of the run (or --num-nodes x --gpus-per-node)")
    group.add_argument("--num-nodes", type=int, default=None)
    group.add_argument("--gpus-per-node", type=int, default=None)
    group.add_argument("--hardware", default="h100", help="profile: " + ", ".join(profile_names()) + " or a .json path")
    group.add_argument("--top", type=int, default=5, help="how many layouts to print")
    group.add_argument("--json", action="store_true", help="print the plan as JSON")
    group.add_argument("--calibrate", default=None, metavar="PATH",
                       help="measure this machine's GEMM throughput and bandwidths, write a profile to PATH, exit")
    return parser


def preset_names() -> list[str]:
    with open(PRESETS) as f:
        return sorted(k for k in json.load(f) if not k.startswith("_"))


def preset_config(name: str):
    from megalite.models import GPTConfig
    from megalite.moe import MoEConfig

    with open(PRESETS) as f:
        presets = json.load(f)
    if name not in presets or name.startswith("_"):
        raise ValueError(f"unknown --model {name!r}; presets: {', '.join(preset_names())}")
    values = dict(presets[name])
    moe = values.pop("moe", None)
    config = GPTConfig(**values)
    if moe is not None:
        config.moe = MoEConfig(**moe)
    return config


def _world(args) -> int:
    if args.num_gpus is not None:
        world = args.num_gpus
    elif args.num_nodes is not None and args.gpus_per_node is not None:
        world = args.num_nodes * args.gpus_per_node
    else:
        raise ValueError("give --num-gpus N (or --num-nodes and --gpus-per-node)")
    if world < 1:
        raise ValueError(f"--num-gpus must be positive, got {world}")
    return world


def layout_json(est) -> dict:
    """One ranked layout in the issue's shape."""
    layout = est.layout
    from megalite.plan.estimate import schedule_name

    return {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp or 1, "cp": layout.cp, "ep": layout.ep,
            "dp": layout.dp, "data_parallel": "fsdp2" if layout.fsdp else "zero1" if layout.zero1 else "ddp",
            "micro_batch_size": layout.micro_batch_size, "num_microbatches": est.num_microbatches,
            "recompute": layout.recompute or "none", "schedule": schedule_name(layout), "memory": est.memory,
            "time_s": est.time, "step_time_s": est.step_time_s, "tokens_per_s_per_gpu": est.tokens_per_s_per_gpu,
            "mfu": est.mfu, "flags": " ".join(layout.flags())}


_PLANNER_VALUED = {"--model", "--hf-config", "--num-gpus", "--num-nodes", "--gpus-per-node", "--hardware", "--top", "--calibrate",
                   "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                   "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--micro-batch-size",
                   "--virtual-pipeline-model-parallel-size", "--pipeline-schedule", "--recompute-granularity"}
_PLANNER_SWITCHES = {"--json", "--sequence-parallel", "--use-distributed-optimizer", "--use-torch-fsdp2", "--bf16",
                     "--fp16"}


def _model_flags(argv: list[str]) -> list[str]:
    """``argv`` without the planner's own flags and the layout flags the plan chooses."""
    out, skip = [], False
    for token in argv:
        name = token.split("=", 1)[0]
        if skip:
            skip = False
        elif name in _PLANNER_VALUED:
            skip = "=" not in token
        elif name not in _PLANNER_SWITCHES:
            out.append(token)
    return out


def launch_line(est, world: int, per_node: int, model_flags: str) -> str:
    per_node = min(world, per_node)
    return (f"torchrun --nproc-per-node {per_node} --nnodes {max(1, world // per_node)} examples/pretrain_gpt.py "
            f"{model_flags} {' '.join(est.layout.flags())}")


def _describe(est, world: int) -> str:
    mem = est.memory
    parts = ", ".join(f"{k} {mem[k] / GIB:.2f}" for k in ("weights", "grads", "optimizer", "activations"))
    times = ", ".join(f"{k} {v:.3g}" for k, v in est.time.items() if v > 0)
    return (f"{est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {est.mfu:.1%}, step {est.step_time_s:.3g} s "
            f"({times}); memory {mem['total'] / GIB:.2f} GiB ({parts} GiB); "
            f"{' '.join(est.layout.flags())}")


def main(argv=None) -> int:
    from megalite.plan.layout import Layout
    from megalite.plan.search import check_layout, plan
    from megalite.training.flags import build_parser, gpt_config

    parser = build_parser(_planner_flags)
    args = parser.parse_args(argv)
    if args.calibrate is not None:
        from megalite.plan.calibrate import calibrate

        calibrate(args.calibrate)
        return 0
    world = _world(args)
    hw = load_hardware(args.hardware)
    if args.model is not None and args.hf_config is not None:
        raise ValueError("give --model or --hf-config, not both")
    if args.model is not None:
        config = preset_config(args.model)
        model_flags = f"(the {args.model} architecture's flags)"
    elif args.hf_config is not None:
        from megalite.checkpoint.hf import hf_config_to_gpt

        with open(args.hf_config) as f:
            config = hf_config_to_gpt(json.load(f))
        model_flags = f"(the flags of {args.hf_config}'s architecture)"
    else:
        if args.vocab_size is None:
            raise ValueError("give --model PRESET or the model's pretraining flags including --vocab-size")
        config = gpt_config(args)
        model_flags = " ".join(_model_flags(argv if argv is not None else sys.argv[1:]))
    seq, gbs = args.seq_length, args.global_batch_size
    if gbs is None:
        raise ValueError("give --global-batch-size")
    given = None
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if args.model is None and args.hf_config is None:
        if world % (tp * pp * cp):
            raise ValueError(f"--num-gpus {world} is not divisible by tp*pp*cp = {tp * pp * cp}")
        layout = Layout.from_args(args, world)
        reason = check_layout(config, layout, seq, gbs)
        given = plan(config, world, hw, seq_length=seq, global_batch_size=gbs, precision=layout.precision,
                     micro_batch_sizes=(layout.micro_batch_size,), recomputes=(layout.recompute,),
                     layouts=[layout]) if reason is None else reason
    preset = args.model is not None or args.hf_config is not None
    precision = "bf16" if args.bf16 or preset else "fp16" if args.fp16 else "fp32"
    result = plan(config, world, hw, seq_length=seq, global_batch_size=gbs, precision=precision)
    if not result.ranked:
        missing = [r for _, r in result.infeasible if r.startswith("does not fit by")]
        smallest = min(missing, key=lambda r: float(r.split()[4])) if missing else "no layout divides the GPUs"
        raise ValueError(f"no layout of this model fits on {world} x {hw.name}: smallest shortfall: {smallest}")
    top = result.ranked[:args.top]
    if args.json:
        out = {"hardware": hw.name, "num_gpus": world, "considered": result.considered,
               "layouts": [layout_json(e) for e in top],
               "infeasible": [{"flags": " ".join(l.flags()), "reason": r} for l, r in result.infeasible]}
        if given is not None:
            out["as_given"] = (layout_json(given.ranked[0]) if not isinstance(given, str) and given.ranked
                               else {"reason": given if isinstance(given, str) else given.infeasible[0][1]})
        print(json.dumps(out, indent=1))
        return 0
    print(f"{result.considered} layouts considered on {world} x {hw.name}; {len(result.ranked)} fit")
    if given is not None:
        if isinstance(given, str):
            print(f"as given: refused: {given}")
        elif given.ranked:
            print(f"as given: {_describe(given.ranked[0], world)}")
        else:
            print(f"as given: {given.infeasible[0][1]}")
    for rank, est in enumerate(top, 1):
        print(f"{rank}. {_describe(est, world)}")
    print(f"launch: {launch_line(top[0], world, args.gpus_per_node or hw.gpus_per_node, model_flags)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
