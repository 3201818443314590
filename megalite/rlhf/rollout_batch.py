"""``Rollout``: one typed batch of sampled episodes that flows unchanged from the engine to the loss.

Generation fills the token tensors and the behaviour policy's log-probs, scoring adds the rewards, the
reference log-probs and the critic's values, and the update reads them; nothing is re-tokenised on the way
(the text in ``prompts``/``responses`` is decoded once, for reward functions and logs).  The four token tensors
have fixed shapes for a given config (:meth:`Rollout.wire_tensors`), so a rollout rank can send them and a
trainer rebuild the batch (:meth:`Rollout.from_wire`).  :meth:`Rollout.state` is the whole batch as JSON (tensors
as :func:`tensors_state`), for checkpoints of batches drawn ahead of the update.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from megalite.rlhf.shared_groups import PackedRows, with_packing

WIRE = ("input_ids", "attention_mask", "response_mask", "behaviour_log_probs")
"""The token tensors a rollout rank sends, in this order."""


@dataclass
class Rollout:
    """A batch of ``b`` episodes.

    ``input_ids``/``attention_mask`` ``[b, P + N]``: the prompt left-padded to ``prompt_width`` (P) tokens, then
    the response (padding after end-of-document).  ``response_mask``/``behaviour_log_probs`` ``[b, P + N - 1]``
    are aligned with ``input_ids[:, 1:]`` (the token each position predicts): 1 / the sampling policy's log-prob
    on generated tokens, 0 on prompt and padding.  ``turn_spans[i]`` lists row ``i``'s model-generated
    ``(start, end)`` column ranges of ``input_ids`` (one per turn).  ``rewards`` ``[b]`` (the reward function's,
    before shaping), ``ref_log_probs`` and ``old_values`` (aligned like ``response_mask``) are filled by scoring.
    ``iteration`` and ``version`` (the policy version that sampled it; the oldest one for partial rollouts) place
    the batch in the run; ``token_versions`` (partial rollouts, ``megalite.rlhf.partial_rollouts``; aligned like
    ``response_mask``, -1 off the response) the version that sampled each token; ``packing`` (set once by
    scoring, :func:`~megalite.rlhf.shared_groups.pack_micro_batches`) the rows' prefix-shared packing per
    micro-batch, which every forward of these rows runs (:meth:`micro_batches`); ``metadata`` holds the rest
    (kept group fraction, phase timings).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    behaviour_log_probs: torch.Tensor
    prompt_width: int
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    turn_spans: list[list[tuple[int, int]]] = field(default_factory=list)
    rewards: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    token_versions: torch.Tensor | None = None
    iteration: int = 0
    version: int = 0
    packing: tuple[PackedRows, ...] | None = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        b, width = self.input_ids.shape
        if self.prompt_width >= width:
            raise ValueError(f"prompt_width {self.prompt_width} leaves no response columns in input_ids of width "
                             f"{width}")
        for name in WIRE[1:]:
            expected = (b, width) if name == "attention_mask" else (b, width - 1)
            if tuple(getattr(self, name).shape) != expected:
                raise ValueError(f"Rollout.{name} must be {list(expected)}, got {list(getattr(self, name).shape)}")
        if not self.turn_spans:
            lengths = self.response_mask[:, self.prompt_width - 1:].sum(dim=1).long().tolist()
            self.turn_spans = [[(self.prompt_width, self.prompt_width + n)] for n in lengths]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_ids(self) -> torch.Tensor:
        """``[b, P]``, left-padded."""
        return self.input_ids[:, :self.prompt_width]

    @property
    def response_ids(self) -> torch.Tensor:
        """``[b, N]``, padded after end-of-document."""
        return self.input_ids[:, self.prompt_width:]

    def micro_batches(self, size: int) -> list[dict]:
        """The rows as forward micro-batches of ``size`` rows (``input_ids``, ``attention_mask``, and ``packed``
        where the rollout carries a packing of micro-batches of that size)."""
        ids, mask = self.input_ids, self.attention_mask
        return with_packing([{"input_ids": ids[i:i + size], "attention_mask": mask[i:i + size]}
                             for i in range(0, len(self), size)], self.packing)

    def wire_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in WIRE]

    @classmethod
    def from_wire(cls, tensors: list[torch.Tensor], prompt_width: int, **rest) -> "Rollout":
        return cls(**dict(zip(WIRE, tensors)), prompt_width=prompt_width, **rest)

    def state(self) -> dict:
        """The whole batch as JSON: every field but ``packing`` (derived from the rows; scoring packs again),
        tensors as :func:`tensors_state` (a Rollout in ``metadata``, the guidance flow's guide rollout, as its own
        state)."""
        def value(v):
            if isinstance(v, torch.Tensor):
                return {"tensor": tensors_state([v])[0]}
            if isinstance(v, Rollout):
                return {"rollout": v.state()}
            return {"json": v}
        return {f.name: value(getattr(self, f.name)) if f.name != "metadata" else
                {key: value(v) for key, v in self.metadata.items()} for f in fields(self) if f.name != "packing"}

    @classmethod
    def from_state(cls, state: dict, device="cpu") -> "Rollout":
        """:meth:`state`'s batch, its tensors on ``device``."""
        def value(v):
            if "tensor" in v:
                return tensors_from_state([v["tensor"]], device)[0]
            if "rollout" in v:
                return cls.from_state(v["rollout"], device)
            return v["json"]
        values = {name: value(v) for name, v in state.items() if name != "metadata"}
        values["turn_spans"] = [[tuple(span) for span in row] for row in values["turn_spans"]]
        return cls(**values, metadata={key: value(v) for key, v in state["metadata"].items()})

    def rows(self, start: int, end: int) -> "Rollout":
        """Rows ``start:end`` (every per-row field sliced alike; no packing, which was the whole batch's)."""
        return replace(self, packing=None, **{f.name: value[start:end] for f in fields(self)
                                              if _per_row(value := getattr(self, f.name))})

    @staticmethod
    def concat(parts: list["Rollout"]) -> "Rollout":
        """The rows of ``parts`` in order, without a packing; the scalars and metadata are the first part's, but
        ``version`` is the oldest part's (partial rollouts' parts may be of different versions)."""
        def join(values):
            return torch.cat(values) if isinstance(values[0], torch.Tensor) else [x for v in values for x in v]
        first = parts[0]
        return replace(first, version=min(p.version for p in parts), packing=None,
                       **{f.name: join([getattr(p, f.name) for p in parts]) for f in fields(first)
                          if _per_row(getattr(first, f.name))})


