"""The machine a benchmark ran on, for its JSON line: CPU model, the ISA flags that decide dtypes and kernels, cores."""

from __future__ import annotations

import os

from atom_anyio import kernels


def machine() -> dict:
    return {"cpu": kernels.cpu_model(), "isa": kernels.isa_flags(), "cores": os.cpu_count()}
