"""Drafter-context rows waiting to be written into the drafter's cache (deferred writes).

A step that does not run the drafter still verifies rows whose taps the drafter needs once it
next drafts those requests. Projecting them in one batch when that happens costs about what a
few rows cost, so the engine defers it; this holds the rows until then. An adopted handoff's
prompt context arrives projected (C, what the prefill worker computed) and waits here too:
writing it costs a decode worker ~1.2 ms per 400-token prompt (the drafter's K/V of every row)
against 0.2 ms for the target's KV, and under load most requests finish without being
drafted. What it hands back, projected, is what an eager write of every row, step by step,
would have left in the drafter's cache for the blocks asked about:

- rows of blocks no live request owns (their request finished or was preempted) are dropped:
  nobody reads them, and a block handed out again is rewritten by its new owner first;
- rows older than a write that supersedes their block (an adopted handoff's prompt context,
  written directly or added after `supersede`) are dropped;
- `take(blocks)` returns only the rows of those blocks (the requests a probe or a selective
  step drafts) and keeps the rest, in order, for later;
- `compact(live)` drops what no take would return and keeps the rest, without handing any back.

numpy + torch; knows blocks and slots, nothing about requests or scheduling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch


class _Part(NamedTuple):
    rows: torch.Tensor  # taps [n, n_taps * H], or C [n, H_draft] when projected
    pos: torch.Tensor
    slots: torch.Tensor
    tick: torch.Tensor | int  # of the add, or per row once rows are compacted
    projected: bool


Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class PendingContext:
    """`project`: taps -> C (the drafter's fc + norm), applied to taps rows when they leave;
    rows added projected leave as they came."""

    def __init__(
        self,
        num_blocks: int,
        page_size: int,
        device: str,
        project: Callable[[torch.Tensor], torch.Tensor] = _identity,
    ) -> None:
        self.page_size = page_size
        self.rows = 0
        self.nbytes = 0  # of every pending row
        self.taps_bytes = 0  # of the taps rows among them (projected rows are smaller)
        self._parts: list[_Part] = []
        self._tick = 0  # rows added now are newer than every supersede so far
        self._epoch = torch.zeros(num_blocks, dtype=torch.long, device=device)
        # supersedes not yet applied to _epoch: (blocks, tick), applied in one scatter before
        # the next mask (a plain step hands out a block or two: ~20 us each as its own write)
        self._marks: list[tuple[np.ndarray, int]] = []
        self._num_blocks = num_blocks
        self._device = device
        self._project = project

    def __len__(self) -> int:
        return len(self._parts)

    def add(self, taps: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor) -> None:
        self._append(_Part(taps, positions, slot_ids, self._tick, False))

    def add_projected(
        self, c: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> None:
        """Rows already projected (a handoff's C); call `supersede` on their blocks first."""
        self._append(_Part(c, positions, slot_ids, self._tick, True))

    def _append(self, part: _Part) -> None:
        self._parts.append(part)
        self._count(part, 1)

    def _count(self, part: _Part, sign: int) -> None:
        n = int(part.slots.shape[0])
        size = part.rows.element_size() * part.rows.numel()
        self.rows += sign * n
        self.nbytes += sign * size
        if not part.projected:
            self.taps_bytes += sign * size

    def _reset(self, parts: list[_Part]) -> None:
        self._parts, self.rows, self.nbytes, self.taps_bytes = [], 0, 0, 0
        for p in parts:
            self._append(p)

    def supersede(self, blocks: Sequence[int]) -> None:
        """These blocks were just written directly, or get rows added next that supersede
        what they hold: their pending rows are stale."""
        if not blocks or not self._parts:
            return
        self._tick += 1
        self._marks.append((np.asarray(blocks, dtype=np.int64), self._tick))

    def _epochs(self) -> torch.Tensor:
        """_epoch with every supersede so far applied (ticks only grow: the largest wins)."""
        if self._marks:
            idx = np.concatenate([b for b, _ in self._marks])
            ticks = np.repeat([t for _, t in self._marks], [b.size for b, _ in self._marks])
            self._marks = []
            self._epoch.scatter_reduce_(
                0,
                torch.from_numpy(idx).to(self._device),
                torch.from_numpy(ticks.astype(np.int64)).to(self._device),
                reduce="amax",
            )
        return self._epoch

    def take_all(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Every row in order, projected (a prefill step's rows leave in handoffs, so none is
        dropped), with a mask of those not superseded (the ones an eager write would still
        hold)."""
        if not self._parts:
            return None
        parts, ticks = self._parts, self._ticks(self._parts)
        self._reset([])
        c, pos, slot_ids = self._projected(parts)
        block = torch.div(slot_ids, self.page_size, rounding_mode="floor")
        return c, pos, slot_ids, self._epochs()[block] <= ticks

    def take(self, live: Sequence[int], wanted: Sequence[int] | None = None) -> Rows | None:
        """Rows of `wanted` blocks (None: every live block) that are live and not superseded, in
        order and projected; rows of live blocks not wanted stay pending. None when no row
        qualifies. Only the rows handed back or kept are copied: a long plain stretch holds
        tens of MB of taps, mostly of requests gone since."""
        if not self._parts:
            return None
        tick = self._parts[0].tick
        if (
            wanted is None
            and len(self._parts) == 1
            and isinstance(tick, int)
            and tick == self._tick
        ):
            # One step's rows, nothing superseded since (drafting every step): write them all.
            # A row of a request that finished at that step lands in a free block, which its
            # next owner rewrites before anyone reads it; the masks cost ~25 us a step.
            parts = self._parts
            self._reset([])
            return self._projected(parts)
        live_m = self._mask(live)
        want_m = None if wanted is None else self._mask(wanted)
        epoch = self._epochs()
        out: list[_Part] = []
        rest: list[_Part] = []
        for part in self._parts:
            block = torch.div(part.slots, self.page_size, rounding_mode="floor")
            alive = live_m[block] & (epoch[block] <= part.tick)
            keep = alive if want_m is None else alive & want_m[block]
            _select(out, part, keep)
            if want_m is not None:
                _select(rest, part, alive & ~want_m[block])
        self._reset(rest)
        return self._projected(out) if out else None

    def compact(self, live: Sequence[int]) -> None:
        """Drop the rows no `take` would hand back (blocks no live request owns, superseded
        rows) and keep the rest, in order, one part per run of a kind. What a long plain
        stretch holds is mostly rows of requests gone since: this bounds it without
        projecting the live ones."""
        if not self._parts:
            return
        self.take(live, ())  # wants nothing: keeps exactly the live, current rows
        runs: list[list[_Part]] = []
        for p in self._parts:
            if runs and runs[-1][0].projected == p.projected:
                runs[-1].append(p)
            else:
                runs.append([p])
        if len(runs) < len(self._parts):
            self._reset([_merge(run) for run in runs])

    def _projected(self, parts: list[_Part]) -> Rows:
        """C of the parts' rows in order: every taps row projected in one batch."""
        raw = [p.rows for p in parts if not p.projected]
        c_raw = self._project(raw[0] if len(raw) == 1 else torch.cat(raw)) if raw else None
        pieces: list[torch.Tensor] = []
        at = 0
        for p in parts:
            if p.projected:
                pieces.append(p.rows)
            else:
                assert c_raw is not None
                n = int(p.rows.shape[0])
                pieces.append(c_raw[at : at + n])
                at += n
        if len(parts) == 1:
            return pieces[0], parts[0].pos, parts[0].slots
        dtype = pieces[0].dtype if c_raw is None else c_raw.dtype
        c = torch.cat([x.to(dtype) for x in pieces])
        return c, torch.cat([p.pos for p in parts]), torch.cat([p.slots for p in parts])

    def _mask(self, blocks: Sequence[int]) -> torch.Tensor:
        m = torch.zeros(self._num_blocks, dtype=torch.bool, device=self._device)
        if len(blocks):
            # through numpy: torch.tensor of a list of 800 ints costs about 90 us, this 10
            m[torch.from_numpy(np.asarray(blocks, dtype=np.int64)).to(self._device)] = True
        return m

    @staticmethod
    def _ticks(parts: list[_Part]) -> torch.Tensor:
        ticks = [
            p.tick if isinstance(p.tick, torch.Tensor) else torch.full_like(p.slots, p.tick)
            for p in parts
        ]
        return ticks[0] if len(ticks) == 1 else torch.cat(ticks)


def _merge(run: list[_Part]) -> _Part:
    """One part of a run of parts of one kind, per-row ticks."""
    if len(run) == 1:
        return run[0]
    return _Part(
        torch.cat([p.rows for p in run]),
        torch.cat([p.pos for p in run]),
        torch.cat([p.slots for p in run]),
        PendingContext._ticks(run),
        run[0].projected,
    )


def _select(dst: list[_Part], part: _Part, mask: torch.Tensor) -> None:
    """Append the rows of `part` that `mask` marks (the part itself when it marks all)."""
    n = int(mask.sum())
    if n == mask.shape[0]:
        dst.append(part)
    elif n:
        idx = mask.nonzero().squeeze(1)
        tick = part.tick[idx] if isinstance(part.tick, torch.Tensor) else part.tick
        dst.append(_Part(part.rows[idx], part.pos[idx], part.slots[idx], tick, part.projected))
