"""The HTTP server vs the in-process engine: the same requests through the official ``openai`` client (concurrent
streaming requests over loopback HTTP) and through ``LLM.generate``, in one run.

    python benchmarks/serving.py [--requests 64] [--max-tokens 48] [--hidden 256] [--layers 4] [--repeats 2]
                                 [--server-cpus 0-1 --client-cpus 2-7 [--http-cpus 2-3]]

Workload: ``--requests`` text prompts (16-128 bytes, seeded) on a Llama-style model with random weights over
megalite's ByteTokenizer; greedy, ``ignore_eos``, ``--max-tokens`` tokens each, so both sides make the same
tokens.  The HTTP side sends all requests at once, streaming, from a thread pool (one thread per request,
sharing one ``openai`` client as an application would, its pool's connections opened before timing) in a
separate client process, to
``python -m megalite.inference.serve`` over the same model saved as a checkpoint (its HTTP process and its
engine process, as deployed; same engine config as the in-process side).

Fairness: the client is a separate process whose CPU seconds during the run are printed on their own (an
OpenAI client parsing server-sent events costs more CPU than the server spends sending them); with
``--server-cpus``/``--client-cpus`` this process (``LLM.generate``, and the server's two processes, which
inherit its cores) and the client are pinned to disjoint cores, so the comparison is between the same engine
on the same cores with and without HTTP in front of it, the client playing the remote machine it would be;
``--http-cpus`` moves the server's HTTP process off the engine's cores, as vLLM deploys its API server beside
its engine core.  Without pinning both share the machine's cores.  Set ``OMP_NUM_THREADS`` the same for both
(it is printed).

Prints output tokens/s of both and their ratio (HTTP overhead), the CPU seconds of the engine side in each (for
HTTP: the server's HTTP and engine processes) and of the client, and p50/p99 time to first token and
inter-token latency as the clients saw them (a chunk of k tokens counts as k gaps of 1/k of its wait), and
where a request's first token went, from the server's ``/metrics`` (mean ms from arrival to submission, to
admission by the engine loop, to the start of its first step, to its first token, and a batch's delivery to
the HTTP loop) beside the engine loop's time between steps; then
the cost of constrained decoding (a JSON schema through llguidance) against the same requests
unconstrained, in process.  Each side runs ``--repeats`` times (alternating) and keeps its fastest run.  Wall
times: the machine may be shared, so say so with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

try:
    import aiohttp  # noqa: F401
    import openai
except ImportError:
    print("error: this benchmark needs aiohttp and openai (pip install 'megalite[serve]' openai)", file=sys.stderr)
    raise SystemExit(2) from None

from megalite.data.tokenizer import ByteTokenizer  # noqa: E402
from megalite.inference import LLM, EngineConfig, SamplingParams  # noqa: E402
from megalite.models import GPTConfig, GPTModel  # noqa: E402


def cpus(text: str) -> set[int]:
    """A CPU list such as ``0-1,4``."""
    out = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-structured", action="store_true", help="only the HTTP vs in-process comparison")
    p.add_argument("--server-cpus", type=cpus, help="pin this process (engine, server, LLM.generate) here: 0-1,4")
    p.add_argument("--client-cpus", type=cpus, help="pin the client process here (disjoint from --server-cpus)")
    p.add_argument("--http-cpus", type=cpus, help="pin the server's HTTP process here, leaving its engine process "
                                                  "on --server-cpus (vLLM's layout); default: both there")
    p.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)  # internal: be the client process
    return p.parse_args()


def build_model(args, vocab: int) -> GPTModel:
    heads = max(1, args.hidden // 64)
    config = GPTConfig(vocab_size=vocab, num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=heads,
                       num_query_groups=heads, ffn_hidden_size=int(args.hidden * 8 / 3) // 8 * 8,
                       max_position_embeddings=512, normalization="RMSNorm", activation="swiglu",
                       position_embedding_type="rope", add_bias_linear=False, init_method_std=0.02, seed=0)
    return GPTModel(config).eval()


def prompts(count: int) -> list[str]:
    rng = random.Random(0)
    words = "the a cat dog sat on mat ran far away home tree blue red green one two three four".split()
    out = []
    for _ in range(count):
        text = ""
        while len(text) < rng.randint(16, 128):
            text += rng.choice(words) + " "
        out.append(text)
    return out


def engine_config(requests: int) -> EngineConfig:
    return EngineConfig(block_size=16, num_blocks=requests * 16, max_num_seqs=requests)


def in_process(model, tokenizer, texts, max_tokens):
    llm = LLM.from_model(model, tokenizer=tokenizer, engine_config=engine_config(len(texts)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(texts, params)
    elapsed = time.perf_counter() - started
    return elapsed, [o.outputs[0].text for o in outputs], time.process_time() - cpu, llm.engine.stats["steps"]


SCHEMA = {"type": "object", "properties": {"note": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["note", "count"]}
"""The constrained run's schema: a free string first, so a random model writes about as many tokens as without."""


