"""The real HTTP server on a free loopback port, run on a background thread for a test (``with Server(...)``)."""

from __future__ import annotations

import asyncio
import threading

from megalite.data.tokenizer import ByteTokenizer
from megalite.inference import LLM, EngineConfig
from megalite.inference.api_server import ServerConfig, build_app
from megalite.inference.engine_loop import EngineLoop
from tests.inference.common import tiny_model

BYTES = ByteTokenizer()


def byte_model(**overrides):
    """A tiny llama over ByteTokenizer's 259 ids, at init std 0.3 (fp32 log-probs hold to 1e-5)."""
    return tiny_model(vocab_size=BYTES.vocab_size, max_position_embeddings=256, init_method_std=0.3, **overrides)


class Server:
    """``build_app`` over an :class:`EngineLoop` of ``model``, served by aiohttp on 127.0.0.1:<free port>."""

    def __init__(self, model, config: ServerConfig | None = None, tokenizer=BYTES, engine_config=None, *,
                 chat_template=None):
        self.llm = LLM.from_model(model, tokenizer=tokenizer,
                                  engine_config=engine_config or EngineConfig(block_size=4, num_blocks=256))
        self.config = config or ServerConfig(max_tokens_limit=200)
        self.loop = EngineLoop(self.llm.engine, max_pending=self.config.max_pending)
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def __enter__(self) -> Server:
        from aiohttp import web

        self.loop.start()
        self.aio = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.aio.run_forever, daemon=True)
        self.thread.start()

        async def start():
            app = build_app(self.loop, self.config, tokenizer=self.tokenizer, chat_template=self.chat_template)
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", 0).start()
            return self.runner.addresses[0][1]

        self.port = asyncio.run_coroutine_threadsafe(start(), self.aio).result(timeout=30)
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.aio).result(timeout=30)
        self.aio.call_soon_threadsafe(self.aio.stop)
        self.thread.join(timeout=30)
        if self.loop.thread.is_alive():
            self.loop.stop()

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def idle(self) -> bool:
        engine = self.llm.engine
        return engine.allocator.num_used() == 0 and not engine.requests and not engine.has_unfinished()
