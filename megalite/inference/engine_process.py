"""The engine in its own process (vLLM's engine-core split), what ``serve`` runs: :class:`EngineProcess` in the
HTTP process, :func:`engine_main` in the child.

The child loads the checkpoint (the only process that does: the HTTP process
holds no weights), reports the facts requests are checked against
(:class:`EngineFacts`), then runs the same :class:`EngineLoop` a thread would,
reading messages from its end of a pipe and writing one batch per engine step
to it.  The HTTP process is an :class:`EngineClient`: it tokenizes, checks,
compiles grammars (to answer a bad one with a 400; the child compiles an
accepted one again for its own sampler), renders replies and streams; a reader
thread receives each batch and hands it to the asyncio loop in one hop.  So the
HTTP loop and the engine no longer share a GIL.

Lifetime: :meth:`EngineProcess.stop` asks the child to stop and waits for it.
The child ignores SIGINT and SIGTERM (a terminal's Ctrl-C, or a launcher such
as torchrun, signals the whole process group: the HTTP process decides, and
stops it cleanly) and stops when its pipe closes, so it does not outlive an
HTTP process that was killed.  A child that dies, or whose
engine fails, fails every waiting request and turns ``alive`` false: the
server then exits non-zero.  Under tensor parallelism the child is TP rank 0
(it joins the process group torchrun's environment describes; the other ranks
run the engine's worker loop as before).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from dataclasses import dataclass

from megalite.inference.config import EngineConfig
from megalite.inference.engine_client import EngineClient
from megalite.inference.request_check import EngineFacts, RequestChecker


@dataclass(frozen=True)
class EngineSpec:
    """What the child loads: ``LLM(checkpoint, tensor_parallel_size, engine_config=..., tokenizer=...)``."""

    checkpoint: str
    tensor_parallel_size: int = 1
    engine_config: EngineConfig | None = None
    tokenizer: str | None = None


class EngineStartError(RuntimeError):
    """The engine process could not load the checkpoint (a bad-input ValueError is re-raised as such)."""


def engine_main(conn, spec: EngineSpec) -> None:
    """The child: load, report ``("ready", EngineFacts)`` (or ``("failed", bad_input, message)``), serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch.distributed as dist

    from megalite import topology
    from megalite.inference.engine_loop import EngineLoop
    from megalite.inference.llm import LLM

    try:
        if spec.tensor_parallel_size > 1:
            topology.initialize(tp=spec.tensor_parallel_size)
        llm = LLM(spec.checkpoint, spec.tensor_parallel_size, engine_config=spec.engine_config,
                  tokenizer=spec.tokenizer)
    except Exception as error:  # noqa: BLE001 - the HTTP process reports it and exits
        bad_input = isinstance(error, (ValueError, FileNotFoundError))  # run_cli's exit 2, its message as is
        conn.send(("failed", bad_input, str(error) if bad_input else f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from None
    conn.send(("ready", llm.engine.checker.facts))

    def receive(timeout: float):
        try:
            return conn.recv() if conn.poll(timeout) else None
        except (EOFError, OSError):  # the HTTP process is gone
            return ("stop",)

    def send(batch: dict) -> None:
        try:
            conn.send(batch)
        except (BrokenPipeError, OSError):  # the HTTP process is gone; the next receive stops the loop
            pass

    error = EngineLoop(llm.engine, receive, send).run()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Nothing is left to clean up: skip the interpreter's teardown (seconds with torch loaded), so the server
    # stops promptly.
    os._exit(1 if error is not None else 0)


class EngineProcess(EngineClient):
    """Starts the engine process for ``spec`` and waits until it has loaded; ``tokenizer`` (this process's
    copy: the checkpoint's or ``--tokenizer``'s) checks requests and compiles grammars here."""

    def __init__(self, spec: EngineSpec, tokenizer, max_pending: int = 1024):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=engine_main, args=(child, spec), name="megalite-engine", daemon=True)
        self.process.start()
        child.close()
        self._stopping = False
        try:
            reply = self._conn.recv()
        except EOFError:
            self.process.join()
            raise EngineStartError(f"the engine process exited with status {self.process.exitcode} while "
                                   "loading") from None
        if reply[0] == "failed":
            self.process.join()
            raise (ValueError if reply[1] else EngineStartError)(reply[2])
        facts: EngineFacts = reply[1]
        self._send_lock = threading.Lock()
        super().__init__(RequestChecker(facts, tokenizer), self._send, max_pending)
        self.reader = threading.Thread(target=self._read, name="megalite-engine-reader", daemon=True)
        self.reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _send(self, message) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):  # the child is gone: the reader reports it
                pass

    def _read(self) -> None:
        """Hand each batch to the client; when the pipe closes without a stop, the engine died."""
        while True:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                break
            self.from_engine(batch)
            if "failed" in batch:
                return
        if not self._stopping:
            self.process.join(timeout=5)
            self.from_engine({"events": [], "stats": self.metrics.engine,
                              "failed": f"the engine process exited with status {self.process.exitcode}"})

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the engine process to stop, wait for it (terminate it if it does not), and close the pipe."""
        self._stopping = True
        self._send(("stop",))
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout_s)
        self._conn.close()
        self.reader.join(timeout_s)