def structured(model, tokenizer, texts, max_tokens):
    """Generated tokens/s of ``LLM.generate`` without and with a JSON-schema grammar (llguidance), same
    prompts, greedy; each side's best of two runs.  Counts the tokens each side actually made (a constrained
    sample may end early, when its JSON is complete)."""
    from megalite.inference import StructuredOutputsParams

    llm = LLM.from_model(model, tokenizer=tokenizer, engine_config=engine_config(len(texts)))
    grammar = StructuredOutputsParams(json=SCHEMA)
    rates = {}
    for name, extra in (("plain", {}), ("constrained", {"structured_outputs": grammar})) * 2:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra)
        started = time.perf_counter()
        outputs = llm.generate(texts, params)
        made = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates[name] = max(rates.get(name, 0.0), made / (time.perf_counter() - started))
    return rates["plain"], rates["constrained"]


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(") ", 1)[-1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError):
            continue
    return out


class Served:
    """``python -m megalite.inference.serve`` (its engine in its own process, as deployed) over ``model`` saved as
    a checkpoint in ``directory``, with the in-process side's engine config, on this process's cores."""

    def __init__(self, model, requests, directory, http_cpus=None):
        from megalite.checkpoint import save_sharded

        save_sharded(directory, 1, [model], extra={"args": {}})  # no tokenizer flags: ByteTokenizer
        config = engine_config(requests)
        command = [sys.executable, "-m", "megalite.inference.serve", "--load", directory, "--port", "0",
                   "--max-tokens-limit", "512", "--max-pending-requests", str(4 * requests),
                   "--block-size", str(config.block_size), "--num-blocks", str(config.num_blocks),
                   "--max-num-seqs", str(config.max_num_seqs)]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "PYTHONPATH": ROOT})
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            raise SystemExit(f"error: the server did not start: {line!r}")
        self.url = line.split()[-1] + "/v1"
        self.pids = [self.proc.pid, *children(self.proc.pid)]  # HTTP process; engine process (+ resource tracker)
        if http_cpus:  # every thread of the HTTP process (threads it starts later inherit it)
            for task in os.listdir(f"/proc/{self.proc.pid}/task"):
                os.sched_setaffinity(int(task), http_cpus)

    def cpu(self) -> list[float]:
        """CPU seconds each of the server's processes (HTTP, engine) has used so far."""
        return [process_cpu(pid) for pid in self.pids]

    def metrics(self) -> dict:
        """The server's ``/metrics``."""
        with urllib.request.urlopen(self.url[:-len("/v1")] + "/metrics") as reply:
            return {name: float(value) for name, value in (line.split() for line in reply.read().decode().splitlines())}

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)


LATENCIES = ("request_submit", "request_admission", "request_queue", "time_to_first_token", "batch_delivery")
"""The server's latencies on a request's way to its first token, in order (``/metrics`` sums and counts)."""


