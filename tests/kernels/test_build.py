"""The build description and the CUDA sources, which must compile with nvcc alone (no torch headers)."""

import glob
import importlib.util
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA_SOURCES = sorted(glob.glob(os.path.join(REPO, "csrc", "cuda", "*.cu")))


def _load_build():
    spec = importlib.util.spec_from_file_location("megalite_csrc_build", os.path.join(REPO, "csrc", "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cuda_sources_exist():
    names = {os.path.basename(p) for p in CUDA_SOURCES}
    assert {"norm.cu", "softmax.cu", "pointwise.cu", "permute.cu"} <= names


def test_cuda_kernel_sources_are_free_of_torch():
    for path in CUDA_SOURCES + glob.glob(os.path.join(REPO, "csrc", "cuda", "*.h")) + glob.glob(
            os.path.join(REPO, "csrc", "cuda", "*.cuh")):
        with open(path) as f:
            text = f.read()
        for header in ("<torch/", "<ATen/", "<c10/"):
            assert f"#include {header}" not in text, f"{path} includes {header}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_cuda_sources_compile_with_nvcc(tmp_path):
    """Every .cu compiles with `nvcc -c` (run side by side to keep the test short).  To unoptimized PTX only
    (`-Xcicc -O0`): the C++ and device-code front end and the device code generator are what a CPU machine can
    check; NVVM's optimizer (over half of the CPU time here) and machine code (ptxas) are made and run by the GPU
    builds (tools/gpu_check.sh)."""
    jobs = {os.path.basename(src): subprocess.Popen(
        ["nvcc", "-c", "-std=c++17", "-O1", "-arch=compute_75", "-code=compute_75", "-Xcicc", "-O0", src,
         "-o", str(tmp_path / (os.path.basename(src) + ".o"))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for src in CUDA_SOURCES}
    failures = {}
    for name, job in jobs.items():
        output, _ = job.communicate(timeout=600)
        if job.returncode != 0 or not (tmp_path / (name + ".o")).stat().st_size:
            failures[name] = output
    assert not failures, failures


def test_extension_kwargs_describe_the_extension():
    import torch

    kwargs = _load_build().extension_kwargs(REPO)
    (extension,) = kwargs["ext_modules"]
    assert extension.name == "megalite._C"
    assert "csrc/megalite.cpp" in extension.sources and "csrc/cpu/ops.cpp" in extension.sources
    has_cu = any(s.endswith(".cu") for s in extension.sources)
    assert has_cu == (torch.version.cuda is not None and shutil.which("nvcc") is not None)
    assert "build_ext" in kwargs["cmdclass"]


def test_missing_compiler_only_warns(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-megalite")
    with pytest.warns(UserWarning, match=r"no C\+\+ compiler \(no-such-compiler-megalite\) found"):
        assert _load_build().extension_kwargs(REPO) == {}


def test_failed_build_only_warns(monkeypatch):
    """A compile error inside build_ext becomes a warning, so `pip install` still succeeds on the fallbacks."""
    from setuptools import Distribution
    from torch.utils import cpp_extension

    kwargs = _load_build().extension_kwargs(REPO)
    command = kwargs["cmdclass"]["build_ext"](Distribution({"ext_modules": kwargs["ext_modules"]}))

    def broken(self):
        raise RuntimeError("simulated compiler error")

    monkeypatch.setattr(cpp_extension.BuildExtension, "run", broken)
    with pytest.warns(UserWarning, match=r"building the fused-kernel extension failed \(simulated compiler error\)"):
        command.run()


def test_library_whose_errors_crash_is_removed_with_a_warning(monkeypatch, tmp_path):
    """The post-build probe: a real build's failed check raises in Python; a library that cannot raise (here not
    a library at all) is removed and the build warns instead of leaving a crashing extension behind."""
    from setuptools import Distribution
    from torch.utils import cpp_extension

    import megalite.kernels.fused as fused

    build = _load_build()
    if fused.BUILT:
        assert build.errors_reach_python(fused._C.__file__)
    kwargs = build.extension_kwargs(REPO)
    command = kwargs["cmdclass"]["build_ext"](Distribution({"ext_modules": kwargs["ext_modules"]}))
    command.ensure_finalized()
    library = tmp_path / "_C.so"
    monkeypatch.setattr(type(command), "get_ext_fullpath", lambda self, name: str(library))
    monkeypatch.setattr(cpp_extension.BuildExtension, "run", lambda self: library.write_text("not a library"))
    with pytest.warns(UserWarning, match=r"crashes when one of its input checks fails .* removed"):
        command.run()
    assert not library.exists()
