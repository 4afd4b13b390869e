"""The CPU kernels the stages compute with: params.yaml `reproducibility` (docs/reproducibility.md).

Torch's CPU kernels dispatch on the processor: ATen's own vectorised kernels pick AVX-512, AVX2 or plain code
(ATEN_CPU_CAPABILITY), MKL picks its GEMM code path (MKL_CBWR), FBGEMM its int8 kernels
(FBGEMM_ENABLE_INSTRUCTIONS), and every parallel reduction splits its work by the thread count. Each of these
changes the bytes of the trained weights (measured: docs/reproducibility.md). `mode: portable` pins all of them:

- ATEN_CPU_CAPABILITY=avx2: ATen's AVX2+FMA kernels, on every x86-64 CPU that has AVX2 and FMA (Intel since
  Haswell 2013, AMD since Excavator 2015 and every Zen), instead of AVX-512 where the CPU has it;
- MKL_CBWR=COMPATIBLE: MKL's one SSE2 code path without the approximate rcpps/rsqrtps instructions, the only
  branch MKL reproduces on Intel and non-Intel CPUs alike (MKL_CBWR=AVX2 is ignored on AMD: "AUTO" is used);
- FBGEMM_ENABLE_INSTRUCTIONS=AVX2: the int8 kernels of the CPU quantized evaluation;
- a fixed number of intra-op threads per process (`reproducibility.threads`; OMP/MKL dynamic adjustment off).

`mode: native` leaves all of them to the CPU (the fastest kernels; the bytes then match only on the same CPU
model with the same core count). The settings are environment variables that torch and MKL read when they start,
so `agentrl/__init__.py` calls `apply_from_file()` before any stage imports torch (every stage is
`python -m agentrl.stages.<stage>`, also under `accelerate launch`, which passes the environment on);
`config.load_params` calls `apply()` again with the validated params and checks that torch and MKL run what was asked.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Optional

MODES = ("portable", "native")
DEFAULT_MODE = "native"
DEFAULT_THREADS = 2
# what `portable` sets; the thread count comes from reproducibility.threads
PORTABLE_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    "MKL_DYNAMIC": "FALSE",
    "OMP_DYNAMIC": "FALSE",
}
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
MKL_CBWR_BRANCH, MKL_CBWR_COMPATIBLE = 1, 3  # mkl_cbwr_get(MKL_CBWR_BRANCH) -> the branch in use
CPU_FLAGS = ("avx2", "fma")  # ATen's AVX2 kernels are built with -mavx2 -mfma
PINNED = "AGENTRL_PINNED_ENV"  # JSON: the pinned variables' values before agentrl set them

# what this process applied (apply()): {"mode", "threads", "env"}; empty until then
APPLIED: dict = {}


def cpu_problem() -> Optional[str]:
    """Why this machine cannot run `portable` (None when it can): not x86-64, or no AVX2/FMA."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"this CPU is {machine}, not x86-64 (portable pins x86-64 kernels)"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None  # not Linux: torch's own check (avx2 capability) runs in verify()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    missing = [f for f in CPU_FLAGS if f not in flags]
    return f"this CPU lacks {', '.join(missing).upper()}" if missing else None


def read_setting(path: str | Path) -> tuple[str, int]:
    """(mode, threads) of a params file's `reproducibility` section, read cheaply (yaml, no torch, no schema).
    Missing keys take the defaults; config.py validates the same keys when the stage loads its params."""
    import yaml

    section = (yaml.safe_load(Path(path).read_text()) or {}).get("reproducibility") or {}
    if not isinstance(section, dict):
        return DEFAULT_MODE, DEFAULT_THREADS
    return section.get("mode", DEFAULT_MODE), section.get("threads", DEFAULT_THREADS)


def environment(mode: str, threads: int) -> dict[str, str]:
    """The environment variables `mode` sets (none for native)."""
    if mode != "portable":
        return {}
    return {**PORTABLE_ENV, **{k: str(threads) for k in THREAD_ENV}}


