"""Building, finding and registering the shared libraries behind fo_jax's host copies.

Two targets share one semantics (`csrc/host_copy.h`): the CPU target (`csrc/host_copy_cpu.cc`,
plain C++) and the CUDA target (`csrc/host_copy_cuda.cu`, one warp per row reading and writing
pinned host memory through its device pointer). Both are XLA FFI handlers, registered with
`jax.ffi.register_ffi_target` under the names in `TARGETS`.

CPU: compiled on first use with the system C++ compiler (`$CXX`, else `g++` / `c++`) against
the FFI headers of the running jaxlib (`jax.ffi.include_dir()`), into a cache folder keyed by
the sources, headers and flags (`$FO_JAX_CACHE_DIR`, else `$XDG_CACHE_HOME/fo_jax`, else
`~/.cache/fo_jax`). About 2 s once; no CUDA needed. Concurrent first uses (test workers) each
compile to a temporary name and rename it into place.

CUDA: built by one command, on any machine (no GPU needed), from the CUDA 13 registry wheels
or a local toolkit:

    python -m fo_jax.offload.ffi cuda [--jaxlib 0.11.2] [--out PATH]

`--jaxlib` builds against the FFI headers of that jaxlib release (downloaded as a wheel), for a
machine that runs another jax than the one building. The library is looked for, in order, at
`$FO_JAX_CUDA_LIBRARY`, `fo_jax/offload/ffi/lib/`, and the cache folder; on a GPU with none
found and `nvcc` on the PATH it is compiled into the cache on first use.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile

import jax

CSRC = pathlib.Path(__file__).parent / "csrc"
PACKAGED = pathlib.Path(__file__).parent / "lib"
CPU_NAME = "libfo_jax_host_copy_cpu.so"
CUDA_NAME = "libfo_jax_host_copy_cuda.so"
# FFI target name -> handler symbol per platform.
TARGETS = {
    "fo_jax_host_gather": {"cpu": "FoJaxHostGatherCpu", "CUDA": "FoJaxHostGatherCuda"},
    "fo_jax_host_scatter": {"cpu": "FoJaxHostScatterCpu", "CUDA": "FoJaxHostScatterCuda"},
    "fo_jax_host_read_bulk": {"cpu": "FoJaxHostReadBulkCpu", "CUDA": "FoJaxHostReadBulkCuda"},
}
CPU_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")
# SASS for sm_90 (H100 / H200) and PTX for newer GPUs; PTX from a newer toolkit than the driver
# cannot be JIT-compiled, so the SASS is what an H200 runs.
CUDA_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
              "-gencode", "arch=compute_90,code=sm_90",
              "-gencode", "arch=compute_90,code=compute_90")

_lock = threading.Lock()
_registered: set[str] = set()


class LibraryUnavailable(RuntimeError):
    """The host-copy library for a platform cannot be built or found (the message says why and
    what to do)."""


def cache_dir() -> pathlib.Path:
    """Where compiled libraries are kept."""
    if os.environ.get("FO_JAX_CACHE_DIR"):
        return pathlib.Path(os.environ["FO_JAX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "fo_jax"


def _digest(sources, include: pathlib.Path, flags) -> str:
    h = hashlib.sha256()
    for path in sources:
        h.update(path.read_bytes())
    for header in sorted((include / "xla" / "ffi" / "api").glob("*.h")):
        h.update(header.read_bytes())
    h.update(" ".join(flags).encode())
    return h.hexdigest()[:16]


def _compile(cmd: list[str], out: pathlib.Path) -> None:
    """Run `cmd` (which writes `-o TMP`, appended here) and move TMP to `out` atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(cmd + ["-o", tmp], capture_output=True, text=True)
        if done.returncode:
            raise LibraryUnavailable(f"compiling the host-copy library failed ({' '.join(cmd)}):"
                                     f"\n{done.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cxx() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise LibraryUnavailable(
        "host_access='ffi' on CPU compiles a small C++ library on first use and found no C++ "
        "compiler (set $CXX, or install g++); host_access='gather' needs none")


def cpu_library() -> pathlib.Path:
    """The CPU library, compiled into the cache on first use."""
    include = pathlib.Path(jax.ffi.include_dir())
    sources = [CSRC / "host_copy.h", CSRC / "host_copy_cpu.cc"]
    out = cache_dir() / _digest(sources, include, CPU_FLAGS) / CPU_NAME
    if not out.exists():
        _compile([_cxx(), *CPU_FLAGS, "-isystem", str(include), "-I", str(CSRC),
                  str(CSRC / "host_copy_cpu.cc")], out)
    return out