def over_http(server, args):
    """All requests at once from a client process (its connections opened before timing); returns wall time,
    texts, the server's CPU seconds, times to first token, inter-token gaps, the client's CPU seconds, the chunks
    it read, the engine's step and loop seconds, the client's send spread, its first token, and the server's
    mean latencies (:data:`LATENCIES`) over the run."""
    command = [sys.executable, os.path.abspath(__file__), "--client", server.url, "--requests", str(args.requests),
               "--max-tokens", str(args.max_tokens)]
    if args.client_cpus:
        command += ["--client-cpus", ",".join(map(str, sorted(args.client_cpus)))]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "warm":  # its pool holds a connection per request now
        raise SystemExit("error: the client process failed while warming up")
    cpu, before = server.cpu(), server.metrics()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    out = proc.stdout.read()
    if proc.wait() != 0:
        raise SystemExit("error: the client process failed")
    cpu = [b - a for a, b in zip(cpu, server.cpu())]  # the server's processes (HTTP, engine), not the client
    after = server.metrics()
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    engine = {name: delta[f"megalite_{name}"] for name in
              ("engine_steps_total", "engine_step_seconds_sum", "engine_step_cpu_seconds_sum",
               "engine_loop_seconds_sum")}
    means = {name: delta[f"megalite_{name}_seconds_sum"] / max(delta[f"megalite_{name}_seconds_count"], 1)
             for name in LATENCIES}
    result = json.loads(out.splitlines()[-1])
    return (result["elapsed"], result["texts"], cpu, result["ttft"], result["itl"], result["cpu"], result["chunks"],
            engine, result["spread"], result["first"], means)