def apply(mode: str, threads: int, environ: Optional[dict] = None) -> dict:
    """Set the variables of `mode` in `environ` and, when torch is already imported, its thread count.
    A bad mode / thread count or a CPU that cannot run `portable` raises ValueError naming the key."""
    if mode not in MODES:
        raise ValueError(f"reproducibility.mode: expected one of {list(MODES)}, got {mode!r}")
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 1024:
        raise ValueError(f"reproducibility.threads: expected an integer in 1..1024, got {threads!r}")
    if mode == "portable" and (why := cpu_problem()):
        raise ValueError(
            f"reproducibility.mode: portable needs an x86-64 CPU with AVX2 and FMA, but {why}; "
            "set reproducibility.mode: native (the results then differ from portable ones)"
        )
    environ = os.environ if environ is None else environ
    env = environment(mode, threads)
    if env:
        if PINNED not in environ:  # the values before the first pin, for a native process started from this one
            environ[PINNED] = json.dumps({k: environ.get(k) for k in pinned_keys()})
        environ.update(env)
    else:
        restore(environ)
    if env and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    APPLIED.clear()
    APPLIED.update(mode=mode, threads=threads if env else None, env=env)
    return env


def pinned_keys() -> tuple[str, ...]:
    """The environment variables the portable mode sets."""
    return (*PORTABLE_ENV, *THREAD_ENV)


def restore(environ: dict) -> None:
    """Undo the pins a portable process (this one or a parent) put in `environ`: `native` computes with the
    kernels the environment itself asked for, as if agentrl had never pinned any."""
    saved = environ.pop(PINNED, None)
    if saved is None:
        return
    for k, v in json.loads(saved).items():
        if v is None:
            environ.pop(k, None)
        else:
            environ[k] = v


def unpinned_environ() -> dict:
    """os.environ without agentrl's pins (what a subprocess that should choose its own kernels gets)."""
    env = dict(os.environ)
    restore(env)
    return env


def apply_from_file(path: Optional[str | Path] = None) -> dict:
    """apply() the `reproducibility` section of the params file (AGENTRL_PARAMS, else ./params.yaml) when there
    is one; called by agentrl/__init__.py before torch starts. Bad values are left to config.load_params,
    which stops the stage naming them, so importing the package never fails on them."""
    path = Path(path or os.environ.get("AGENTRL_PARAMS", "params.yaml"))
    if not path.is_file():
        return {}
    try:
        return apply(*read_setting(path))
    except Exception:  # bad YAML or values: config.load_params applies the validated params, or stops naming them
        return {}


def fixed_threads() -> Optional[int]:
    """The intra-op thread count `portable` fixed in this process (None under native or before apply)."""
    return APPLIED.get("threads")


def mkl_branch() -> Optional[int]:
    """MKL's CNR branch in this process (mkl_cbwr_get(MKL_CBWR_BRANCH); 3 = COMPATIBLE), None without MKL."""
    import ctypes

    import torch

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        get = ctypes.CDLL(str(lib)).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    return get(MKL_CBWR_BRANCH)


def state() -> dict:
    """What the kernels of this process are now (imports torch): ATen capability, MKL branch, threads."""
    import torch

    return {
        "mode": APPLIED.get("mode"),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr_branch": mkl_branch(),
        "threads": torch.get_num_threads(),
    }


def verify(mode: str) -> dict:
    """state(), and under `portable` a RuntimeError when torch or MKL do not run what it pins (they chose
    their kernels before apply(): torch computed before the stage loaded its params)."""
    current = state()
    if mode != "portable":
        return current
    wrong = []
    if current["aten_cpu_capability"] != "AVX2":
        wrong.append(f"ATen kernels {current['aten_cpu_capability']} (expected AVX2)")
    if current["mkl_cbwr_branch"] not in (None, MKL_CBWR_COMPATIBLE):
        wrong.append(f"MKL branch {current['mkl_cbwr_branch']} (expected {MKL_CBWR_COMPATIBLE}, COMPATIBLE)")
    if wrong:
        raise RuntimeError(
            "reproducibility.mode portable is not in effect: "
            + "; ".join(wrong)
            + ". torch or MKL started computing before agentrl applied it: run the stage as its own process "
            "(python -m agentrl.stages.<stage>), or import agentrl before torch computes anything"
        )
    return current
