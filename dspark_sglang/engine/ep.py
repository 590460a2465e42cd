"""Expert parallelism for the reference engine (docs/ep.md). Rank 0 runs the whole LLMEngine and
mirrors every runner call that touches the target (forward, KV writes) to ranks 1..n-1, which run
`follower_main`. Every rank holds the attention weights and a full KV cache, and 1/n of the experts.

Two process groups share one TCPStore. `ctrl` is gloo on CPU with no practical timeout, because
followers wait in it while the engine idles; it carries rank 0's ForwardBatch tensors. `ep` is
gloo on CPU or nccl on CUDA with ParallelConfig.ep_timeout_s; it carries the MoE all-to-alls. A
rank that exits or stalls fails the engine with RankFailure, never a hang.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import NoReturn, TypeVar

import msgspec
import torch
import torch.distributed as dist

from dspark_sglang.config import ArchConfig, Config, ParallelConfig
from dspark_sglang.engine.batch import ForwardBatch
from dspark_sglang.engine.runner import ModelRunner, RunOutput
from dspark_sglang.models.attention import AttentionGroup, AttentionMetadata
from dspark_sglang.models.moe import ExpertParallel

OP_FORWARD, OP_WRITE_KV, OP_STOP = 1, 2, 3
START_TIMEOUT_S = 300.0  # followers load the model; a rank that is not up by then fails start-up
RANK_FAILURE_EXIT = 70  # exit status of a worker whose watchdog saw a rank die
_IDLE = timedelta(days=365)  # ctrl-group timeout: an idle engine sends nothing for a long time
_HEADER = 1024  # int64 words: op, payload bytes, #tensors, #scalars, scalars, per-tensor layout
_MAX_DIMS = 4
_WIRE_DTYPES = (torch.int64, torch.bool, torch.float32, torch.bfloat16, torch.float16, torch.uint8)
T = TypeVar("T")


class RankFailure(RuntimeError):
    """An expert-parallel rank exited or stopped answering; the engine cannot continue."""


@dataclass(frozen=True)
class FollowerSpec:
    """What rank r > 0 reads on stdin: the whole config, its rank, the store port, its threads."""

    config: Config
    rank: int
    port: int
    num_threads: int


def create_runner(cfg: Config) -> ModelRunner:
    """One process, or rank 0 of `cfg.parallel.ep_size` expert-parallel processes."""
    if cfg.parallel.ep_size == 1:
        return ModelRunner(cfg.model, cfg.cache, cfg.draft, max_rows=_max_rows(cfg))
    return LeaderRunner(cfg)


def _max_rows(cfg: Config) -> int:
    return cfg.sched.max_num_batched_tokens


class _Groups:
    """The ctrl and ep process groups of one rank, over one store (never the global default
    group, so several engines can live in one process)."""

    def __init__(
        self, store: dist.Store, rank: int, size: int, par: ParallelConfig, device: str
    ) -> None:
        timeout = timedelta(seconds=par.ep_timeout_s)
        backend = par.dist_backend
        if backend == "auto":
            backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":  # untested here: needs one GPU per rank
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg: dist.ProcessGroup = dist.ProcessGroupNCCL(
                dist.PrefixStore("ep", store), rank, size, opts
            )
        else:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("ep", store), rank, size, timeout)
        self.ep = ExpertParallel(pg, rank, size)
        self.ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), rank, size, _IDLE)


def _broadcast(ctrl: dist.ProcessGroup, t: torch.Tensor, timeout: timedelta | None) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    if timeout is not None:  # else the group's: no practical limit
        opts.timeout = timeout
    ctrl.broadcast([t], opts).wait()


def send_op(
    ctrl: dist.ProcessGroup,
    op: int,
    tensors: list[torch.Tensor],
    scalars: list[int],
    timeout: timedelta,
) -> None:
    """Rank 0 -> all: a fixed header describing the tensors, then their bytes in one buffer.
    Sending waits for every rank to post its receive, hence the timeout: a stalled rank."""
    head = [op, 0, len(tensors), len(scalars), *scalars]
    blobs = []
    for t in tensors:
        t = t.detach().contiguous().cpu()
        head += [_WIRE_DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (_MAX_DIMS - t.dim())]
        blobs.append(t.reshape(-1).view(torch.uint8))
    payload = torch.cat(blobs) if blobs else torch.empty(0, dtype=torch.uint8)
    head[1] = payload.numel()
    assert len(head) <= _HEADER, "too many tensors for one control message"
    header = torch.zeros(_HEADER, dtype=torch.long)
    header[: len(head)] = torch.tensor(head)
    _broadcast(ctrl, header, timeout)
    if payload.numel():
        _broadcast(ctrl, payload, timeout)


def recv_op(
    ctrl: dist.ProcessGroup, timeout: timedelta
) -> tuple[int, list[torch.Tensor], list[int]]:
    """Waits as long as the engine idles for a header; the payload follows it at once."""
    header = torch.empty(_HEADER, dtype=torch.long)
    _broadcast(ctrl, header, None)
    head = header.tolist()
    op, nbytes, num_tensors, num_scalars = head[:4]
    scalars, i = head[4 : 4 + num_scalars], 4 + num_scalars
    payload = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        _broadcast(ctrl, payload, timeout)
    tensors, off = [], 0
    for _ in range(num_tensors):
        dtype, ndim = _WIRE_DTYPES[head[i]], head[i + 1]
        shape = head[i + 2 : i + 2 + ndim]
        i += 2 + _MAX_DIMS
        n = math.prod(shape) * dtype.itemsize
        tensors.append(payload[off : off + n].clone().view(dtype).reshape(shape))
        off += n
    return op, tensors, scalars


def batch_message(b: ForwardBatch) -> tuple[list[torch.Tensor], list[int]]:
    """What a follower needs to run the same target forward: ids, positions, attention metadata
    (sampling and taps stay on rank 0)."""
    a = b.attn
    tensors = [b.input_ids, b.positions, a.slot_mapping]
    scalars = [b.num_tokens, b.kv_tokens, len(a.groups)]
    for g in a.groups:
        rows = g.rows if g.rows is not None else torch.empty(0, dtype=torch.long)
        tensors += [rows, g.q_seq, g.q_off, g.kv_slots, g.mask]
        scalars += [g.num_seqs, g.max_q, int(g.rows is not None)]
    return tensors, scalars


def batch_from_message(
    tensors: list[torch.Tensor], scalars: list[int], device: str
) -> ForwardBatch:
    ids, pos, slot_mapping, *rest = (t.to(device) for t in tensors)
    num_tokens, kv_tokens, num_groups = scalars[:3]
    groups = []
    for i in range(num_groups):
        rows, q_seq, q_off, kv_slots, mask = rest[5 * i : 5 * i + 5]
        num_seqs, max_q, has_rows = scalars[3 + 3 * i : 6 + 3 * i]
        groups.append(
            AttentionGroup(
                rows if has_rows else None, q_seq, q_off, kv_slots, mask, num_seqs, max_q
            )
        )
    attn = AttentionMetadata(slot_mapping, groups)
    no_rows = torch.empty(0, dtype=torch.long, device=device)  # no logits on followers
    return ForwardBatch(ids, pos, attn, no_rows, [], [], num_tokens, kv_tokens)


def _rank_device(device: str, rank: int) -> str:
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


class Followers:
    """Rank 0's handle on ranks 1..n-1: their processes, the groups, the failure state, and a
    watchdog that notices a rank dying while the engine idles."""

    def __init__(self, cfg: Config) -> None:
        par = cfg.parallel
        self.size, self.timeout_s = par.ep_size, par.ep_timeout_s
        self.failure: str | None = None
        self._closed = False
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,  # the OS picks a free port; followers get it on stdin
            par.ep_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=START_TIMEOUT_S),
        )
        self.procs = [self._spawn(cfg, r) for r in range(1, par.ep_size)]
        self._stop = threading.Event()
        atexit.register(self.close)
        try:
            self.wait_for("joined")
            self.groups = _Groups(self.store, 0, par.ep_size, par, cfg.model.device)
        except BaseException:
            self.close()
            raise
        threading.Thread(
            target=self._watch, args=(par.exit_on_rank_failure,), daemon=True, name="ep-watchdog"
        ).start()

    def _spawn(self, cfg: Config, rank: int) -> subprocess.Popen:
        spec = FollowerSpec(cfg, rank, self.store.port, torch.get_num_threads())
        proc = subprocess.Popen(
            [sys.executable, "-m", "dspark_sglang.engine.ep"], stdin=subprocess.PIPE
        )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.json.encode(spec))
        proc.stdin.close()
        return proc

    def dead(self) -> str | None:
        """Why the first exited follower is gone, or None while all run."""
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                how = f"signal {_signal_name(-code)}" if code < 0 else f"exit code {code}"
                return f"expert-parallel rank {rank} (pid {p.pid}) exited with {how}"
        return None

    def wait_for(self, stage: str) -> None:
        keys = [f"{stage}/{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.store.check(keys):
            why = self.dead()
            if why is not None:
                self._fail(f"{why} during start-up ({stage})")
            if time.monotonic() > deadline:
                self._fail(f"expert-parallel ranks not {stage} after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def guard(self, fn: Callable[..., T], *args: object) -> T:
        """Run a step that talks to the followers; a dead or stalled rank -> RankFailure."""
        if self.failure is not None:
            raise RankFailure(self.failure)
        why = self.dead()
        if why is not None:
            self._fail(why)
        try:
            return fn(*args)
        except RuntimeError as e:
            if isinstance(e, RankFailure) or not _is_collective_error(e):
                raise
            deadline = time.monotonic() + 1.0  # a killed peer is reaped within moments
            while (why := self.dead()) is None and time.monotonic() < deadline:
                time.sleep(0.02)
            why = why or f"an expert-parallel collective failed (timeout {self.timeout_s:g} s)"
            self._fail(f"{why}: {str(e).splitlines()[0][:300]}")

    def send(self, op: int, tensors: list[torch.Tensor], scalars: list[int]) -> None:
        send_op(self.groups.ctrl, op, tensors, scalars, timedelta(seconds=self.timeout_s))

    def _fail(self, why: str) -> NoReturn:
        self.failure = f"{why}; the engine cannot continue without the experts that rank owned"
        self.close()
        raise RankFailure(self.failure)

    def _watch(self, exit_process: bool) -> None:
        while not self._stop.wait(0.2):
            why = self.dead()
            if why is None:
                continue
            if self._stop.is_set():  # a STOP from close() raced this check
                return
            if exit_process:  # serving: the router must see a dead worker, not an idle one
                print(f"error: {why}; stopping this worker", file=sys.stderr, flush=True)
                os._exit(RANK_FAILURE_EXIT)
            return  # the next engine call raises RankFailure

    def close(self) -> None:
        """Stop the followers: a STOP message when healthy, then wait, then kill."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        atexit.unregister(self.close)
        if self.failure is None and self.dead() is None and hasattr(self, "groups"):
            with contextlib.suppress(RuntimeError):  # a rank that just died gets no STOP
                self.send(OP_STOP, [], [])
        for p in self.procs:
            try:
                p.wait(5.0 if self.failure is None else 0.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


def _is_collective_error(e: RuntimeError) -> bool:
    text = str(e)
    return isinstance(e, dist.DistError) or any(
        s in text for s in ("gloo", "Gloo", "NCCL", "Connection closed", "Timed out")
    )


class LeaderRunner(ModelRunner):
    """Rank 0's runner: the same calls as ModelRunner; each one that touches the target is sent
    to the followers first, so every rank runs the same forward at the same step."""

    def __init__(self, cfg: Config) -> None:
        cfg.parallel.check_arch(ArchConfig.from_model_path(cfg.model.path))
        self.followers = Followers(cfg)
        try:
            super().__init__(
                cfg.model, cfg.cache, cfg.draft, self.followers.groups.ep, _max_rows(cfg)
            )
            self.followers.wait_for("ready")
        except BaseException:
            self.followers.close()
            raise

    def forward(self, batch: ForwardBatch, tap_rows: torch.Tensor | None = None) -> RunOutput:
        return self.followers.guard(self._forward, batch, tap_rows)

    def _forward(self, batch: ForwardBatch, tap_rows: torch.Tensor | None) -> RunOutput:
        self.followers.send(OP_FORWARD, *batch_message(batch))
        return ModelRunner.forward(self, batch, tap_rows)

    def write_kv(self, slot_ids: torch.Tensor, kv: torch.Tensor) -> None:
        self.followers.guard(self._write_kv, slot_ids, kv)

    def _write_kv(self, slot_ids: torch.Tensor, kv: torch.Tensor) -> None:
        self.followers.send(OP_WRITE_KV, [slot_ids, kv.to(self.dtype)], [])
        ModelRunner.write_kv(self, slot_ids, kv)

    def close(self) -> None:
        self.followers.close()


def follower_main() -> int:
    """Rank r > 0: build the runner for this rank's experts, then run what rank 0 sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when followers stop
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=FollowerSpec)
    cfg, rank = spec.config, spec.rank
    torch.set_num_threads(spec.num_threads)
    device = _rank_device(cfg.model.device, rank)
    store = dist.TCPStore(
        "127.0.0.1",
        spec.port,
        cfg.parallel.ep_size,
        is_master=False,
        timeout=timedelta(seconds=START_TIMEOUT_S),
    )
    store.set(f"joined/{rank}", "1")
    groups = _Groups(store, rank, cfg.parallel.ep_size, cfg.parallel, device)
    # No drafter here, so the same byte budget holds at least as many blocks as rank 0's pool.
    runner = ModelRunner(
        replace(cfg.model, device=device), cfg.cache, None, groups.ep, _max_rows(cfg)
    )
    store.set(f"ready/{rank}", "1")
    timeout = timedelta(seconds=cfg.parallel.ep_timeout_s)
    try:
        while (msg := recv_op(groups.ctrl, timeout))[0] != OP_STOP:
            op, tensors, scalars = msg
            if op == OP_FORWARD:
                runner.forward(batch_from_message(tensors, scalars, device))
            elif op == OP_WRITE_KV:
                runner.write_kv(tensors[0].to(device), tensors[1].to(device))
    except RuntimeError as e:
        if not _is_collective_error(e):
            raise  # a bug on this rank: the traceback, exit 1, and rank 0 fails with RankFailure
        first = str(e).splitlines()[0]
        print(f"dspark ep rank {rank}: rank 0 or a peer is gone, exiting: {first}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(follower_main())
