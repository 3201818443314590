"""The real HTTP server on a free loopback port, run on a background thread for a test (``with Server(...)``)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

from megalite.data.tokenizer import ByteTokenizer
from megalite.inference import LLM, EngineConfig
from megalite.inference.api_server import ServerConfig, build_app
from megalite.inference.engine_client import EngineThread
from tests.inference.common import tiny_model

BYTES = ByteTokenizer()


def byte_model(**overrides):
    """A tiny llama over ByteTokenizer's 259 ids, at init std 0.3 (fp32 log-probs hold to 1e-5)."""
    return tiny_model(vocab_size=BYTES.vocab_size, max_position_embeddings=256, init_method_std=0.3, **overrides)


class Server:
    """``build_app`` over an :class:`EngineThread` of ``model``, served by aiohttp on 127.0.0.1:<free port>."""

    def __init__(self, model, config: ServerConfig | None = None, tokenizer=BYTES, engine_config=None, *,
                 chat_template=None):
        self.llm = LLM.from_model(model, tokenizer=tokenizer,
                                  engine_config=engine_config or EngineConfig(block_size=4, num_blocks=256))
        self.config = config or ServerConfig(max_tokens_limit=200)
        self.loop = EngineThread(self.llm.engine, max_pending=self.config.max_pending)
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


def serve_command(checkpoint: str, *extra: str) -> tuple[list[str], dict]:
    """``python -m megalite.inference.serve --load checkpoint --port 0 ...`` and its environment (this checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    return [sys.executable, "-m", "megalite.inference.serve", "--load", checkpoint, "--port", "0", *extra], env


def engine_pid(server_pid: int) -> int:
    """The pid of the serve process's engine process (its multiprocessing child; Linux ``/proc``)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(") ", 1)[-1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                spawned = b"spawn_main" in f.read()
        except (OSError, ValueError):  # not a process, or one that just ended
            continue
        if parent == server_pid and spawned:
            return int(entry)
    raise AssertionError(f"the server (pid {server_pid}) has no engine process")


def exits(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether process ``pid`` ends (or is a zombie) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(") ", 1)[-1].startswith(("Z", "X")):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False
