"""Size arithmetic shared by the tensor-parallel layers and the models built on them."""


def divide(value: int, tp_size: int, name: str) -> int:
    """``value // tp_size``; ValueError naming both numbers when it does not divide.

    Models use it for anything split across TP ranks (e.g. attention heads).
    """
    if value % tp_size:
        raise ValueError(f"{name}={value} is not divisible by the tensor-parallel size {tp_size}")
    return value // tp_size