def client(url, texts, max_tokens):
    """The client process: every request at once, streaming, one thread each through one shared openai client
    (its connection pool holds a connection per stream, opened before timing by as many concurrent one-token
    requests: a deployed client's pool is warm).  Prints ``warm``, waits for a line on stdin, then runs and
    reports its own CPU seconds during the run."""
    shared = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    with ThreadPoolExecutor(len(texts)) as pool:
        list(pool.map(lambda text: shared.completions.create(model="megalite", prompt=text, max_tokens=1), texts))
    print("warm", flush=True)
    sys.stdin.readline()

    def one(text):
        sent = time.perf_counter()
        stamps, pieces = [], []
        for chunk in shared.completions.create(model="megalite", prompt=text, max_tokens=max_tokens, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            if chunk.choices:
                stamps.append((time.perf_counter(), len(getattr(chunk.choices[0], "token_ids", None) or [0])))
                pieces.append(chunk.choices[0].text)
        return sent, stamps, "".join(pieces)

    started, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(len(texts)) as pool:
        results = list(pool.map(one, texts))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    ttft = [stamps[0][0] - sent for sent, stamps, _ in results]
    itl = [(b - a) / k for _, stamps, _ in results for (a, _), (b, k) in zip(stamps, stamps[1:]) for _ in range(k)]
    chunks = sum(len(stamps) for _, stamps, _ in results)
    sent = [sent for sent, _, _ in results]
    first = min(stamps[0][0] for _, stamps, _ in results) - started  # the first token of any request
    print(json.dumps({"elapsed": elapsed, "texts": [text for _, _, text in results], "ttft": ttft, "itl": itl,
                      "cpu": cpu, "chunks": chunks, "spread": max(sent) - min(sent), "first": first}))


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main():
    args = parse_args()
    if args.client:
        if args.client_cpus:
            os.sched_setaffinity(0, args.client_cpus)
        return client(args.client, prompts(args.requests), args.max_tokens)
    if args.server_cpus:  # before any thread starts: every thread of this process inherits it
        os.sched_setaffinity(0, args.server_cpus)
    tokenizer = ByteTokenizer()
    model = build_model(args, tokenizer.vocab_size)
    texts = prompts(args.requests)
    tokens = args.requests * args.max_tokens
    scratch = tempfile.mkdtemp(prefix="megalite-serving-")
    server = Served(model, args.requests, os.path.join(scratch, "ckpt"), args.http_cpus)
    best_local = best_http = None
    try:
        in_process(model, tokenizer, texts[:4], 4)  # warm-up: first forwards, allocator
        openai.OpenAI(base_url=server.url, api_key="unused").completions.create(model="megalite", prompt=texts[0],
                                                                                max_tokens=4)  # the server's
        for _ in range(args.repeats):
            local = in_process(model, tokenizer, texts, args.max_tokens)
            http = over_http(server, args)
            if best_local is None or local[0] < best_local[0]:
                best_local = local
            if best_http is None or http[0] < best_http[0]:
                best_http = http
    finally:
        server.close()
        shutil.rmtree(scratch, ignore_errors=True)
    if best_local[1] != best_http[1]:
        print("warning: the HTTP texts differ from the in-process texts", file=sys.stderr)
    local_tps, http_tps = tokens / best_local[0], tokens / best_http[0]
    print(f"model: {args.layers} layers, hidden {args.hidden}, ByteTokenizer; {args.requests} requests x "
          f"{args.max_tokens} tokens, greedy; threads: {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(f"LLM.generate in process   {best_local[0]:7.2f} s  {local_tps:8.1f} tokens/s")
    print(f"openai client over HTTP   {best_http[0]:7.2f} s  {http_tps:8.1f} tokens/s  "
          f"(ratio {http_tps / local_tps:.3f}; overhead {100 * (1 - http_tps / local_tps):.1f}%)")
    print(f"server CPU s: in process {best_local[2]:.2f}, HTTP server {sum(best_http[2]):.2f} (HTTP process "
          f"{best_http[2][0]:.2f} + engine process {sum(best_http[2][1:]):.2f}; CPU ratio "
          f"{best_local[2] / sum(best_http[2]):.3f}); client process CPU s {best_http[5]:.2f}; "
          f"{best_http[6]} chunks for {tokens} tokens")
    engine = best_http[7]
    print(f"engine steps: in process {best_local[3]} in {best_local[0]:.2f} s; HTTP server "
          f"{engine['engine_steps_total']:.0f}, in engine.step {engine['engine_step_seconds_sum']:.2f} s wall / "
          f"{engine['engine_step_cpu_seconds_sum']:.2f} s CPU of its {best_http[0]:.2f} s, the engine loop "
          f"{engine['engine_loop_seconds_sum']:.2f} s outside them; the client sent its requests over "
          f"{best_http[8]:.2f} s and read the first token {best_http[9]:.2f} s after it started")
    means = best_http[10]
    print("to the first token, server means in ms: " + ", ".join(f"{name} {1000 * value:.1f}" for name, value in
                                                                  means.items()) +
          f"; the client's own time to first token: mean {1000 * statistics.mean(best_http[3]):.1f}")
    print(f"cores: this process and the engine process {sorted(os.sched_getaffinity(0))}, HTTP process "
          f"{sorted(args.http_cpus) if args.http_cpus else 'the same'}, client "
          f"{sorted(args.client_cpus) if args.client_cpus else 'the same (not pinned)'}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    ttft, itl = best_http[3], best_http[4]
    print(f"time to first token  p50 {1000 * percentile(ttft, 0.5):8.1f} ms  p99 {1000 * percentile(ttft, 0.99):8.1f} ms")
    print(f"inter-token latency  p50 {1000 * percentile(itl, 0.5):8.1f} ms  p99 {1000 * percentile(itl, 0.99):8.1f} ms"
          f"  (mean {1000 * statistics.mean(itl):.1f} ms)")
    if args.skip_structured:
        return
    plain, constrained = structured(model, tokenizer, texts, args.max_tokens)
    print(f"LLM.generate, JSON schema {constrained:8.1f} tokens/s vs unconstrained {plain:8.1f} tokens/s "
          f"(ratio {constrained / plain:.3f}; cost {100 * (1 - constrained / plain):.1f}%)")


if __name__ == "__main__":
    main()
