"""Prefill worker loop: recv Request -> engine prefill_only -> Handoff (KV, C, first token) to
the decode worker the router chose; a request that ends at its first token answers the router.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from dspark_sglang.config import Config, ConfigError
from dspark_sglang.serve import messages as m
from dspark_sglang.serve.kv_handoff import pack
from dspark_sglang.serve.transport import Sender
from dspark_sglang.serve.worker import WorkerLink

log = logging.getLogger(__name__)


def run(cfg: Config, index: int) -> None:
    # A prefill engine never drafts (requests end at their first token), so its verify planner
    # needs no capacity model (no start-up profiling) and its drafter no K/V pool.
    cfg = replace(cfg, draft=replace(cfg.draft, schedule_mode="verify-all", context_only=True))
    link = WorkerLink(cfg, "prefill", index)
    engine = link.engine
    decodes = [Sender(a, link.sec) for a in cfg.serve.decode_addrs]
    reqs: dict[int, m.Request] = {}  # seq_id -> request
    seq_of: dict[int, int] = {}  # uid -> seq_id
    while True:
        out: list[m.Delta] = []
        for msg, _ in link.poll(busy=engine.has_unfinished()):
            if isinstance(msg, m.Request):
                if msg.uid in seq_of:  # a duplicate (e.g. replayed) request: keep the first
                    log.warning("%s dropped a duplicate request (uid %d)", link.name, msg.uid)
                    continue
                try:
                    if not 0 <= msg.decode < len(decodes):
                        raise ConfigError(f"no decode worker {msg.decode}")
                    sid = engine.add_request(msg.prompt_ids, msg.params, prefill_only=True)
                except ConfigError as e:
                    out.append(m.Delta(msg.uid, [], "", True, error=str(e), status=400))
                    continue
                reqs[sid], seq_of[msg.uid] = msg, sid
            elif isinstance(msg, m.Abort) and msg.uid in seq_of:
                engine.abort(seq_of[msg.uid])
        if engine.has_unfinished():
            for o in engine.step():
                if not o.finished or o.seq_id not in reqs:
                    continue
                req = reqs.pop(o.seq_id)
                del seq_of[req.uid]
                if o.handoff is not None:
                    h, bufs = pack(req.uid, o.handoff, o.text)
                    if not decodes[req.decode].send(m.encode(h, bufs)):
                        err = f"decode{req.decode} is unreachable from {link.name}"
                        out.append(m.Delta(req.uid, [], "", True, error=err, status=503))
                elif o.finish_reason != "abort":  # EOS, stop or max_tokens at the first token
                    n = len(o.output_ids)
                    out.append(
                        m.Delta(req.uid, o.output_ids, o.text, True, o.finish_reason, num_output=n)
                    )
        link.send(out)
        link.beat(waiting=0)
