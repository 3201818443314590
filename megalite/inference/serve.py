"""``python -m megalite.inference.serve``: an OpenAI-compatible server for a megalite checkpoint (``pip install
megalite[serve]``).

    python -m megalite.inference.serve --load CKPT                       # one process
    torchrun --nproc_per_node 2 -m megalite.inference.serve --load CKPT --tensor-model-parallel-size 2

The tokenizer is the checkpoint's (``--tokenizer`` names another: a Hugging
Face directory or a sentencepiece model); chat requests use its chat template
(``--chat-template FILE`` overrides; a file that does not load exits 2; a
model with none answers chat requests with a 400 saying so).  Endpoints and limits are
:mod:`megalite.inference.api_server`'s; the engine runs on its own thread
(:mod:`megalite.inference.engine_loop`; TP rank 0 also broadcasts step plans
from there).  Safe by default: it binds 127.0.0.1 unless ``--host`` says
otherwise.  When the engine thread dies the server stops and the process
exits with status 1, so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging

from megalite.cli import run_cli
from megalite.flags import SHARED_FLAGS, ArgumentParser, Flag, FlagTable
from megalite.inference.api_server import ServerConfig, build_app
from megalite.inference.config import EngineConfig
from megalite.inference.engine_loop import EngineLoop

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


async def _serve(loop: EngineLoop, config: ServerConfig, tokenizer, template, args) -> None:
    from aiohttp import web

    app = build_app(loop, config, tokenizer=tokenizer, chat_template=template)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"megalite.inference.serve listening on http://{args.host}:{port}", flush=True)
    try:
        while loop.alive:
            await asyncio.sleep(0.2)
    finally:
        await runner.cleanup()


def main(argv=None) -> int:
    import os

    import torch.distributed as dist

    from megalite import topology
    from megalite.inference.llm import LLM

    args = parse_args(argv)
    config = EngineConfig(**SERVE_FLAGS.config_values(args, "EngineConfig"))
    server_config = ServerConfig(**SERVE_FLAGS.config_values(args, "ServerConfig"))
    tp = args.tensor_model_parallel_size
    distributed = "WORLD_SIZE" in os.environ or tp > 1
    if distributed:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != tp:
            raise ValueError(f"the server runs one model replica: WORLD_SIZE={world} must equal "
                             f"--tensor-model-parallel-size={tp}")
        topology.initialize(tp=tp)
    try:
        llm = LLM(args.load, tp, engine_config=config, tokenizer=args.tokenizer)
        engine = llm.engine
        template = chat_template(llm.tokenizer, args.chat_template)  # on every rank: a bad file exits
        if engine.tp_rank != 0:
            engine.run_worker()
            return 0
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        loop = EngineLoop(engine, max_pending=server_config.max_pending)
        loop.start()
        try:
            asyncio.run(_serve(loop, server_config, llm.tokenizer, template, args))
        except KeyboardInterrupt:
            pass
        finally:
            if loop.thread.is_alive():
                loop.stop()
        if loop.error is not None:
            print(f"error: the engine failed: {loop.error}", flush=True)
            return 1
        return 0
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
