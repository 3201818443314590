"""Megatron-LM's value syntaxes for three pretraining flags, parsed for :mod:`megalite.training.flags`' table:
``--moe-layer-freq`` (an int or a list expression), ``--rope-type`` and ``--window-size`` (flash attention's
``(left, right)`` pair)."""

from __future__ import annotations

import argparse
import ast


def moe_layer_freq(text: str) -> int | list[int]:
    """``--moe-layer-freq`` in Megatron's forms: an int, or a list expression of ints built with ``+`` and ``*``."""
    error = argparse.ArgumentTypeError(f"{text!r} is not an int or a list expression such as '([0]+[1]*3)*2'")

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise error

    try:
        return value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, TypeError):
        raise error from None


def rope_type(text: str) -> str | None:
    """Megatron's ``--rope-type``: ``rope`` (no scaling, None) or ``yarn``."""
    if text not in ("rope", "yarn"):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from 'rope', 'yarn')")
    return None if text == "rope" else text


def window_size(text: str) -> int | None:
    """``--window-size`` as Megatron writes it, ``(left, right)`` (flash attention's window), or just ``left``.

    megalite's attention is causal, so ``right`` must be 0; ``left`` -1 is the full causal window (None).
    """
    parts = [p.strip() for p in text.strip().strip("()").split(",") if p.strip()]
    try:
        left, right = int(parts[0]), int(parts[1]) if len(parts) == 2 else 0
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a window: give 'left' or '(left, 0)'") from None
    if len(parts) > 2 or right != 0 or left < -1:
        raise argparse.ArgumentTypeError(f"{text!r}: the window must be (left >= 0 or -1, 0): attention is causal")
    return None if left == -1 else left
