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

Layout. Rows stay in the tensors they were added in (`_parts`), by reference. The first take
that must choose among them (a probe, a selective step, a compaction) gives every row one int64
metadata row (`_meta`, columns `_POS` … `_LIVE`, a buffer that grows by doubling), so a take is a
few whole-array masks, and a gather of the rows it hands back, part by part. The rows it leaves
are only unmarked, not copied: a probe of four requests after 200 plain steps at R = 64 walked
264 parts, split each and copied the 30,000 rows it kept (30 ms a probe, in-process, probes
16 steps apart); parts left with no pending row are dropped, and parts are cut down to their
pending rows once they hold more other rows than pending ones.

numpy + torch; knows blocks and slots, nothing about requests or scheduling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch


class _Add(NamedTuple):
    rows: torch.Tensor  # taps [n, n_taps * H], or C [n, H_draft] when projected
    pos: torch.Tensor
    slots: torch.Tensor
    tick: int
    projected: bool


Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

# _meta columns: position, KV slot, tick of the add, its part (index into _parts), the row in
# that part, projected (0/1), still pending (0/1: a take unmarks what it handed back or dropped)
_POS, _SLOT, _TICK, _PART, _AT, _PROJ, _LIVE = range(7)
# Rows no longer pending (holes) are reclaimed once they outnumber the pending ones and number
# more than this: below it the copies and the renumbering cost more than the masks over them.
# Parts then hold at most about twice the pending rows' bytes, plus this many rows.
RECLAIM_ROWS = 4096


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class _Grow:
    """Rows of a 2-D tensor back to back in a buffer that grows by doubling."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.n = 0

    def rows(self) -> torch.Tensor:
        assert self.buf is not None
        return self.buf[: self.n]

    def extend(self, parts: list[torch.Tensor]) -> None:
        need = self.n + sum(int(p.shape[0]) for p in parts)
        buf = self.buf
        if buf is None or buf.shape[0] < need:
            size = max(need, 2 * (0 if buf is None else buf.shape[0]), 64)
            shape = (size, *parts[0].shape[1:])
            new = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
            if self.n:
                assert buf is not None
                new[: self.n] = buf[: self.n]
            self.buf = buf = new
        at = self.n
        for p in parts:
            buf[at : at + p.shape[0]] = p
            at += int(p.shape[0])
        self.n = need


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
        self._parts: list[_Add] = []  # adds with metadata rows in _meta (a take chose among them)
        self._fresh: list[_Add] = []  # adds since, without
        self._meta = _Grow()  # one row per row of _parts, in add order (columns _POS … _LIVE)
        self._held = 0  # pending rows among _meta's (the others are holes)
        self._row_bytes = [0, 0]  # of a taps row, of a projected one
        self._tick = 0  # rows added now are newer than every supersede so far
        self._epoch = torch.zeros(num_blocks, dtype=torch.long, device=device)
        # supersedes not yet applied to _epoch: (blocks, tick), applied in one scatter before
        # the next mask (a plain step hands out a block or two: ~20 us each as its own write)
        self._marks: list[tuple[np.ndarray, int]] = []
        self._num_blocks = num_blocks
        self._device = device
        self._project = project

    def __len__(self) -> int:
        """Tensors of rows held (one per add, until a take or a compaction drops or cuts it)."""
        return len(self._parts) + len(self._fresh)

    def add(self, taps: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor) -> None:
        self._append(_Add(taps, positions, slot_ids, self._tick, False))

    def add_projected(
        self, c: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> None:
        """Rows already projected (a handoff's C); call `supersede` on their blocks first."""
        self._append(_Add(c, positions, slot_ids, self._tick, True))

    def _append(self, add: _Add) -> None:
        self._fresh.append(add)
        n = int(add.slots.shape[0])
        if n:
            row = add.rows.element_size() * add.rows[0].numel()
            self._row_bytes[add.projected] = row
            self.rows += n
            self.nbytes += n * row
            if not add.projected:
                self.taps_bytes += n * row

    def supersede(self, blocks: Sequence[int]) -> None:
        """These blocks were just written directly, or get rows added next that supersede
        what they hold: their pending rows are stale."""
        if not blocks or not self.rows:
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

    def _clear(self) -> None:
        self._parts, self._fresh = [], []
        self._meta.n = self._held = self.rows = self.nbytes = self.taps_bytes = 0

    def take_all(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Every pending row in order, projected (a prefill step's rows leave in handoffs, so
        none is dropped), with a mask of those not superseded (the ones an eager write would
        still hold)."""
        if not self.rows:
            self._clear()  # adds of no rows
            return None
        if self._parts:
            meta = self._settle()
            out = self._gather(meta)
            ticks = meta[:, _TICK].clone()
        else:  # adds only (a prefill worker's step): no metadata
            out = self._joined(self._fresh)
            ticks = torch.cat([torch.full_like(a.slots, a.tick) for a in self._fresh])
        self._clear()
        block = torch.div(out[2], self.page_size, rounding_mode="floor")
        return *out, self._epochs()[block] <= ticks

    def take(self, live: Sequence[int], wanted: Sequence[int] | None = None) -> Rows | None:
        """Rows of `wanted` blocks (None: every live block) that are live and not superseded, in
        order and projected; rows of live blocks not wanted stay pending. None when no row
        qualifies. Only the rows handed back are copied: a long plain stretch holds tens of MB
        of taps, mostly of requests gone since."""
        if not self.rows:
            self._clear()
            return None
        if (
            wanted is None
            and not self._parts
            and len(self._fresh) == 1
            and self._fresh[0].tick == self._tick
        ):
            # One step's rows, nothing superseded since (drafting every step): write them all.
            # A row of a request that finished at that step lands in a free block, which its
            # next owner rewrites before anyone reads it; the masks cost ~25 us a step.
            out = self._joined(self._fresh)
            self._clear()
            return out
        meta = self._settle()
        alive = self._alive(meta, live)
        if wanted is None:
            keep, rest = alive, None
        else:
            want = self._mask(wanted)[self._blocks(meta)]
            keep, rest = alive & want, alive & ~want
        out = self._gather(meta[keep]) if bool(keep.any()) else None
        if rest is None or not bool(rest.any()):
            self._clear()
        else:
            self._hold(rest)
        return out

    def compact(self, live: Sequence[int]) -> None:
        """Drop the rows no `take` would hand back (blocks no live request owns, superseded
        rows) and keep the rest, in order, each tensor cut down to them. What a long plain
        stretch holds is mostly rows of requests gone since: this bounds it without projecting
        the live ones."""
        if not self.rows:
            self._clear()
            return
        alive = self._alive(self._settle(), live)
        if not bool(alive.any()):
            self._clear()
            return
        self._hold(alive, cut=True)

    # -- metadata --------------------------------------------------------------------------

    def _settle(self) -> torch.Tensor:
        """Gives the adds metadata rows; -> the metadata of the pending rows, in order."""
        fresh = self._fresh
        if fresh:
            sizes = torch.tensor([int(a.slots.shape[0]) for a in fresh], device=self._device)
            n = int(sizes.sum())
            first = len(self._parts)
            m = torch.empty((n, 7), dtype=torch.long, device=self._device)
            m[:, _POS] = torch.cat([a.pos for a in fresh])
            m[:, _SLOT] = torch.cat([a.slots for a in fresh])
            per_add = torch.tensor(
                [(a.tick, first + i, int(a.projected)) for i, a in enumerate(fresh)],
                dtype=torch.long,
                device=self._device,
            )
            m[:, [_TICK, _PART, _PROJ]] = torch.repeat_interleave(per_add, sizes, dim=0)
            starts = torch.cumsum(sizes, 0) - sizes
            m[:, _AT] = torch.arange(n, device=self._device) - torch.repeat_interleave(
                starts, sizes
            )
            m[:, _LIVE] = 1
            self._meta.extend([m])
            self._parts.extend(fresh)
            self._held += n
            self._fresh = []
        meta = self._meta.rows()
        if self._held == self._meta.n:
            return meta
        return meta[meta[:, _LIVE] != 0]

    def _blocks(self, meta: torch.Tensor) -> torch.Tensor:
        return torch.div(meta[:, _SLOT], self.page_size, rounding_mode="floor")

    def _alive(self, meta: torch.Tensor, live: Sequence[int]) -> torch.Tensor:
        """Which rows are of live blocks and not superseded since their add."""
        block = self._blocks(meta)
        return self._mask(live)[block] & (self._epochs()[block] <= meta[:, _TICK])

    def _hold(self, rest: torch.Tensor, cut: bool = False) -> None:
        """Only `rest` of the pending rows (a mask over what _settle returned) stay pending;
        reclaims the holes when they outnumber them (RECLAIM_ROWS), or when `cut`."""
        meta = self._meta.rows()
        if self._held == self._meta.n:
            meta[:, _LIVE] = rest
        else:
            meta[(meta[:, _LIVE] != 0).nonzero().squeeze(1), _LIVE] = rest.long()
        self._held = int(rest.sum())
        if cut or self._meta.n - self._held > max(self._held, RECLAIM_ROWS):
            self._reclaim(cut)
        kept = self._meta.rows()
        if self._held != self._meta.n:
            kept = kept[kept[:, _LIVE] != 0]
        proj = int(kept[:, _PROJ].sum())
        self.rows = self._held
        self.taps_bytes = (self._held - proj) * self._row_bytes[0]
        self.nbytes = self.taps_bytes + proj * self._row_bytes[1]

    def _reclaim(self, cut: bool) -> None:
        """Drops the holes' metadata and the tensors left with no pending row, and cuts the
        others down to their pending rows when they hold more other rows than pending ones
        (always, with `cut`)."""
        meta = self._meta.rows()
        kept = meta[meta[:, _LIVE] != 0]
        pids, counts = torch.unique_consecutive(kept[:, _PART], return_counts=True)
        pid_list, count_list = pids.tolist(), counts.tolist()
        held = int(kept.shape[0])
        referenced = sum(int(self._parts[p].slots.shape[0]) for p in pid_list)
        cut = cut or referenced - held > max(held, RECLAIM_ROWS)
        parts: list[_Add] = []
        at = 0
        for p, n in zip(pid_list, count_list, strict=True):
            part = self._parts[p]
            if cut and n < int(part.slots.shape[0]):
                idx = kept[at : at + n, _AT]
                part = part._replace(rows=part.rows.index_select(0, idx.to(part.rows.device)))
                kept[at : at + n, _AT] = torch.arange(n, device=self._device)
                # pos, slots and tick live in the metadata from here on
            parts.append(part)
            at += n
        kept[:, _PART] = torch.repeat_interleave(
            torch.arange(len(parts), device=self._device), counts
        )
        self._parts = parts
        self._meta.n = 0
        self._meta.extend([kept])

    def _gather(self, meta: torch.Tensor) -> Rows:
        """C of these rows (their metadata, in order), projected where they are taps."""
        pids, counts = torch.unique_consecutive(meta[:, _PART], return_counts=True)
        at = meta[:, _AT]
        ends = torch.cumsum(counts, 0)
        firsts, lasts = at[ends - counts].tolist(), at[ends - 1].tolist()
        pieces: list[tuple[torch.Tensor, bool]] = []
        o = 0
        for p, n, a, b in zip(pids.tolist(), counts.tolist(), firsts, lasts, strict=True):
            part = self._parts[p]
            rows = part.rows
            if b - a + 1 == n:  # a run of the part's rows (rows within a part only ascend)
                if n < int(rows.shape[0]):
                    rows = rows[a : b + 1]
            else:
                rows = rows.index_select(0, at[o : o + n].to(rows.device))
            pieces.append((rows, part.projected))
            o += n
        return self._projected(pieces), meta[:, _POS].clone(), meta[:, _SLOT].clone()

    def _joined(self, adds: list[_Add]) -> Rows:
        """C of the adds' rows in order, with their positions and slots."""
        c = self._projected([(a.rows, a.projected) for a in adds])
        if len(adds) == 1:
            return c, adds[0].pos, adds[0].slots
        return c, torch.cat([a.pos for a in adds]), torch.cat([a.slots for a in adds])

    def _projected(self, pieces: list[tuple[torch.Tensor, bool]]) -> torch.Tensor:
        """C of the pieces' rows in order: every taps row projected in one batch."""
        raw = [r for r, projected in pieces if not projected]
        c_raw = self._project(raw[0] if len(raw) == 1 else torch.cat(raw)) if raw else None
        out: list[torch.Tensor] = []
        at = 0
        for r, projected in pieces:
            if projected:
                out.append(r)
            else:
                assert c_raw is not None
                n = int(r.shape[0])
                out.append(c_raw[at : at + n])
                at += n
        if len(out) == 1:
            return out[0]
        dtype = out[0].dtype if c_raw is None else c_raw.dtype
        return torch.cat([x.to(dtype) for x in out])

    def _mask(self, blocks: Sequence[int]) -> torch.Tensor:
        m = torch.zeros(self._num_blocks, dtype=torch.bool, device=self._device)
        if len(blocks):
            # through numpy: torch.tensor of a list of 800 ints costs about 90 us, this 10
            m[torch.from_numpy(np.asarray(blocks, dtype=np.int64)).to(self._device)] = True
        return m
