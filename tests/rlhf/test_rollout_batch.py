"""The typed ``Rollout`` batch: shapes checked, prompt/response views, one turn span per row from the response
mask, rows and concatenation keep every per-row field aligned, and the wire tensors rebuild the same batch."""

import pytest
import torch

from megalite.rlhf.rollout_batch import Rollout


def _rollout(lengths=(2, 0, 3), prompt=3, new=3, offset=0):
    b, width = len(lengths), prompt + new
    ids = torch.arange(b * width).reshape(b, width) + offset
    response_mask = torch.zeros(b, width - 1)
    for i, n in enumerate(lengths):
        response_mask[i, prompt - 1:prompt - 1 + n] = 1
    attention = torch.cat([torch.ones(b, prompt, dtype=torch.long), response_mask[:, prompt - 1:].long()], dim=1)
    return Rollout(ids, attention, response_mask, -response_mask * 0.5, prompt,
                   prompts=[f"p{i + offset}" for i in range(b)], responses=[f"r{i + offset}" for i in range(b)],
                   rewards=torch.arange(b, dtype=torch.float32) + offset, iteration=4, version=3,
                   metadata={"kept_fraction": 1.0})


def test_views_spans_rows_concat_and_wire():
    r = _rollout()
    assert torch.equal(r.prompt_ids, r.input_ids[:, :3]) and torch.equal(r.response_ids, r.input_ids[:, 3:])
    assert r.turn_spans == [[(3, 5)], [(3, 3)], [(3, 6)]]
    part = r.rows(1, 3)
    assert len(part) == 2 and part.prompts == ["p1", "p2"] and part.turn_spans == [[(3, 3)], [(3, 6)]]
    assert torch.equal(part.rewards, torch.tensor([1.0, 2.0])) and torch.equal(part.input_ids, r.input_ids[1:])
    assert part.iteration == 4 and part.version == 3 and part.metadata == {"kept_fraction": 1.0}
    other = _rollout(lengths=(1,), offset=100)
    joined = Rollout.concat([r, other])
    assert len(joined) == 4 and joined.responses == ["r0", "r1", "r2", "r100"]
    assert torch.equal(joined.rewards, torch.tensor([0.0, 1.0, 2.0, 100.0]))
    assert joined.turn_spans[-1] == [(3, 4)] and torch.equal(joined.input_ids[3], other.input_ids[0])
    rebuilt = Rollout.from_wire(r.wire_tensors(), 3)
    for name in ("input_ids", "attention_mask", "response_mask", "behaviour_log_probs"):
        assert torch.equal(getattr(rebuilt, name), getattr(r, name))
    assert rebuilt.turn_spans == r.turn_spans and rebuilt.rewards is None


def test_bad_shapes_are_clear_errors():
    r = _rollout()
    with pytest.raises(ValueError, match=r"Rollout.response_mask must be \[3, 5\], got \[3, 6\]"):
        Rollout(r.input_ids, r.attention_mask, torch.zeros(3, 6), r.behaviour_log_probs, 3)
    with pytest.raises(ValueError, match="prompt_width 6 leaves no response columns"):
        Rollout(r.input_ids, r.attention_mask, r.response_mask, r.behaviour_log_probs, 6)


def test_micro_batches_carry_the_packing_and_row_subsets_drop_it():
    """A packed rollout's micro-batches carry their packed rows; its rows and concatenations (other rows than the
    packing's) carry none, so no forward runs a stale packing."""
    from megalite.rlhf.shared_groups import pack_rows

    r = _rollout(lengths=(2, 1, 3, 3))
    assert [sorted(mb) for mb in r.micro_batches(2)] == [["attention_mask", "input_ids"]] * 2
    r.packing = tuple(pack_rows(mb["input_ids"], mb["attention_mask"], 2) for mb in r.micro_batches(2))
    micro_batches = r.micro_batches(2)
    assert [mb["packed"] for mb in micro_batches] == list(r.packing)
    assert torch.equal(micro_batches[1]["input_ids"], r.input_ids[2:])
    with pytest.raises(ValueError, match="does not fit"):
        r.micro_batches(4)
    assert r.rows(0, 2).packing is None and Rollout.concat([r, r]).packing is None


def test_state_round_trips_through_json():
    """``Rollout.state`` (a lookahead's batches in the RL checkpoint) is JSON and rebuilds the same batch: every
    tensor with its dtype and shape, the unset ones None, the turn spans as tuples, and a rollout in the metadata
    (the guidance flow's guide rollout) as a Rollout."""
    import json

    r = _rollout()
    r.ref_log_probs = torch.randn(3, 5, dtype=torch.float64)
    r.metadata.update(turns=[1, 0, 2], guide=_rollout(offset=7))
    from megalite.rlhf.shared_groups import pack_rows
    r.packing = tuple(pack_rows(mb["input_ids"], mb["attention_mask"], 2) for mb in r.micro_batches(3))
    back = Rollout.from_state(json.loads(json.dumps(r.state())))
    assert back.packing is None  # derived from the rows: scoring packs again
    for name in ("input_ids", "attention_mask", "response_mask", "behaviour_log_probs", "rewards", "ref_log_probs"):
        saved, rebuilt = getattr(r, name), getattr(back, name)
        assert torch.equal(rebuilt, saved) and rebuilt.dtype == saved.dtype
    assert back.old_values is None and back.token_versions is None
    assert (back.turn_spans, back.prompts, back.responses, back.iteration, back.version, back.prompt_width) == \
        (r.turn_spans, r.prompts, r.responses, 4, 3, 3)
    assert back.metadata["turns"] == [1, 0, 2] and back.metadata["kept_fraction"] == 1.0
    assert torch.equal(back.metadata["guide"].input_ids, r.metadata["guide"].input_ids)
    assert back.metadata["guide"].prompts == ["p7", "p8", "p9"]
