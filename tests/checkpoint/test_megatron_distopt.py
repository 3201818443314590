"""megalite's rebuild of Megatron-Core's gradient-buffer layout under the distributed optimizer equals
Megatron-Core's own ``_ParamAndGradBuffer``: each parameter's bucket and start, each bucket's unpadded size."""

import types

import pytest
import torch

pytest.importorskip("megatron.core.distributed.param_and_grad_buffer")


@pytest.mark.parametrize("dp, bucket_size, high_bandwidth", [(2, None, False), (3, 2000, False), (3, 2000, True),
                                                             (4, 4096, False)])
def test_bucket_layout_equals_megatron_cores_buffer(monkeypatch, dp, bucket_size, high_bandwidth):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer as buffer

    from megalite.checkpoint.megatron_distopt import bucket_layout

    # The buffer is built on the CPU, and its closing log line (which needs a process group) is left out.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(buffer, "log_on_each_pipeline_stage", lambda *args, **kwargs: None)
    group = types.SimpleNamespace(size=lambda: dp, rank=lambda: 0)
    numels = [96 * 32, 32, 1000, 7, 4096, 130, 64, 5000, 1]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    config = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                           pad_buckets_for_high_nccl_busbw=high_bandwidth)
    theirs = buffer._ParamAndGradBuffer(config, torch.float32, torch.float32, params, group, bucket_size,
                                        {p: str(i) for i, p in enumerate(params)}, 1.0, list(range(len(params))),
                                        False, types.SimpleNamespace(tp=group, dp_cp=group))
    places, unpadded = bucket_layout(numels, dp, bucket_size, high_bandwidth)
    assert unpadded == [b.numel_unpadded for b in theirs.buckets]
    assert len(unpadded) == (1 if bucket_size is None else 3)
    for param, (bucket, start) in zip(params, places):
        begin, _, their_bucket = theirs.param_index_map[param]
        assert (bucket, start) == (their_bucket, begin - theirs.buckets[their_bucket].offset)
