"""Decode worker loop: recv Handoff -> emit the first token -> adopt (queued while KV is full)
-> engine steps (draft, schedule, verify) -> token deltas and per-request spec stats to the router.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from dspark_sglang.config import Config, ConfigError
from dspark_sglang.engine.detokenizer import stop_holdback
from dspark_sglang.engine.handoff import SeqHandoff
from dspark_sglang.serve import messages as m
from dspark_sglang.serve.kv_handoff import check, unpack
from dspark_sglang.serve.worker import WorkerLink

log = logging.getLogger(__name__)
MAX_GONE = 4096  # remembered aborted uids, so a handoff that crosses its abort is dropped


@dataclass
class _Live:
    uid: int
    stop: tuple[str, ...]
    emitted: int  # characters of the engine's text already sent


def _visible(text: str, stop: tuple[str, ...], emitted: int, finished: bool) -> tuple[str, int]:
    # Hold back a tail that could still grow into a stop string; the engine cuts at the stop.
    end = len(text) if finished else len(text) - stop_holdback(text, stop)
    return text[emitted:end], max(emitted, end)


def run(cfg: Config, index: int) -> None:
    link = WorkerLink(cfg, "decode", index)
    engine = link.engine
    pending: deque[tuple[int, SeqHandoff, int]] = deque()  # (uid, handoff, emitted) FIFO
    live: dict[int, _Live] = {}  # seq_id -> request
    seq_of: dict[int, int] = {}  # uid -> seq_id
    gone: dict[int, None] = {}  # recently aborted uids, insertion-ordered
    while True:
        out: list[m.Delta] = []
        for msg, frames in link.poll(busy=engine.has_unfinished() or bool(pending)):
            if isinstance(msg, m.Handoff) and msg.uid not in gone and msg.uid not in seq_of:
                try:
                    h = unpack(msg, frames)
                    check(h, engine.runner.arch.vocab_size, str(engine.runner.device))
                except ConfigError as e:
                    log.warning("%s dropped a bad handoff (uid %d): %s", link.name, msg.uid, e)
                    err = f"bad handoff: {e}"
                    out.append(m.Delta(msg.uid, [], "", True, error=err, status=500))
                    continue
                # The first token goes out now: TTFT does not wait for a free KV slot.
                text, emitted = _visible(msg.first_text, msg.params.stop, 0, False)
                out.append(m.Delta(msg.uid, [msg.first_token], text, num_output=1))
                pending.append((msg.uid, h, emitted))
            elif isinstance(msg, m.Abort):
                gone[msg.uid] = None
                if len(gone) > MAX_GONE:
                    del gone[next(iter(gone))]
                pending = deque(p for p in pending if p[0] != msg.uid)
                if msg.uid in seq_of:
                    engine.abort(seq_of.pop(msg.uid))
        if out:  # first tokens (and refusals) before the adoption and the step
            link.send(out)
            out = []
        while pending:
            uid, h, emitted = pending[0]
            try:
                sid = engine.try_adopt(h)
            except ConfigError as e:
                pending.popleft()
                out.append(m.Delta(uid, [], "", True, error=f"bad handoff: {e}", status=500))
                continue
            if sid is None:
                break
            pending.popleft()
            live[sid], seq_of[uid] = _Live(uid, h.params.stop, emitted), sid
        if engine.has_unfinished():
            for o in engine.step():
                lv = live.get(o.seq_id)
                if lv is None:
                    continue
                if o.finished:
                    del live[o.seq_id]
                    seq_of.pop(lv.uid, None)
                if o.finish_reason == "abort":
                    continue
                text, lv.emitted = _visible(o.text, lv.stop, lv.emitted, o.finished)
                out.append(
                    m.Delta(
                        lv.uid,
                        o.new_token_ids,
                        text,
                        o.finished,
                        o.finish_reason,
                        num_output=len(o.output_ids),
                        spec_rounds=o.spec_rounds,
                        spec_accepted=o.spec_accepted,
                    )
                )
        link.send(out)
        link.beat(waiting=len(pending))
