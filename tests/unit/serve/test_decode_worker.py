"""serve/decode_worker.py: the loop's order of work, with a fake link and engine."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from dspark_sglang.serve import decode_worker
from dspark_sglang.serve import messages as m
from dspark_sglang.types import SamplingParams


class _Stop(Exception):
    pass


def test_the_first_token_goes_out_before_the_adoption_and_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handoff's first token reaches the router before the decode worker adopts the request
    and runs an engine step: TTFT waits for neither."""
    events: list[tuple[str, object]] = []
    done = [False]

    class Engine:
        runner = SimpleNamespace(arch=SimpleNamespace(vocab_size=100), device="cpu")

        def has_unfinished(self) -> bool:
            return any(e[0] == "adopt" for e in events) and not done[0]

        def try_adopt(self, h: object) -> int:
            events.append(("adopt", None))
            return 7

        def step(self) -> list[object]:
            events.append(("step", None))
            done[0] = True
            return [
                SimpleNamespace(
                    seq_id=7,
                    finished=True,
                    finish_reason="length",
                    text="ab",
                    new_token_ids=[5],
                    output_ids=[4, 5],
                    spec_rounds=1,
                    spec_accepted=0,
                )
            ]

        def abort(self, seq_id: int) -> None:
            raise AssertionError("no abort expected")

    class Link:
        name = "decode0"

        def __init__(self, cfg: object, role: str, index: int) -> None:
            self.engine = Engine()
            self.turns = 0

        def poll(self, busy: bool) -> Iterator[tuple[m.Message, list]]:
            self.turns += 1
            if self.turns == 1:
                msg = m.Handoff(9, [1, 2, 3], 4, "a", SamplingParams(max_tokens=2), [])
                yield msg, []
            elif self.turns > 2:
                raise _Stop

        def send(self, deltas: list[m.Delta]) -> None:
            if deltas:
                events.append(("send", [(d.uid, d.token_ids, d.finished) for d in deltas]))

        def beat(self, waiting: int) -> None:
            pass

    monkeypatch.setattr(decode_worker, "WorkerLink", Link)
    monkeypatch.setattr(
        decode_worker, "unpack", lambda msg, frames: SimpleNamespace(params=msg.params)
    )
    monkeypatch.setattr(decode_worker, "check", lambda h, vocab, device: None)
    with pytest.raises(_Stop):
        decode_worker.run(SimpleNamespace(), 0)
    assert events == [
        ("send", [(9, [4], False)]),
        ("adopt", None),
        ("step", None),
        ("send", [(9, [5], True)]),
    ]
