"""What this CPU offers the kernels: its feature flags, as /proc/cpuinfo lists them.

One reader for the choices that depend on them (bf16 on `dtype=auto`, the llama.cpp probe's fingerprint, widening
a draft's Q5_0 matrices); a leaf of the models layer, so those modules need nothing above it."""

from __future__ import annotations


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux lists them (`avx512_vnni`, `amx_int8`, ...); empty where it does not."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").partition(":")[2].split())
    except OSError:
        return frozenset()
