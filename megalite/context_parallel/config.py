"""Options of context parallelism and of packed-sequence batches (the flags map onto these)."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.context_parallel.sequence_split import check_comm_type


@dataclass
class ContextParallelConfig:
    """How attention communicates over the CP group: ``p2p`` (ring), ``all_gather`` or ``a2a`` (Ulysses)."""

    comm_type: str = "p2p"

    def __post_init__(self):
        check_comm_type(self.comm_type)


@dataclass
class PackedSequenceConfig:
    """Megatron's packed-sample options; documents end with ``eod_token_id``.

    ``reset_position_ids``: positions restart after each eod.
    ``reset_attention_mask``: no attention across documents.
    ``eod_mask_loss``: no loss where the input token is eod.
    """

    eod_token_id: int | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @property
    def enabled(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss
