"""The machine a benchmark ran on, for its JSON line: CPU model, the ISA flags that decide dtypes and kernels,
cores, and the kernels' build (``ATOM_KERNEL_ISA``: a lesser kind built on this CPU, or native)."""

from __future__ import annotations

import os

from atom_anyio import kernels


def machine() -> dict:
    built = os.environ.get("ATOM_KERNEL_ISA") or "native"
    return {"cpu": kernels.cpu_model(), "isa": kernels.isa_flags(), "cores": os.cpu_count(), "kernel_isa": built}
