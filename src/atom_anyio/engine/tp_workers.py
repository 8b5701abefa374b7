"""Tensor parallelism's processes: rank 0 is the engine's own worker, ranks 1..N-1 are
``python -m atom_anyio.engine.tp_workers`` processes it starts and owns, each with its shard of
the model and of the KV pool (models/tensor_parallel.py).

    start: rank 0 starts each rank -> the rank loads its shard and answers ready (or its error)
           -> every rank joins the process group (gloo on CPU, NCCL on GPUs)
    step:  rank 0 sends the StepInput (without its sampling inputs) to each rank over a socket
           -> every rank runs the same forward, meeting in its collectives -> rank 0 samples
    stop:  rank 0 sends None and each rank exits 0 (when the engine's worker is collected or
           the process exits); a rank also ends with rank 0's process, killed or not
           (PR_SET_PDEATHSIG, and end-of-file on its socket)

Ranks run in lockstep, so any failed forward breaks the group: a rank that dies makes the
collectives fail (a stuck one makes them time out), the step raises ``WorkerFailed`` and the
engine stops (``/health`` 503, ``atom-anyio serve`` exits 1).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from atom_anyio.engine.engine_config import EngineConfig
from atom_anyio.engine.sampler import Sampler
from atom_anyio.engine.step import StepInput
from atom_anyio.engine.worker import Worker, WorkerFailed
from atom_anyio.models.loader import LoadedModel, load_planned
from atom_anyio.models.plan import ModelPlan

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank alive but not answering fails the step after it
READY_TIMEOUT_S = 600.0  # loading a shard
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its part of the engine: rank 0's plan (models/plan.py), which it
    loads its shard from, so every rank runs the model as rank 0 does."""

    plan: ModelPlan
    rank: int
    num_blocks: int
    block_size: int
    num_threads: int
    store_port: int  # rank 0's rendezvous store
    tier_slots: int = 0  # blocks of the rank's own KV tier (its shard of each block): rank 0's count
    tier_dir: str | None = None
    kv_cache_dtype: str = "auto"

    @property
    def size(self) -> int:
        return self.plan.tensor_parallel_size


class TensorParallelWorker(Worker):
    """Rank 0. Built on a thread that lives as long as the ranks (the event loop's, or the
    offline ``LLM``'s caller): PR_SET_PDEATHSIG ends a rank when the thread that started it ends."""

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        cfg: EngineConfig,
        sampler: Sampler | None = None,
        tier_slots: int = 0,  # each rank's KV tier holds these blocks, of its shard (kv_tier.py)
    ):
        size = cfg.tensor_parallel_size
        if loaded.model.tp.size != size or loaded.plan is None:
            raise ValueError(
                f"tensor_parallel_size={size}: load the model with load_model(tensor_parallel_size={size})"
            )
        if dist.is_initialized():
            raise RuntimeError("one tensor-parallel engine per process: close the other one (worker.close()) first")
        tier_dir = cfg.kv_offloading_dir
        super().__init__(
            loaded.model,
            num_blocks,
            cfg.block_size,
            cfg.threads_per_rank,
            tier_slots=tier_slots,
            tier_dir=tier_dir,
            sampler=sampler,
            kv_cache_dtype=cfg.kv_cache_dtype,
        )
        # port 0: any free one; the ranks join the group only once they have loaded their shards
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        plan, port = loaded.plan, self._store.port
        specs = [
            RankSpec(
                plan,
                r,
                num_blocks,
                cfg.block_size,
                cfg.threads_per_rank,
                port,
                tier_slots,
                tier_dir,
                cfg.kv_cache_dtype,
            )
            for r in range(1, size)
        ]
        self.ranks = [Rank.start(spec) for spec in specs]
        self.close = weakref.finalize(self, _stop, self.ranks)  # also at interpreter exit
        self.rank_plans: list[ModelPlan] = []  # what each rank loaded its shard as
        try:
            for rank in self.ranks:
                self.rank_plans.append(rank.wait_ready())
            join_group(0, size, self._store, self.device)
        except BaseException:
            self.close()
            raise

    def forward(self, step: StepInput):
        self._send(dataclasses.replace(step, sampling=None))  # rank 0 alone samples
        try:
            return super().forward(step)
        except Exception as exc:  # the ranks are out of step from here on
            raise WorkerFailed(self._exited(grace_s=1.0) or f"the tensor-parallel forward failed: {exc}") from exc

    def _send(self, step: StepInput) -> None:
        if exited := self._exited():
            raise WorkerFailed(exited)
        data = pickle.dumps(step)
        try:
            for rank in self.ranks:
                rank.conn.send_bytes(data)
        except OSError as exc:
            raise WorkerFailed(self._exited(grace_s=1.0) or f"a rank's socket failed: {exc}") from exc

    def _exited(self, grace_s: float = 0.0) -> str:
        """The ranks that have exited, waiting up to ``grace_s`` for one (a collective can fail on a
        rank's closed socket a moment before its exit status is there)."""
        deadline = time.monotonic() + grace_s
        for r in self.ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        gone = [r for r in self.ranks if r.process.returncode is not None]
        return ", ".join(f"rank {r.rank} (pid {r.process.pid}) exited with {r.process.returncode}" for r in gone)


