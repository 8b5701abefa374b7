"""The machine a benchmark ran on, for its JSON line: CPU model, the ISA flags that decide dtypes and kernels,
cores, and the kernels' build (``ATOM_KERNEL_ISA``: a lesser kind built on this CPU, or native); and the
``--batch-invariant`` option the benchmarks that load a model take."""

from __future__ import annotations

import argparse
import os

from atom_anyio import kernels


def machine() -> dict:
    built = os.environ.get("ATOM_KERNEL_ISA") or "native"
    return {"cpu": kernels.cpu_model(), "isa": kernels.isa_flags(), "cores": os.cpu_count(), "kernel_isa": built}


def invariance(value: str) -> bool | None:
    """``--batch-invariant``'s value as load_model's ``batch_invariant``: auto (None), 0 or 1."""
    if value not in ("auto", "0", "1"):
        raise argparse.ArgumentTypeError(f"auto, 0 or 1, not {value!r}")
    return None if value == "auto" else value == "1"


def add_batch_invariant_option(ap: argparse.ArgumentParser, note: str) -> None:
    """``--batch-invariant auto|0|1``, as ATOM_BATCH_INVARIANT; ``args.batch_invariant`` is load_model's argument."""
    ap.add_argument(
        "--batch-invariant",
        type=invariance,
        default=None,
        metavar="{auto,0,1}",
        help=f"as ATOM_BATCH_INVARIANT ({note})",
    )
