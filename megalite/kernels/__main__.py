"""Print which kernels run fused on this machine: ``python -m megalite.kernels``."""

import torch

from . import available_ops, fused, fused_enabled


def main() -> None:
    print(f"extension built: {fused.BUILT} (CUDA kernels: {fused.WITH_CUDA}, "
          f"GPU present: {torch.cuda.is_available()}); fused calls enabled: {fused_enabled()}")
    for name, ok in available_ops().items():
        print(f"  {name:36s} {'fused' if ok else 'torch fallback'}")


main()
