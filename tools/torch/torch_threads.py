"""Pin PyTorch to N threads for a side-by-side benchmark, and measure that it kept to them.

`torch.set_num_threads(n)` sizes PyTorch's own pool and its OpenMP regions, but Debian's torch 1.13
hands its f32 matrix products to the system BLAS (`BLAS_INFO=generic`: whichever libblas.so.3 the
alternatives point at). With libopenblas0-pthread that is OpenBLAS's own pthread pool, which
`set_num_threads` does not reach: a "1-thread" PyTorch run then multiplies on every core (seen: a
2048^3 matmul at cpu/wall 2.0 on a 2-core machine). `set_threads` also sets the thread count of any
OpenBLAS (or BLIS) loaded into the process, and `cpu_wall` lets a bench report what a timed region
really used, so a comparison that is not side by side at the same thread count shows as such.
"""
import ctypes
import resource

import torch

_SETTERS = (("openblas", "openblas_set_num_threads"), ("blis", "bli_thread_set_num_threads"))


def _loaded_blas():
    """[(path, setter symbol)] for the BLAS libraries mapped into this process that take a count."""
    seen, out = set(), []
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if not path.startswith("/") or path in seen:
                continue
            seen.add(path)
            for key, sym in _SETTERS:
                if key in path.rsplit("/", 1)[-1]:
                    out.append((path, sym))
    return out


def set_threads(n):
    """Run PyTorch's next operations on n threads, its BLAS included. Returns the BLAS libraries set."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    torch.set_num_threads(n)
    done = []
    for path, sym in _loaded_blas():
        try:
            fn = getattr(ctypes.CDLL(path), sym)
        except (OSError, AttributeError):
            continue  # a libblas.so.3 front that does not export the setter: its backend is listed too
        fn.argtypes, fn.restype = [ctypes.c_int], None
        fn(n)
        done.append(path)
    return done


def cpu_seconds():
    """User + system CPU seconds of this process so far (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
