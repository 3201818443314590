"""TrainingService for a user's own nn.Module (issue 38): a plain torch model trains through 2 workers under
FSDP2 and under DDP exactly as it trains in one process (losses and final weights), saves its model and torch
optimizer state and, loaded, continues with the uninterrupted run's losses and weights, and a model factory that
raises on one worker is one clear error at the caller, from every worker at once (no timeout)."""

import asyncio
import functools

import pytest
import torch
import torch.nn.functional as F

from megalite.rlhf import ParallelLayout, TrainingService
from tests.rlhf.user_models import VOCAB, fails_on_worker_1, tiny_lm

OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0)
MOMENTUM = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)  # state beyond Adam's: momentum_buffer
SEED, STEPS = 1234, 3


def batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (8, 6), generator=g)
    loss_mask = (torch.rand(8, 5, generator=g) > 0.3).float()  # uneven tokens per row: the global token mean
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


def one_process(factory) -> tuple[list[float], dict]:
    """The same model, seed, batches and optimizer in this process: the losses and the final weights."""
    torch.manual_seed(SEED)
    model = tiny_lm()
    optimizer = factory(model.parameters())
    losses = []
    for step in range(STEPS):
        b = batch(step)
        logits = model(b["input_ids"])[:, :-1]
        per_token = F.cross_entropy(logits.reshape(-1, VOCAB), b["input_ids"][:, 1:].reshape(-1), reduction="none")
        loss = (per_token * b["loss_mask"].reshape(-1)).sum() / b["loss_mask"].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.state_dict().items()}


async def _train(strategy: str, factory, path) -> tuple[list[float], dict, list[float]]:
    service = await TrainingService.options(procs=2).as_service(
        model=tiny_lm, optimizer=factory, loss_fn="language_model", strategy=strategy,
        parallel=ParallelLayout(dp=2, micro_batch_size=2), checkpoint_dir=str(path), seed=SEED)
    try:
        calls = []
        for step in range(STEPS):  # pipelined: every call queued before the first is awaited
            calls += [service.forward_backward(batch(step)), service.optim_step()]
            if step == 0:
                saved = service.save(1)  # model and the torch optimizer's state after one step
        results = await asyncio.gather(*calls)
        weights = await service.get_weights()
        torch.manual_seed(SEED)
        initial = tiny_lm().state_dict()
        await service.load_weights(initial)  # weights move both ways in the global layout
        for name, value in (await service.get_weights()).items():
            torch.testing.assert_close(value, initial[name], rtol=0, atol=0)
        await service.load(await saved)  # resumed after step 0: steps 1 and 2 again, as uninterrupted
        replayed = []
        for step in range(1, STEPS):
            replayed.append((await service.forward_backward(batch(step)))["lm_loss"])
            await service.optim_step()
        assert replayed == [m["lm_loss"] for m in results[2::2]]  # step 2's loss depends on the optimizer state
        for name, value in (await service.get_weights()).items():
            torch.testing.assert_close(value, weights[name], rtol=0, atol=0)
    finally:
        await service.shutdown()
    return [m["lm_loss"] for m in results[::2]], weights, [m["grad_norm"] for m in results[1::2]]


@pytest.mark.parametrize("strategy, factory", [("fsdp2", OPTIMIZER),
                                               pytest.param("ddp", MOMENTUM, marks=pytest.mark.slow)])
def test_a_plain_torch_module_trains_through_the_service_as_in_one_process(tmp_path, strategy, factory):
    losses, weights, grad_norms = asyncio.run(_train(strategy, factory, tmp_path))
    expected_losses, expected_weights = one_process(factory)
    assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-6)
    assert expected_losses[-1] < expected_losses[0]
    assert all(norm > 0 for norm in grad_norms)
    assert sorted(weights) == sorted(expected_weights)
    for name, value in expected_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-5)


def test_a_model_factory_that_raises_on_a_worker_is_one_clear_error(tmp_path):
    async def start():
        await TrainingService.options(procs=2, timeout=30.0).as_service(
            model=fails_on_worker_1, optimizer=OPTIMIZER,
            loss_fn="language_model", strategy="fsdp2", parallel=ParallelLayout(dp=2), checkpoint_dir=str(tmp_path))

    with pytest.raises(RuntimeError) as raised:
        asyncio.run(start())
    message = str(raised.value)
    assert "worker 1: RuntimeError: the model factory raised FileNotFoundError: weights.pt is not on this machine" \
        in message
    # Worker 0 learnt of it from worker 1 at once: not a timeout, nor the peer-failure grace that stops a service.
    assert "worker 0: RuntimeError: the model factory failed on worker 1" in message
    assert "did not" not in message


def test_bad_model_and_optimizer_arguments_fail_in_the_driver(tmp_path):
    options = TrainingService.options(procs=2)
    cases = [(dict(model=tiny_lm, strategy="megalite"), "model must be a GPTConfig"),
             (dict(model=lambda: tiny_lm()), "cannot be sent to the workers"),
             (dict(model=tiny_lm, strategy="zero3"), "strategy must be one of"),
             (dict(model=tiny_lm, parallel=ParallelLayout(tp=2)), "data parallelism only"),
             (dict(model=tiny_lm, optimizer=0.1), "optimizer must be an OptimizerConfig or a factory")]
    for overrides, error in cases:
        arguments = {**dict(model=tiny_lm, optimizer=OPTIMIZER, loss_fn="language_model", strategy="fsdp2",
                            parallel=ParallelLayout(dp=2), checkpoint_dir=str(tmp_path)), **overrides}
        with pytest.raises(ValueError, match=error):
            asyncio.run(options.as_service(**arguments))


def _swap_optimizers(directory: str) -> list[str]:
    """One rank: a checkpoint of megalite's optimizer loaded with a torch optimizer, and the other way round."""
    from megalite import topology
    from megalite.checkpoint import load_sharded, save_sharded
    from megalite.optim import OptimizerConfig, get_optimizer
    from megalite.rlhf.service_module import WRAPPERS, TorchOptimizer

    topo = topology.initialize(tp=1, pp=1)
    chunk = WRAPPERS["ddp"](tiny_lm(), topo)
    optimizers = {"megalite": get_optimizer(OptimizerConfig(lr=1e-2), [chunk]),
                  "torch": TorchOptimizer(OPTIMIZER, chunk)}
    errors = []
    for saved, loaded in (("megalite", "torch"), ("torch", "megalite")):
        path = save_sharded(f"{directory}/{saved}", 1, [chunk], optimizers[saved])
        try:
            load_sharded(path, [chunk], optimizers[loaded])
        except ValueError as error:
            errors.append(str(error))
    return errors


@pytest.mark.slow
def test_a_checkpoint_of_another_kind_of_optimizer_is_a_clear_error(tmp_path):
    from megalite.testing import run_distributed

    [errors] = run_distributed(_swap_optimizers, 1, str(tmp_path), timeout=60)
    assert len(errors) == 2
    assert "the checkpoint holds the state of megalite's optimizer, this run has torch.optim.AdamW" in errors[0]
    assert "the checkpoint holds the state of torch.optim.AdamW, this run has megalite's optimizer" in errors[1]