def tensors_state(tensors: list[torch.Tensor]) -> list:
    """``tensors`` as JSON: ``[dtype, shape, values]`` each."""
    return [[str(t.dtype).removeprefix("torch."), list(t.shape), t.flatten().tolist()] for t in tensors]


def tensors_from_state(state: list, device="cpu") -> list[torch.Tensor]:
    """:func:`tensors_state`'s tensors, on ``device``."""
    return [torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape).to(device)
            for dtype, shape, values in state]


def response_rows(prompts: list[list[int]], responses: list[list[int]], pad: int, prompt_width: int,
                  response_width: int, log_probs: list[list[float]], trained: list[list[float]] | None = None,
                  versions: list[list[int] | None] | None = None) -> tuple[torch.Tensor, ...]:
    """The token tensors of rows each a prompt left-padded with ``pad`` to ``prompt_width`` columns, then its
    response padded after to ``response_width`` more: ``input_ids`` and ``attention_mask`` ``[b, p + n]``, then,
    aligned with the next-token predictions ``[b, p + n - 1]``, the response mask (``trained[i]`` per response
    token, default 1 each), the log-probs ``log_probs[i]`` and each token's policy version (``versions[i]``; -1
    off the response and for a row whose versions are None)."""
    b, p, n = len(prompts), prompt_width, response_width
    input_ids = torch.full((b, p + n), pad, dtype=torch.long)
    attention = torch.zeros(b, p + n, dtype=torch.long)
    response_mask = torch.zeros(b, p + n - 1)
    token_log_probs = torch.zeros(b, p + n - 1)
    token_versions = torch.full((b, p + n - 1), -1, dtype=torch.long)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        start, end = p - len(prompt), p + len(response)
        input_ids[i, start:end] = torch.tensor(prompt + response)
        attention[i, start:end] = 1
        response_mask[i, p - 1:end - 1] = 1 if trained is None else torch.tensor(trained[i])
        token_log_probs[i, p - 1:end - 1] = torch.tensor(log_probs[i])
        if versions is not None and versions[i] is not None:
            token_versions[i, p - 1:end - 1] = torch.tensor(versions[i], dtype=torch.long)
    return input_ids, attention, response_mask, token_log_probs, token_versions


def left_pad(rows: list[list[int]], pad: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows left-padded with ``pad`` to ``width`` columns, and their attention mask."""
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _per_row(value) -> bool:
    return isinstance(value, (torch.Tensor, list))