@dataclass
class Rank:
    rank: int
    process: subprocess.Popen
    conn: Connection

    @classmethod
    def start(cls, spec: RankSpec) -> Rank:
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "atom_anyio.engine.tp_workers", str(theirs.fileno()), str(os.getpid())]
        process = subprocess.Popen(cmd, pass_fds=[theirs.fileno()])
        theirs.close()
        conn = Connection(ours.detach())
        conn.send_bytes(pickle.dumps(spec))
        return cls(spec.rank, process, conn)

    def wait_ready(self) -> ModelPlan:
        """Waits for the rank to load its shard; returns the plan it loaded it as."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.conn.poll(0.1):  # bounded waits on the socket, watching the process
            if self.process.poll() is not None:
                raise RuntimeError(f"rank {self.rank} exited with {self.process.returncode} while loading its shard")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank} not ready after {READY_TIMEOUT_S} s")
        error, plan = pickle.loads(self.conn.recv_bytes())
        if error:
            raise RuntimeError(f"rank {self.rank}: {error}")
        return plan

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # already gone
            self.conn.send_bytes(pickle.dumps(None))
        self.conn.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _stop(ranks: list[Rank]) -> None:
    for rank in ranks:
        rank.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def join_group(rank: int, size: int, store: dist.Store, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)


# a rank's process


def die_with(parent: int) -> None:
    """End this process when ``parent`` ends, even by SIGKILL (Linux: PR_SET_PDEATHSIG)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the prctl
        os._exit(1)


def serve_steps(worker: Worker, conn: Connection) -> None:
    """Run rank 0's steps until it sends None."""
    torch.set_num_threads(worker.num_threads)
    with torch.inference_mode():
        while (step := pickle.loads(conn.recv_bytes())) is not None:
            worker.copy_tier(step)  # the same blocks as rank 0's, of this rank's shard
            worker.forward(step)


def load_rank(spec: RankSpec) -> LoadedModel:
    """The rank's shard, loaded from rank 0's plan (what ``main`` runs in the rank's process)."""
    device = spec.plan.rank_device(spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(spec.num_threads)
    return load_planned(spec.plan, spec.rank)


def main(fd: int, parent: int) -> int:
    die_with(parent)
    conn = Connection(fd)
    spec: RankSpec = pickle.loads(conn.recv_bytes())
    device = spec.plan.rank_device(spec.rank)
    try:
        loaded = load_rank(spec)
        worker = Worker(
            loaded.model,
            spec.num_blocks,
            spec.block_size,
            spec.num_threads,
            tier_slots=spec.tier_slots,
            tier_dir=spec.tier_dir,
            kv_cache_dtype=spec.kv_cache_dtype,
        )
    except Exception as exc:
        conn.send_bytes(pickle.dumps((f"{type(exc).__name__}: {exc}", None)))
        return 1
    conn.send_bytes(pickle.dumps((None, loaded.plan)))
    join_group(spec.rank, spec.size, dist.TCPStore("127.0.0.1", spec.store_port, timeout=COLLECTIVE_TIMEOUT), device)
    try:
        serve_steps(worker, conn)
    except EOFError:  # rank 0's process ended
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
