"""Wire messages: every type round-trips; malformed frames are refused; handoff tensors keep their
bits; the handshake names the mismatching field."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from dspark_sglang.config import ArchConfig, Config, DraftArch, DraftConfig, ModelConfig
from dspark_sglang.engine.handoff import SeqHandoff
from dspark_sglang.serve import messages as m
from dspark_sglang.serve.kv_handoff import bytes_per_token, pack, unpack
from dspark_sglang.types import SamplingParams
from tests.conftest import write_drafter, write_hf_model

HAND = m.Handshake(1, "t@abc", 3, 2, 16, 16, "float32", (0, 1), 64, 4)
PARAMS = SamplingParams(temperature=0.5, seed=3, max_tokens=9, stop=("x", "yz"))


@pytest.mark.parametrize(
    "msg",
    [
        m.Request(7, [1, 2, 3], PARAMS, decode=1),
        m.Deltas("decode0", [m.Delta(7, [4, 5], "ab", True, "stop", None, 0, 6, 3, 2)]),
        m.Deltas("prefill1", [m.Delta(8, [], "", True, error="bad", status=400)]),
        m.Abort(7),
        m.Heartbeat(
            "prefill0",
            99,
            HAND,
            1,
            2,
            3,
            4,
            tau=2.5,
            acceptance=[0.5, -1.0],
            step_seconds=0.01,
            capacity_mape=0.1,
            fallbacks={"stale": 2},
        ),
        m.Heartbeat(
            "decode0",
            98,
            HAND,
            4,
            0,
            3,
            4,
            beats=12,
            counts=m.SpecCounts(9, 30, 40, 21, 49, 3, [9, 7], [7, 5]),
        ),
        m.Refuse("handshake mismatch: page_size"),
    ],
)
def test_round_trip(msg: m.Message) -> None:
    got, frames = m.decode(m.encode(msg))
    assert got == msg and frames == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_ctx", [True, False])
def test_handoff_tensors_round_trip_bit_exact(dtype: torch.dtype, with_ctx: bool) -> None:
    n = 5
    h = SeqHandoff(
        prompt_ids=list(range(n)),
        first_token=9,
        params=PARAMS,
        kv=torch.randn(3, 2, n, 2, 16).to(dtype),
        draft_ctx=torch.randn(n, 64).to(dtype) if with_ctx else None,
        rng_state=torch.Generator().manual_seed(1).get_state(),
    )
    msg, bufs = pack(11, h, "é")
    wire = [bytes(f) for f in m.encode(msg, bufs)]  # what crosses the socket
    got, frames = m.decode(wire)
    back = unpack(got, frames)
    assert back.prompt_ids == h.prompt_ids and back.params == PARAMS and got.first_text == "é"
    assert torch.equal(back.kv, h.kv) and back.kv.dtype == dtype
    assert torch.equal(back.rng_state, h.rng_state)
    assert (back.draft_ctx is None) == (not with_ctx)
    if with_ctx:
        assert torch.equal(back.draft_ctx, h.draft_ctx)


def _handoff_frames() -> list[bytes]:
    h = SeqHandoff(
        [1, 2], 3, PARAMS, torch.zeros(1, 2, 2, 1, 4), None, torch.zeros(8, dtype=torch.uint8)
    )
    msg, bufs = pack(1, h, "")
    return [bytes(f) for f in m.encode(msg, bufs)]


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([], "empty"),
        ([b"\x93garbage"], "undecodable"),
        ([msgspec.msgpack.encode({"type": "Nope"})], "undecodable"),
        ([msgspec.msgpack.encode({"type": "Abort"})], "undecodable"),  # missing field
        (
            [
                msgspec.msgpack.encode(
                    {
                        "type": "Request",
                        "uid": 1,
                        "prompt_ids": [1],
                        "params": {"max_tokens": -1},
                        "decode": 0,
                    }
                )
            ],
            "undecodable",
        ),
        (_handoff_frames()[:-1], "frames"),  # a tensor frame missing
        ([*_handoff_frames()[:-1], b"\x00" * 3], "bytes"),  # truncated tensor
        ([*m.encode(m.Abort(1)), b"extra"], "frames"),
    ],
)
def test_malformed_messages_are_refused(frames: list[bytes], why: str) -> None:
    with pytest.raises(m.BadMessage, match=why):
        m.decode(frames)


def test_tensor_header_with_unknown_dtype_is_refused() -> None:
    hdr = msgspec.msgpack.decode(_handoff_frames()[0])
    hdr["tensors"][0]["dtype"] = "complex128"
    with pytest.raises(m.BadMessage, match="tensor header"):
        m.decode([msgspec.msgpack.encode(hdr), b"", b""])


def test_handshake_mismatch_names_the_field() -> None:
    assert m.handshake_mismatch(HAND, HAND) is None
    other = msgspec.structs.replace(HAND, gamma=8)
    assert "gamma is 4 on the router but 8" in m.handshake_mismatch(HAND, other)
    assert "version" in m.handshake_mismatch(HAND, msgspec.structs.replace(HAND, version=2))


def test_expected_handshake_reads_folders(tmp_path: Path) -> None:
    target = write_hf_model(tmp_path / "t", moe=False)
    drafter = write_drafter(tmp_path / "d", target, block_size=4)
    cfg = Config(
        ModelConfig(str(target)), draft=DraftConfig(path=str(drafter), num_speculative_tokens=3)
    )
    h = m.expected_handshake(cfg)
    assert (h.num_layers, h.num_kv_heads, h.head_dim, h.page_size) == (3, 2, 16, 16)
    assert (h.draft_taps, h.draft_hidden, h.gamma) == ((0, 1), 64, 3)
    assert h.model_id.startswith("t@")


def test_bytes_per_token_ships_less_than_draft_kv(tmp_path: Path) -> None:
    target = write_hf_model(tmp_path / "t", moe=True)
    drafter = write_drafter(tmp_path / "d", target)
    arch = ArchConfig.from_model_path(target)
    d = DraftArch.from_hf_dict(json.loads((drafter / "config.json").read_text()))
    b = bytes_per_token(arch, d, 4)
    assert b["target_kv"] == 3 * 2 * 2 * 16 * 4
    assert b["draft_ctx"] == 64 * 4 and b["draft_kv_alternative"] == 2 * 2 * 2 * 16 * 4