def find_nvcc() -> str | None:
    """`nvcc` from the PATH, a CUDA toolkit, or the nvidia-cuda-nvcc wheel, else None."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (pathlib.Path(root) / "bin" / "nvcc").exists():
            return str(pathlib.Path(root) / "bin" / "nvcc")
    for entry in sys.path:
        candidate = pathlib.Path(entry) / "nvidia" / "cu13" / "bin" / "nvcc"
        if candidate.exists():
            return str(candidate)
    return None


def build_cuda(out: pathlib.Path | None = None, include: pathlib.Path | None = None,
               nvcc: str | None = None) -> pathlib.Path:
    """Compile the CUDA library (no GPU needed) and return its path."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise LibraryUnavailable(
            "no nvcc found for the CUDA host-copy library: install the CUDA 13 wheels "
            "(pip install 'nvidia-cuda-nvcc==13.0.*' 'nvidia-cuda-runtime==13.0.*' "
            "'nvidia-nvvm==13.0.*' 'nvidia-cuda-crt==13.0.*') or a CUDA toolkit, or set "
            "$FO_JAX_CUDA_LIBRARY to a library built elsewhere")
    include = include or pathlib.Path(jax.ffi.include_dir())
    sources = [CSRC / "host_copy.h", CSRC / "host_copy_cuda.cu"]
    out = out or cache_dir() / _digest(sources, include, CUDA_FLAGS) / CUDA_NAME
    cuda_include = pathlib.Path(nvcc).resolve().parent.parent / "include"
    _compile([nvcc, *CUDA_FLAGS, "-isystem", str(include), "-I", str(CSRC),
              "-I", str(cuda_include), str(CSRC / "host_copy_cuda.cu")], out)
    return out


def cuda_library() -> pathlib.Path | None:
    """A CUDA library found where `build_cuda` and users put it, else None."""
    env = os.environ.get("FO_JAX_CUDA_LIBRARY")
    if env:
        if not pathlib.Path(env).exists():
            raise LibraryUnavailable(f"$FO_JAX_CUDA_LIBRARY={env} does not exist")
        return pathlib.Path(env)
    if (PACKAGED / CUDA_NAME).exists():
        return PACKAGED / CUDA_NAME
    include = pathlib.Path(jax.ffi.include_dir())
    sources = [CSRC / "host_copy.h", CSRC / "host_copy_cuda.cu"]
    cached = cache_dir() / _digest(sources, include, CUDA_FLAGS) / CUDA_NAME
    return cached if cached.exists() else None


def export_checks() -> list:
    """`disabled_checks` for `jax.export` of a program holding these targets: custom calls of
    our own carry no compatibility guarantee, so export refuses them unless told."""
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in TARGETS]


def platform_of(backend: str) -> str:
    """The FFI platform name of a jax backend ("cpu", "CUDA")."""
    if backend == "cpu":
        return "cpu"
    if backend in ("gpu", "cuda"):
        return "CUDA"
    raise NotImplementedError(f"host_access='ffi' has no target for the {backend!r} backend; "
                              "use host_access='gather' (on TPU the Pallas kernels move host "
                              "rows)")


def ensure_registered(backend: str | None = None) -> None:
    """Register the host-copy targets for `backend` (default: jax's default backend).

    CPU compiles the library on first use; CUDA loads it (or compiles it if `nvcc` is at hand)
    and raises LibraryUnavailable, naming the fallback, when it cannot.
    """
    platform = platform_of(backend or jax.default_backend())
    with _lock:
        if platform in _registered:
            return
        if platform == "cpu":
            path = cpu_library()
        else:
            path = cuda_library()
            if path is None:
                if find_nvcc() is None:
                    raise LibraryUnavailable(
                        "host_access='ffi' on a GPU needs the CUDA host-copy library: build it "
                        "with `python -m fo_jax.offload.ffi cuda` (no GPU needed) and "
                        "set $FO_JAX_CUDA_LIBRARY or keep it in fo_jax/offload/ffi/lib/; "
                        "host_access='gather' runs without it, at host-compute speed")
                path = build_cuda()
        lib = ctypes.cdll.LoadLibrary(str(path))
        for name, symbols in TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbols[platform])),
                                        platform=platform)
        _registered.add(platform)


def available(backend: str | None = None) -> bool:
    """Whether the targets can be registered for `backend` without compiling anything slow:
    always on CPU with a compiler, on a GPU when the CUDA library is found."""
    try:
        platform = platform_of(backend or jax.default_backend())
    except NotImplementedError:
        return False
    if platform in _registered:
        return True
    if platform == "cpu":
        try:
            _cxx()
        except LibraryUnavailable:
            return False
        return True
    try:
        return cuda_library() is not None
    except LibraryUnavailable:
        return False


def _jaxlib_headers(version: str) -> pathlib.Path:
    """The FFI headers of jaxlib `version`, from its wheel (pip download), cached."""
    dest = cache_dir() / f"jaxlib-{version}-include"
    if (dest / "xla" / "ffi" / "api" / "ffi.h").exists():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        f"jaxlib=={version}", "--only-binary=:all:", "--python-version",
                        "3.12", "--platform", "manylinux_2_27_x86_64", "-d", tmp], check=True)
        (wheel,) = pathlib.Path(tmp).glob("jaxlib-*.whl")
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if member.startswith("jaxlib/include/xla/ffi/"):
                    target = dest / member[len("jaxlib/include/"):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(member))
    return dest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fo_jax.offload.ffi",
                                     description="Build fo_jax's host-copy libraries.")
    parser.add_argument("target", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="where to write the CUDA library (default: the cache folder)")
    parser.add_argument("--jaxlib", default=None,
                        help="build against this jaxlib release's FFI headers (default: the "
                             "installed jaxlib's)")
    args = parser.parse_args(argv)
    if args.target == "cpu":
        print(cpu_library())
        return 0
    include = _jaxlib_headers(args.jaxlib) if args.jaxlib else None
    print(build_cuda(args.out, include))
    return 0
