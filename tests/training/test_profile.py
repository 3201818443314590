"""--profile: the torch profiler covers iterations [start, end) and leaves a Chrome trace in --tensorboard-dir."""

import json

from tests.training.helpers import train


def test_profile_writes_a_trace_of_the_window(tiny_data, tmp_path):
    tensorboard = tmp_path / "tb"
    train(tiny_data, tmp_path, 1, "--profile", "--profile-step-start", "2", "--profile-step-end", "3",
          "--tensorboard-dir", str(tensorboard), iters=3)
    with open(tensorboard / "profile_iter2.json") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert {"aten::mm", "aten::scaled_dot_product_attention"} & names, sorted(n for n in names if n)[:20]
