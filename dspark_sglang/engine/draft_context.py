"""Verified rows waiting to be projected into the drafter's context (deferred projection).

A step that does not run the drafter still verifies rows whose taps the drafter needs once it
next drafts those requests. Projecting them in one batch when that happens costs about what a
few rows cost, so the engine defers it; this holds the rows until then. What it hands back is
what an eager write of every row, step by step, would have left in the drafter's cache for the
blocks asked about:

- rows of blocks no live request owns (their request finished or was preempted) are dropped:
  nobody reads them, and a block handed out again is rewritten by its new owner first;
- rows older than a direct write of their block (an adopted handoff's prompt context) are
  dropped: that write supersedes them;
- `take(blocks)` returns only the rows of those blocks (the requests a probe or a selective
  step drafts) and keeps the rest, in order, for later;
- `compact(live)` drops what no take would return and keeps the rest, without handing any back.

numpy + torch; knows blocks and slots, nothing about requests or scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class PendingContext:
    def __init__(self, num_blocks: int, page_size: int, device: str) -> None:
        self.page_size = page_size
        self.rows = 0
        # (taps, positions, slots, tick): the tick of the add, or per row once rows are compacted
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | int]] = []
        self._tick = 0  # rows added now are newer than every supersede so far
        self._epoch = torch.zeros(num_blocks, dtype=torch.long, device=device)
        self._num_blocks = num_blocks
        self._device = device

    def __len__(self) -> int:
        return len(self._parts)

    def add(self, taps: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor) -> None:
        self._parts.append((taps, positions, slot_ids, self._tick))
        self.rows += int(slot_ids.shape[0])

    def supersede(self, blocks: Sequence[int]) -> None:
        """These blocks were just written directly: their pending rows are stale."""
        if not blocks or not self._parts:
            return
        self._tick += 1
        self._epoch[torch.from_numpy(np.asarray(blocks, dtype=np.int64)).to(self._device)] = (
            self._tick
        )

    def take_all(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Every row in order (a prefill step's rows leave in handoffs, so none is dropped),
        with a mask of those not superseded (the ones an eager write would still hold)."""
        if not self._parts:
            return None
        taps, pos, slot_ids, ticks = self._cat()
        self._parts, self.rows = [], 0
        block = torch.div(slot_ids, self.page_size, rounding_mode="floor")
        return taps, pos, slot_ids, self._epoch[block] <= ticks

    def take(
        self, live: Sequence[int], wanted: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Rows of `wanted` blocks (None: every live block) that are live and not superseded, in
        order; rows of live blocks not wanted stay pending. None when no row qualifies. Only the
        rows handed back or kept are copied: a long plain stretch holds tens of MB of taps,
        mostly of requests gone since."""
        if not self._parts:
            return None
        tick = self._parts[0][3]
        if (
            wanted is None
            and len(self._parts) == 1
            and isinstance(tick, int)
            and tick == self._tick
        ):
            # One step's rows, nothing written directly since (drafting every step): write them
            # all. A row of a request that finished at that step lands in a free block, which
            # its next owner rewrites before anyone reads it; the masks cost ~25 us a step.
            taps, pos, slot_ids, _ = self._parts.pop()
            self.rows = 0
            return taps, pos, slot_ids
        live_m = self._mask(live)
        want_m = None if wanted is None else self._mask(wanted)
        out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        rest: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for part in self._parts:
            taps, pos, slot_ids, ticks = part
            block = torch.div(slot_ids, self.page_size, rounding_mode="floor")
            alive = live_m[block] & (self._epoch[block] <= ticks)
            keep = alive if want_m is None else alive & want_m[block]
            _select(out, (taps, pos, slot_ids), keep)
            if want_m is not None:
                _select(rest, part, alive & ~want_m[block])
        self._parts = rest
        self.rows = sum(int(p[2].shape[0]) for p in rest)
        if not out:
            return None
        if len(out) == 1:
            return out[0]
        taps, pos, slot_ids = (torch.cat(p) for p in zip(*out, strict=True))
        return taps, pos, slot_ids

    def compact(self, live: Sequence[int]) -> None:
        """Drop the rows no `take` would hand back (blocks no live request owns, superseded
        rows) and keep the rest, in order, as one part. What a long plain stretch holds is
        mostly rows of requests gone since: this bounds it without projecting the live ones."""
        if not self._parts:
            return
        self.take(live, ())  # wants nothing: keeps exactly the live, current rows
        if len(self._parts) > 1:
            self._parts = [self._cat()]

    def _mask(self, blocks: Sequence[int]) -> torch.Tensor:
        m = torch.zeros(self._num_blocks, dtype=torch.bool, device=self._device)
        if len(blocks):
            # through numpy: torch.tensor of a list of 800 ints costs about 90 us, this 10
            m[torch.from_numpy(np.asarray(blocks, dtype=np.int64)).to(self._device)] = True
        return m

    def _cat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ticks = [
            t if isinstance(t, torch.Tensor) else torch.full_like(s, t)
            for _, _, s, t in self._parts
        ]
        if len(self._parts) == 1:
            return (*self._parts[0][:3], ticks[0])
        taps, pos, slot_ids = (torch.cat(p) for p in list(zip(*self._parts, strict=True))[:3])
        return taps, pos, slot_ids, torch.cat(ticks)


def _select(dst: list, part: tuple[torch.Tensor, ...], mask: torch.Tensor) -> None:
    """Append the rows of `part` that `mask` marks (the part itself when it marks all)."""
    n = int(mask.sum())
    if n == mask.shape[0]:
        dst.append(part)
    elif n:
        idx = mask.nonzero().squeeze(1)
        dst.append(tuple(t[idx] if isinstance(t, torch.Tensor) else t for t in part))
