"""Megatron-LM's ``--pipeline-model-parallel-layout`` string, and its splits that count the embedding or the loss
as a layer, as megalite's per-stage layer counts.

The string lists the pipeline stages in stage order (``|`` between stages; stage ``c * pp + r`` is model
chunk ``c`` of pipeline rank ``r``, :class:`~megalite.pipeline.stages.StageMap`), each a run of letters:
``E`` the embedding, ``t`` a decoder layer, ``m`` a multi-token-prediction depth, ``L`` the loss.
Commas are cosmetic; ``x*n`` and ``(...)*n`` repeat.  E.g. ``Ettt|(tt|)*2,tL`` at pp=4 is stages of
3, 2, 2 and 1 decoder layers.  megalite builds what the string describes when its layers are where
megalite's model puts them -- the embedding first, the loss last, MTP depths on the last stage after its
decoder layers (:class:`~megalite.models.gpt.GPTModel` computes them with the loss) -- and names the
first thing that is not.  ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``
(:func:`accounted_layout`) split the layers plus the embedding and the loss evenly over the stages instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LETTERS = "EtmL"


def unroll(layout: str) -> list[str]:
    """The stages of a layout string, each the string of its layer letters: commas dropped, ``(...)*n`` then
    ``x*n`` repeated, split at ``|`` (Megatron-Core's reading of the string)."""
    layout = layout.replace(",", "")
    layout = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout)
    return re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), layout).split("|")


@dataclass(frozen=True)
class LayerLayout:
    """A layout megalite builds: ``vpp`` model chunks per pipeline rank (None: one) and each stage's decoder
    layer count, in stage order (:func:`megalite.pipeline.split_layers`' ``stage_layers``)."""

    vpp: int | None
    stage_layers: tuple[int, ...]


def parse_layout(layout: str, pp: int, num_layers: int, mtp_num_layers: int | None = None) -> LayerLayout:
    """The :class:`LayerLayout` of ``layout`` at pipeline size ``pp`` for a model of ``num_layers`` decoder
    layers and ``mtp_num_layers`` MTP depths; ValueError naming what does not fit (an unknown letter, stages
    that do not divide over ``pp``, the embedding or loss not once at the ends, other layer counts, MTP depths
    off the last stage or before its decoder layers)."""
    if not isinstance(layout, str) or not layout:
        raise ValueError(f"the pipeline layout must be a non-empty string, got {layout!r}")
    stages = unroll(layout)
    where = f"pipeline layout {layout!r}"
    odd = sorted(set("".join(stages)) - set(_LETTERS))
    if odd:
        raise ValueError(f"{where} has unknown layer letter(s) {''.join(odd)!r}; known: E embedding, t decoder "
                         "layer, m MTP layer, L loss")
    if len(stages) % pp:
        raise ValueError(f"{where} has {len(stages)} stages, not a multiple of the pipeline size pp={pp}")
    flat = "".join(stages)
    if not (flat.startswith("E") and flat.endswith("L") and flat.count("E") == flat.count("L") == 1):
        raise ValueError(f"{where} must start with the embedding E and end with the loss L, each once")
    if flat.count("t") != num_layers:
        raise ValueError(f"{where} has {flat.count('t')} decoder layers t, not num_layers={num_layers}")
    if flat.count("m") != (mtp_num_layers or 0):
        raise ValueError(f"{where} has {flat.count('m')} MTP layers m, not mtp_num_layers={mtp_num_layers or 0}")
    if "m" in flat and not re.fullmatch(r"E?t*m+L", stages[-1]):
        raise ValueError(f"{where} does not end with its MTP layers m and the loss: megalite computes them "
                         f"together on the last stage, after its decoder layers (last stage {stages[-1]!r})")
    vpp = len(stages) // pp
    return LayerLayout(vpp if vpp > 1 else None, tuple(stage.count("t") for stage in stages))


def accounted_layout(num_layers: int, pp: int, vpp: int | None, embedding: bool, loss: bool) -> LayerLayout:
    """The :class:`LayerLayout` of a split that counts the embedding and/or the loss as a layer, as Megatron-Core's
    ``get_num_layers_to_build`` builds it: the layers plus those counted split evenly over the ``pp x vpp``
    stages, the first stage one layer fewer for the embedding, the last one fewer for the loss; ValueError when
    they do not split so."""
    stages = pp * (vpp or 1)
    total = num_layers + embedding + loss
    if total % stages or total // stages < max(embedding, loss):
        counted = " + ".join(["embedding"] * embedding + ["loss"] * loss)
        raise ValueError(f"num_layers={num_layers} + {counted} = {total} layers do not split evenly over "
                         f"pp={pp} x vpp={vpp or 1} stages, each holding at least the layer counted")
    counts = [total // stages] * stages
    counts[0] -= embedding
    counts[-1] -= loss
    return LayerLayout(vpp, tuple(counts))


def split_flags_layout(num_layers: int, pp: int, vpp: int | None = None, layout: str | None = None,
                       mtp_num_layers: int | None = None, embedding: bool = False,
                       loss: bool = False) -> LayerLayout | None:
    """The :class:`LayerLayout` that Megatron-LM's pipeline-split flags give a run: ``--pipeline-model-parallel-layout``
    (``layout``) when set (:func:`parse_layout`), else at ``pp`` > 1 the split counting the embedding and/or the
    loss as a layer (:func:`accounted_layout`, ``vpp`` model chunks per rank); None when neither applies and
    :func:`megalite.pipeline.split_layers` splits evenly or by ``--decoder-first/last-pipeline-num-layers``.
    One rule for a run's flags (:func:`megalite.training.arguments.stage_layers`) and a checkpoint's saved args
    (:mod:`megalite.checkpoint.megatron_buffers`); ValueError as theirs."""
    if layout is not None:
        return parse_layout(layout, pp, num_layers, mtp_num_layers)
    if pp == 1 or not (embedding or loss):
        return None
    return accounted_layout(num_layers, pp, vpp, embedding, loss)
