"""PendingContext: deferred drafter-context rows hand back what eager writes would have left."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from dspark_sglang.engine import draft_context
from dspark_sglang.engine.draft_context import PendingContext
from dspark_sglang.engine.engine import _last_of_each

PAGE, BLOCKS = 4, 12
PROJECTED = 1000.0  # what the test's projection adds to a taps row


def _write(cache: dict[int, float], rows: tuple[torch.Tensor, ...] | None) -> None:
    if rows is None:
        return
    taps, _, slot_ids = rows[:3]
    keep = _last_of_each(slot_ids)
    idx = range(len(slot_ids)) if keep is None else keep.tolist()
    for i in idx:
        cache[int(slot_ids[i])] = float(taps[i, 0])


@pytest.mark.parametrize("seed", range(40))
def test_taking_rows_late_leaves_what_eager_writes_leave_in_every_live_block(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random owners take and free blocks, verify rows (appended in step order, projected when
    they leave), have prompts written directly or queued already projected (an adopted
    handoff's C), get their queue compacted and get drafted a few at a time; whenever a request
    drafts, every slot it has written since it got the block holds the same row as under
    eager writes of every step. Odd seeds reclaim every hole at once."""
    if seed % 2:
        monkeypatch.setattr(draft_context, "RECLAIM_ROWS", 0)
    rng = random.Random(seed)
    pend = PendingContext(BLOCKS, PAGE, "cpu", project=lambda t: t + PROJECTED)
    eager: dict[int, tuple[float, int]] = {}  # slot -> (value, owner that wrote it)
    lazy: dict[int, float] = {}
    owner: dict[int, int] = {}  # block -> request id
    free = list(range(BLOCKS))
    next_id, value = 0, 0.0
    for _ in range(60):
        op = rng.random()
        if op < 0.25 and free:  # a request arrives: some blocks, maybe a directly written prompt
            rid, next_id = next_id, next_id + 1
            n = min(len(free), rng.randint(1, 2))
            blocks = [free.pop(rng.randrange(len(free))) for _ in range(n)]
            for b in blocks:
                owner[b] = rid
            if rng.random() < 0.5:
                pend.supersede(blocks)
                queued = rng.random() < 0.5  # else written directly, at once
                slots, vals = [], []
                for b in blocks:
                    for s in range(b * PAGE, b * PAGE + rng.randint(1, PAGE)):
                        value += 1
                        eager[s] = (value, rid)
                        if not queued:
                            lazy[s] = value
                        slots.append(s)
                        vals.append(value)
                if queued:
                    sl = torch.tensor(slots)
                    pend.add_projected(torch.tensor(vals).unsqueeze(1), sl.clone(), sl)
        elif op < 0.4 and owner:  # a request finishes (or is preempted): its blocks go free
            rid = rng.choice(sorted(set(owner.values())))
            for b in [b for b, r in owner.items() if r == rid]:
                del owner[b]
                free.append(b)
        elif op < 0.8 and owner:  # a step verifies rows of live requests, in some order
            slots = [
                b * PAGE + rng.randrange(PAGE) for b in owner for _ in range(rng.randint(0, 2))
            ]
            rng.shuffle(slots)
            if slots:
                vals = torch.arange(value + 1, value + 1 + len(slots)).unsqueeze(1)
                value += len(slots)
                for s, v in zip(slots, vals[:, 0].tolist(), strict=True):
                    eager[s] = (v + PROJECTED, owner[s // PAGE])
                sl = torch.tensor(slots)
                pend.add(vals, sl.clone(), sl)
        elif op < 0.85 and owner:  # the queue hit its cap: dead and stale rows are dropped
            before = pend.rows
            pend.compact(sorted(owner))
            assert pend.rows <= before
            assert sum(len(p.rows) for p in pend._parts + pend._fresh) == pend.rows
        elif owner:  # the drafter runs on some requests (None: every live one)
            live = sorted(owner)
            rids = sorted(set(owner.values()))
            picked = None if rng.random() < 0.3 else rng.sample(rids, rng.randint(1, len(rids)))
            wanted = None if picked is None else [b for b in live if owner[b] in picked]
            _write(lazy, pend.take(live, wanted))
            for b in wanted if wanted is not None else live:
                for s in range(b * PAGE, (b + 1) * PAGE):
                    if s in eager and eager[s][1] == owner[b]:
                        assert lazy.get(s) == eager[s][0], (seed, s)
        # what is counted is what a take of everything would hand back (rows of 4 bytes)
        got = copy.deepcopy(pend).take_all()
        assert pend.rows == (0 if got is None else len(got[0]))
        assert pend.nbytes == 4 * pend.rows and 0 <= pend.taps_bytes <= pend.nbytes


def test_rows_of_freed_blocks_and_superseded_rows_are_dropped_and_the_rest_wait() -> None:
    pend = PendingContext(8, 2, "cpu")
    pend.add(torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([0, 1, 2]), torch.tensor([0, 2, 4]))
    pend.supersede([1])  # block 1 (slot 2) written directly: row 2.0 is stale
    pend.add(torch.tensor([[4.0]]), torch.tensor([3]), torch.tensor([3]))  # newer, block 1
    # block 2 (slot 4) is no longer live; only block 0 is wanted now
    taps, _, slot_ids = pend.take(live=[0, 1], wanted=[0])
    assert taps[:, 0].tolist() == [1.0] and slot_ids.tolist() == [0]
    assert pend.rows == 1  # block 1's newer row waits; the stale and the dead ones are gone
    taps, _, slot_ids = pend.take(live=[0, 1])
    assert taps[:, 0].tolist() == [4.0] and slot_ids.tolist() == [3]
    assert pend.rows == 0 and pend.take(live=[0, 1]) is None


def test_take_all_keeps_every_row_and_marks_the_superseded() -> None:
    pend = PendingContext(4, 2, "cpu")
    pend.add(torch.tensor([[1.0], [2.0]]), torch.tensor([0, 1]), torch.tensor([0, 2]))
    pend.supersede([0])
    pend.add(torch.tensor([[3.0]]), torch.tensor([2]), torch.tensor([1]))
    taps, _, slot_ids, fresh = pend.take_all()
    assert taps[:, 0].tolist() == [1.0, 2.0, 3.0] and slot_ids.tolist() == [0, 2, 1]
    assert fresh.tolist() == [False, True, True]
    assert pend.rows == 0 and len(pend) == 0


def test_compact_drops_dead_and_superseded_rows_and_keeps_the_rest_in_order() -> None:
    pend = PendingContext(8, 2, "cpu")
    pend.add(torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([0, 1, 2]), torch.tensor([0, 2, 4]))
    pend.supersede([1])  # slot 2's row 2.0 is stale
    pend.add(torch.tensor([[4.0], [5.0]]), torch.tensor([3, 4]), torch.tensor([3, 1]))
    pend.compact(live=[0, 1])  # block 2 (slot 4, row 3.0) is gone
    assert pend.rows == 3 and [len(p.rows) for p in pend._parts] == [1, 2]
    taps, _, slot_ids = pend.take(live=[0, 1])
    assert taps[:, 0].tolist() == [1.0, 4.0, 5.0] and slot_ids.tolist() == [0, 3, 1]
    pend.compact(live=[0])
    assert pend.rows == 0 and pend.take(live=[0]) is None


def test_a_take_of_some_blocks_leaves_the_other_rows_uncopied_until_holes_dominate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe hands back its requests' rows and only unmarks them: the rows it leaves stay in
    the tensors they were added in. Once holes outnumber pending rows (past RECLAIM_ROWS),
    tensors left with nothing pending are dropped and the others cut down to what is."""
    pend = PendingContext(8, 4, "cpu")
    steps = [torch.tensor([[10.0 * k], [10.0 * k + 1], [10.0 * k + 2]]) for k in range(4)]
    for k, t in enumerate(steps):  # each step: one row of block 0, two of block 1
        pend.add(t, torch.tensor([k, k, k]), torch.tensor([k, 4 + k, 4 + (k + 1) % 4]))
    c, _, slots = pend.take(live=[0, 1], wanted=[1])  # 8 rows handed back, 8 holes < 4096
    assert c[:, 0].tolist() == [1.0, 2.0, 11.0, 12.0, 21.0, 22.0, 31.0, 32.0]
    assert slots.tolist() == [4, 5, 5, 6, 6, 7, 7, 4]
    assert pend.rows == 4 and pend.nbytes == 16
    assert [p.rows.data_ptr() for p in pend._parts] == [t.data_ptr() for t in steps]
    monkeypatch.setattr(draft_context, "RECLAIM_ROWS", 0)
    assert pend.take(live=[0, 1], wanted=[]) is None  # 8 holes > 4 pending: reclaimed
    assert [len(p.rows) for p in pend._parts] == [1, 1, 1, 1]
    c, _, slots = pend.take(live=[0, 1])
    assert c[:, 0].tolist() == [0.0, 10.0, 20.0, 30.0] and slots.tolist() == [0, 1, 2, 3]
    assert pend.rows == 0 and len(pend) == 0
