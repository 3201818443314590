"""Build description of the optional megalite._C extension (used by setup.py).

The CPU kernels build wherever a C++ compiler and torch are present; the CUDA
kernels are added when torch has CUDA and nvcc is found.  Any failure (no
torch in the build environment, no compiler, a compile error) only warns:
megalite then runs on its plain-torch fallbacks.  MEGALITE_NO_EXT=1 (read by
setup.py) skips the extension entirely; MEGALITE_NATIVE=0 builds without
-march=native (use it when the .so must run on other CPUs than the build
machine's).

A built extension is kept only if an error raised by one of its checks
reaches Python as an exception: a compiler whose C++ runtime differs from the
one torch was built with can make every such error crash the process instead
(seen on a machine whose CXX named another GCC than torch's).  Then the build
warns, names the cause and removes the library.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

EXT_NAME = "megalite._C"


def _warn(message: str) -> None:
    warnings.warn(f"megalite: {message}; megalite will use its plain-torch kernels", stacklevel=2)


def _native_flag_works(compiler: str) -> bool:
    """True when the C++ compiler accepts -march=native."""
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "probe.cpp")
        with open(source, "w") as f:
            f.write("int main() { return 0; }\n")
        try:
            done = subprocess.run([compiler, "-march=native", "-c", source, "-o", os.path.join(tmp, "probe.o")],
                                  capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
    return done.returncode == 0


def _cxx_flags(compiler: str) -> list[str]:
    # -fno-trapping-math lets GCC turn the clamps and selects of the elementwise loops into vector blends
    # (with trapping math it keeps them as branches and the loops stay scalar); nothing reads FP exceptions.
    flags = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd"]
    if os.environ.get("MEGALITE_NATIVE", "1") != "0" and _native_flag_works(compiler):
        flags.append("-march=native")
    return flags


def _cuda_available(cpp_extension) -> bool:
    import torch

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None and (
        shutil.which("nvcc") is not None or os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")))


_RAISE_PROBE = """
import sys, torch
torch.ops.load_library(sys.argv[1])
q, kv = torch.zeros(1, 1, 4), torch.zeros(1, 1, 1, 4)
one, zero = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
try:
    torch.ops.megalite.paged_attention(q, kv, kv, one.view(1, 1), zero, one, zero, 1.0)  # block 1 of 1: bad
except RuntimeError:
    print("raised")
"""


def _torch_compiler() -> str:
    """The compiler torch reports it was built with (e.g. 'GCC 13.3')."""
    import torch

    for line in torch.__config__.show().splitlines():
        if line.strip().startswith("- GCC") or line.strip().startswith("- clang"):
            return line.strip()[2:]
    return "an unknown compiler"


def errors_reach_python(library: str) -> bool:
    """True when a failed check inside the built ``library`` raises in Python rather than killing the process
    (probed in a child interpreter, since a crash would take this one down)."""
    try:
        done = subprocess.run([sys.executable, "-c", _RAISE_PROBE, library], capture_output=True, text=True,
                              timeout=300)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and done.stdout.strip() == "raised"


def _rel(repo_root: str, paths) -> list[str]:
    return sorted(os.path.relpath(p, repo_root) for p in paths)


def extension_kwargs(repo_root: str) -> dict:
    """setup() keyword arguments (ext_modules, cmdclass) for the extension, or {} when it cannot build."""
    try:
        import torch  # noqa: F401
        from torch.utils import cpp_extension
    except ImportError:
        _warn("torch is not importable in the build environment (install with --no-build-isolation to build "
              "the fused kernels), skipping the extension")
        return {}
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        _warn(f"no C++ compiler ({compiler}) found, skipping the extension")
        return {}

    csrc = os.path.join(repo_root, "csrc")
    sources = _rel(repo_root, [os.path.join(csrc, "megalite.cpp"), os.path.join(csrc, "cpu", "ops.cpp")])
    compile_args = {"cxx": _cxx_flags(compiler)}
    if _cuda_available(cpp_extension):
        sources += _rel(repo_root, glob.glob(os.path.join(csrc, "cuda", "*.cu")) +
                        glob.glob(os.path.join(csrc, "cuda", "*.cpp")))
        compile_args["cxx"].append("-DMEGALITE_WITH_CUDA")
        compile_args["nvcc"] = ["-O3", "-DMEGALITE_WITH_CUDA"]
        extension = cpp_extension.CUDAExtension(EXT_NAME, sources, extra_compile_args=compile_args)
    else:
        extension = cpp_extension.CppExtension(EXT_NAME, sources, extra_compile_args=compile_args)

    class BuildOrWarn(cpp_extension.BuildExtension):
        """BuildExtension that turns a failed build into a warning."""

        def run(self):
            try:
                super().run()
            except Exception as error:  # any build failure must leave a working pure-torch install
                _warn(f"building the fused-kernel extension failed ({error})")
                return
            library = self.get_ext_fullpath(EXT_NAME)
            if os.path.exists(library) and not errors_reach_python(library):
                os.remove(library)
                compiler = " ".join(getattr(self.compiler, "compiler_cxx", None) or ["this C++ compiler"])
                _warn(f"the extension built with {compiler} crashes when one of its "
                      f"input checks fails (a C++ runtime unlike torch's, which was built with {_torch_compiler()}); "
                      f"removed {library}: set CXX to a compiler matching torch's and rebuild")

    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildOrWarn}}
