"""``python -m megalite.inference.serve``: an OpenAI-compatible server for a megalite checkpoint (``pip install
megalite[serve]``).

    python -m megalite.inference.serve --load CKPT                       # one process
    torchrun --nproc_per_node 2 -m megalite.inference.serve --load CKPT --tensor-model-parallel-size 2

The tokenizer is the checkpoint's (``--tokenizer`` names another: a Hugging
Face directory or a sentencepiece model); chat requests use its chat template
(``--chat-template FILE`` overrides; a file that does not load exits 2; a
model with none answers chat requests with a 400 saying so).  Endpoints and limits are
:mod:`megalite.inference.api_server`'s; the engine runs in its own process
(:mod:`megalite.inference.engine_process`: only it loads the weights; under TP
it is rank 0 and broadcasts step plans), so the HTTP loop does not share its
GIL.  Safe by default: it binds 127.0.0.1 unless ``--host`` says otherwise.
When the engine dies the server stops and the process exits with status 1, so
a supervisor restarts it; SIGINT or SIGTERM stop the server and its engine
process.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from megalite.cli import run_cli
from megalite.flags import SHARED_FLAGS, ArgumentParser, Flag, FlagTable
from megalite.inference.api_server import ServerConfig, build_app
from megalite.inference.config import EngineConfig
from megalite.inference.engine_client import EngineClient

_SERVER, _ENGINE = "server", "engine"
SERVE_FLAGS = FlagTable((
    Flag("--host", _SERVER, default="127.0.0.1", help="address to bind (loopback only by default)"),
    Flag("--port", _SERVER, default=8000, type=int, help="0 picks a free port (printed at start)"),
    Flag("--tokenizer", _SERVER, default=None,
         help="None: the checkpoint's; else a Hugging Face tokenizer directory or a sentencepiece model"),
    Flag("--served-model-name", _SERVER, ("ServerConfig.model_name",), help="the model id clients name"),
    Flag("--max-body-bytes", _SERVER, ("ServerConfig.max_body_bytes",), type=int),
    Flag("--max-tokens-limit", _SERVER, ("ServerConfig.max_tokens_limit",), type=int,
         help="the largest max_tokens a request may ask"),
    Flag("--max-n", _SERVER, ("ServerConfig.max_n",), type=int, help="the largest n or best_of a request may ask"),
    Flag("--max-pending-requests", _SERVER, ("ServerConfig.max_pending",), type=int,
         help="requests held at once; more get 429 with Retry-After"),
    Flag("--request-timeout", _SERVER, ("ServerConfig.request_timeout_s",), type=float,
         help="seconds from arrival to the last token (504 after)"),
    Flag("--body-timeout", _SERVER, ("ServerConfig.body_timeout_s",), type=float,
         help="seconds to receive a request body (408 after)"),
    Flag("--chat-template", _SERVER, default=None,
         help="a Jinja chat template file (None: the tokenizer's chat_template.jinja or tokenizer_config.json)"),
    Flag("--grammar-compile-time-limit", _ENGINE, ("EngineConfig.grammar_compile_time_limit_s",), type=float,
         help="seconds to compile a request's structured_outputs, response_format or tool_choice grammar "
              "(400 after)"),
    Flag("--block-size", _ENGINE, ("EngineConfig.block_size",), type=int, help="tokens per KV-cache block"),
    Flag("--num-blocks", _ENGINE, ("EngineConfig.num_blocks",), type=int),
    Flag("--max-num-batched-tokens", _ENGINE, ("EngineConfig.max_num_batched_tokens",), type=int),
    Flag("--max-num-seqs", _ENGINE, ("EngineConfig.max_num_seqs",), type=int),
    Flag("--no-prefix-caching", _ENGINE, ("EngineConfig.enable_prefix_caching",), sets=False),
    Flag("--no-cuda-graphs", _ENGINE, ("EngineConfig.cuda_graphs",), sets=False,
         help="run decode steps eagerly on CUDA"),
    Flag("--decode-attention", _ENGINE, ("EngineConfig.decode_attention",), choices=("auto", "sdpa", "triton"),
         help="attention of the CUDA-graphed decode steps"),
), (EngineConfig, ServerConfig))
"""The server's own rows; ``--load`` and ``--tensor-model-parallel-size`` are ``megalite.flags.SHARED_FLAGS``'."""


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m megalite.inference.serve",
                       description="OpenAI-compatible completions server for a megalite checkpoint")
    SHARED_FLAGS.add_to(p, ["--load", "--tensor-model-parallel-size"], helps={"--load": "megalite checkpoint directory"},
                        required=["--load"])
    SERVE_FLAGS.add_to(p)
    return p.parse_args(argv)


def chat_template(tokenizer, template_file: str | None):
    """The chat template for :func:`build_app`, or the ChatTemplateError saying why there is none.  A
    ``template_file`` that does not load raises (bad input)."""
    from megalite.inference.chat_template import ChatTemplateError, load_chat_template

    try:
        return load_chat_template(getattr(tokenizer, "path", None), template_file)
    except ChatTemplateError as error:
        if template_file is not None:
            raise
        return error


async def _serve(loop: EngineClient, config: ServerConfig, tokenizer, template, args) -> None:
    from aiohttp import web

    app = build_app(loop, config, tokenizer=tokenizer, chat_template=template)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    terminated = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminated.set)
    print(f"megalite.inference.serve listening on http://{args.host}:{port}", flush=True)
    try:
        while loop.alive and not terminated.is_set():
            await asyncio.sleep(0.2)
    finally:
        await runner.cleanup()


def main(argv=None) -> int:
    import os

    import torch.distributed as dist

    from megalite import topology
    from megalite.inference.engine_process import EngineProcess, EngineSpec
    from megalite.inference.llm import LLM, checkpoint_tokenizer, load_tokenizer

    args = parse_args(argv)
    config = EngineConfig(**SERVE_FLAGS.config_values(args, "EngineConfig"))
    server_config = ServerConfig(**SERVE_FLAGS.config_values(args, "ServerConfig"))
    tp = args.tensor_model_parallel_size
    if "WORLD_SIZE" in os.environ or tp > 1:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != tp:
            raise ValueError(f"the server runs one model replica: WORLD_SIZE={world} must equal "
                             f"--tensor-model-parallel-size={tp}")
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer is not None else checkpoint_tokenizer(args.load)[0]
    template = chat_template(tokenizer, args.chat_template)  # on every rank: a bad file exits
    if int(os.environ.get("RANK", "0")) != 0:  # a TP worker: rank 0's engine process drives it
        topology.initialize(tp=tp)
        try:
            LLM(args.load, tp, engine_config=config, tokenizer=args.tokenizer).engine.run_worker()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    engine = EngineProcess(EngineSpec(args.load, tp, config, args.tokenizer), tokenizer,
                           max_pending=server_config.max_pending)
    try:
        asyncio.run(_serve(engine, server_config, tokenizer, template, args))
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
    if engine.error is not None:
        print(f"error: the engine failed: {engine.error}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
