"""DeepSpec drafter recipe on a tiny random target: the loss falls, the export loads."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest
import torch

from dspark_sglang.config import DraftArch
from dspark_sglang.models.loader import load_drafter, load_target
from dspark_sglang.train.drafter import (
    Sample,
    draft_config,
    drafter_loss,
    export,
    new_drafter,
    target_features,
)
from tests.conftest import VOCAB, write_hf_model


def args(**kw: object) -> argparse.Namespace:
    base = dict(num_draft_layers=1, block_size=4, target_layer_ids=(0, 1), markov_rank=8)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kind", ["dspark", "dflash", "rnn"])
def test_a_few_steps_lower_the_loss_and_export_loads(tmp_path: Path, kind: str) -> None:
    tdir = write_hf_model(tmp_path / "t", moe=True)
    target = load_target(tdir, tap_layer_ids=(0, 1))
    for p in target.parameters():
        p.requires_grad_(False)
    cfg = draft_config(target.cfg, kind, args(), mask_id=VOCAB - 1)
    drafter = new_drafter(cfg, target, seed=0)
    g = torch.Generator().manual_seed(0)
    batch = [Sample(torch.randint(0, VOCAB, (40,), generator=g).tolist(), 10) for _ in range(2)]
    ids, taps, logp = target_features(target, batch)
    shared = {id(target.model.embed_tokens.weight), id(target.lm_head.weight)}
    params = [p for p in drafter.parameters() if id(p) not in shared]
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(25):
        loss, stats = drafter_loss(drafter, batch, ids, taps, logp, 12, random.Random(0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses
    assert (stats["conf"] > 0) == (kind != "dflash")
    export(drafter, cfg, tmp_path / "out", {"steps": 25})
    loaded = load_drafter(tmp_path / "out", target)
    assert loaded.lm_head.weight is target.lm_head.weight  # shared, not stored
    keys = set(json.loads((tmp_path / "out" / "config.json").read_text()))
    assert {"block_size", "mask_token_id", "target_layer_ids", "markov_rank"} <= keys
    assert DraftArch.from_hf_dict(cfg).kind == ("dflash" if kind == "dflash" else "dspark")
