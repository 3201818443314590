"""The server's engine loop and the events it hands the HTTP handlers: one batch (one thread hop, or one pipe
write from the engine process) per engine step, not one per request, and a handler takes every event waiting
for it at once (its chunks then go out in one write)."""

import asyncio
import time

from megalite.inference import LLM, EngineConfig, SamplingParams
from megalite.inference.engine_client import EngineClient, EngineThread
from megalite.inference.engine_loop import EngineLoop
from tests.inference.server_harness import BYTES, byte_model


def _event(rid, tokens, text, done=False):
    choice = {"index": 0, "token_ids": tokens, "text": text, "finish_reason": "length" if done else None,
              "logprobs": None, "top_logprobs": None}
    return {"request_id": rid, "choices": [choice], "done": done}


class _Loop:
    """Records what the engine side hands over (an asyncio loop's ``call_soon_threadsafe``)."""

    def __init__(self):
        self.calls = []

    def call_soon_threadsafe(self, callback, *args):
        self.calls.append((callback, args))


class _Queue(list):
    put_nowait = list.append


def test_one_thread_hop_per_engine_step():
    """Every request's event of one step reaches the asyncio loop in one call (it used to be one per request,
    each waking the loop through its pipe)."""
    llm = LLM.from_model(byte_model(), tokenizer=BYTES, engine_config=EngineConfig(block_size=4, num_blocks=64))
    client, aio, queues = EngineThread(llm.engine), _Loop(), [_Queue() for _ in range(4)]
    client._aio = aio  # what submit records: the handlers' asyncio loop
    for i, events in enumerate(queues):
        client.routes[f"r{i}"] = events
        client.core.handle(("add", f"r{i}", [65 + i, 66], SamplingParams(max_tokens=3, temperature=0),
                            time.perf_counter()))
    steps = 0
    while llm.engine.has_unfinished():
        client.core.publish(llm.engine.step())
        client.core._flush()
        steps += 1
    assert len(aio.calls) == steps == 3
    for callback, args in aio.calls:
        callback(*args)
    for events in queues:
        assert [len(e["choices"][0]["token_ids"]) for e in events] == [1, 1, 1] and events[-1]["done"]
    stats = client.metrics.engine
    assert client.pending == 0 and stats["megalite_requests_finished_total"] == 4
    assert stats["megalite_engine_steps_total"] == 3 and stats["megalite_generation_tokens_total"] == 12


def test_the_way_to_the_first_token_is_timed():
    """/metrics splits a request's way to its first token: submitted (the HTTP request's arrival to the
    client's submit), admitted by the engine loop (submit to the loop taking it), queued (to the start of the
    step that made its first token), and each batch's delivery (sent by the engine to routed by the client);
    and the loop's own time between steps.  Each is a sum and a count, cheap enough to keep."""
    llm = LLM.from_model(byte_model(), tokenizer=BYTES, engine_config=EngineConfig(block_size=4, num_blocks=64))
    client, routed = EngineClient(llm.engine.checker, lambda message: None), _Queue()
    late = time.perf_counter() - 0.25  # submitted a quarter second before the loop reads them
    inbox = [("add", f"r{i}", [65 + i, 66], SamplingParams(max_tokens=3, temperature=0), late) for i in range(2)]
    batches = []

    def receive(timeout):
        if inbox:
            return inbox.pop(0)
        return None if llm.engine.has_unfinished() else ("stop",)

    core = EngineLoop(llm.engine, receive, batches.append)
    assert core.run() is None
    stats = batches[-1]["stats"]
    assert stats["megalite_request_admission_seconds_count"] == 2
    assert stats["megalite_request_admission_seconds_sum"] >= 0.5
    assert stats["megalite_request_queue_seconds_count"] == 2
    assert 0 <= stats["megalite_request_queue_seconds_sum"] <= stats["megalite_time_to_first_token_seconds_sum"]
    assert stats["megalite_engine_loop_seconds_sum"] > 0
    assert all(0 < batch["sent"] <= time.perf_counter() for batch in batches)

    client.routes = {"r0": routed, "r1": routed}
    for batch in batches:
        client.deliver(batch)
    assert len(routed) == 6 and client.pending == 0
    text = client.metrics.render(client.pending)
    values = {name: float(value) for name, value in (line.split() for line in text.splitlines())}
    assert values["megalite_batch_delivery_seconds_count"] == 3  # the batches with events, not the first stats
    assert values["megalite_batch_delivery_seconds_sum"] > 0
    assert values["megalite_request_admission_seconds_count"] == 2  # the engine's, passed on

    async def submit():
        client.submit("r2", [65], SamplingParams(max_tokens=1), _Queue(), arrived=time.perf_counter() - 0.125)

    asyncio.run(submit())
    assert client.metrics.latencies["request_submit"][1] == 1
    assert client.metrics.latencies["request_submit"][0] >= 0.125


def test_a_failed_engine_fails_every_waiting_request():
    """The engine's last batch names its failure: each waiting request gets it as a 500 and the client is dead."""
    client, queues = EngineClient(None, lambda message: None), [_Queue() for _ in range(2)]
    client.routes = {"a": queues[0], "b": queues[1]}
    client.deliver({"events": [], "stats": {}, "failed": "boom"})
    assert [q[0]["status"] for q in queues] == [500, 500] and "boom" in queues[0][0]["error"]
    assert not client.alive and client.pending == 0


class _Request:
    class transport:
        @staticmethod
        def is_closing():
            return False


def test_exchange_takes_every_waiting_event_at_once():
    from megalite.inference.exchange import Exchange

    async def run():
        exchange = Exchange(EngineClient(None, lambda message: None), _Request(), 60.0, "cmpl-1")
        exchange.open = {"cmpl-1-0"}
        waiting = asyncio.ensure_future(exchange.take())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing to take yet: it waits
        exchange.put_nowait(_event("cmpl-1-0", [0], "0"))
        assert [e["choices"][0]["text"] for e in await waiting] == ["0"]  # woken by the event
        for i in (1, 2):
            exchange.put_nowait(_event("cmpl-1-0", [i], str(i), done=i == 2))
        assert [e["choices"][0]["text"] for e in await exchange.take()] == ["1", "2"]  # both, in one take
        assert exchange.completion_tokens == 3 and not exchange.open
        exchange.close()
        assert not exchange.live

    asyncio.run(run())
