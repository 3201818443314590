"""Package set-up for megalite.

Keeps a torch that is already installed (torch 2.11 or newer: tested with 2.11
on CUDA and 2.13 on CPU); on a machine without torch it pins torch==2.13.0 so
pip takes the CPU wheel instead of multi-GB CUDA wheels.  An older torch is
refused with one clear error rather than upgraded behind the user's back.
The optional csrc extension is described in csrc/build.py.
"""

import os
import subprocess
import sys

from setuptools import find_packages, setup

OPTIONAL = {
    "hf": ["transformers>=4.31", "tokenizers>=0.13"],  # LlamaConfig's num_key_value_heads (GQA) came in 4.31
    "plot": ["matplotlib>=3.5"],
    "serve": ["aiohttp>=3.8", "jinja2>=3.1.6"],  # jinja2 renders chat templates; 3.1.6 closed sandbox escapes
    "grammar": ["llguidance>=1.0"],  # structured output (megalite/inference/grammar.py says why llguidance)
    "ray": ["ray>=2.0"],
    "wandb": ["wandb"],  # --wandb-project
    "verify": ["math-verify"],  # math answers' rewards (megalite/rlhf/verifiers.py)
}
"""Optional extras, with lower bounds (not pins) where megalite needs an API."""
TEST = ["pytest>=8", "pytest-xdist>=3", "megatron-core", "openai>=1.0", "requests"]
TEST += ["trl>=1.16", "jsonschema"]  # peers: chat templates and response parsers, schema validation
TEST += ["lm-eval[api]"]  # its local-completions and local-chat-completions clients drive the server (< 60 s)
"""The test extra: pytest, xdist for tools/test.sh's ``-n 2`` and tools/gpu_check.sh's ``-n 12``, Megatron-Core
(the peer the LR schedule is tested against), the official ``openai`` client and ``requests`` (the server's tests
drive it with them), TRL (its chat templates and response schemas are the chat tests' references), jsonschema
(structured output and tool calls are checked with it), lm-evaluation-harness with its API clients, Triton (on
Linux: its interpreter runs the CUDA dropout reference on CPU), and every optional extra."""
TORCH_PIN = "torch==2.13.0"
TORCH_MIN = (2, 11)
TEST += ["peft"]  # peer: LoRA adapters in PEFT's format (tests/lora/test_peft.py)
# Triton's interpreter draws the CUDA dropout reference's mask on CPU (tests/kernels/test_philox.py); unpinned, so
# pip keeps the Triton a CUDA torch wheel brought.
TEST += ["triton; platform_system == 'Linux'"]


def torch_requirement() -> str:
    """'torch>=2.11' when the target environment already has a supported torch, else the pin.

    pip may run this file in an isolated build environment that hides the
    user's site-packages, so the check runs in a clean child interpreter.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    probe = "import importlib.metadata as m; print(m.version('torch'))"
    try:
        found = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return TORCH_PIN
    version = found.stdout.strip() if found.returncode == 0 else ""
    if not version:
        return TORCH_PIN
    if tuple(int(part) for part in version.split("+")[0].split(".")[:2]) < TORCH_MIN:
        sys.exit(f"megalite needs torch >= {'.'.join(map(str, TORCH_MIN))}; this environment has torch {version}")
    return "torch>=" + ".".join(map(str, TORCH_MIN))


def extension_kwargs() -> dict:
    """ext_modules and cmdclass for the optional fused-kernel extension."""
    here = os.path.dirname(os.path.abspath(__file__))
    build = os.path.join(here, "csrc", "build.py")
    if os.environ.get("MEGALITE_NO_EXT") == "1" or not os.path.exists(build):
        return {}
    sys.path.insert(0, os.path.join(here, "csrc"))
    try:
        import build as csrc_build
    finally:
        sys.path.pop(0)
    return csrc_build.extension_kwargs(here)


setup(
    name="megalite",
    version="0.1.0",
    description="Megatron-style model-parallel training for PyTorch that runs on CPU (gloo) and GPU (NCCL)",
    long_description=open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megalite", "megalite.*"]),
    package_data={"megalite.hardware": ["*.json"], "megalite.plan": ["presets.json"]},
    install_requires=[torch_requirement(), "numpy", "sentencepiece", "tensorboard", "safetensors", "tqdm"],
    extras_require={**OPTIONAL, "test": TEST + [req for reqs in OPTIONAL.values() for req in reqs]},
    **extension_kwargs(),
)
