"""The server's engine loop and the events it hands the HTTP handlers: one batch (one thread hop, or one pipe
write from the engine process) per engine step, not one per request, and a handler takes every event waiting
for it at once (its chunks then go out in one write)."""

import asyncio


from megalite.inference import LLM, EngineConfig, SamplingParams
from megalite.inference.engine_client import EngineClient, EngineThread
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
        client.core.handle(("add", f"r{i}", [65 + i, 66], SamplingParams(max_tokens=3, temperature=0)))
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
