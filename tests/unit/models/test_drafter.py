"""The drafter against deepspec_spec.md §1-§2: keys, attention visibility, sequential head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from dspark_sglang.config import ConfigError, DraftArch
from dspark_sglang.models.drafter import DSparkDrafter
from dspark_sglang.models.loader import load_drafter, load_target
from tests.conftest import drafter_config, write_drafter, write_hf_model


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("t"), moe=True)


def expected_keys(cfg: DraftArch) -> dict[str, tuple[int, ...]]:
    """DeepSpec's state-dict table (§2.2), written out from the config."""
    h, v, d, r = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.markov_rank
    hq, hk, i = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    keys = {"embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "norm.weight": (h,)}
    keys |= {"fc.weight": (h, len(cfg.target_layer_ids) * h), "hidden_norm.weight": (h,)}
    for n in range(cfg.num_layers):
        pre = f"layers.{n}."
        keys |= {
            pre + "self_attn.q_proj.weight": (hq, h),
            pre + "self_attn.k_proj.weight": (hk, h),
            pre + "self_attn.v_proj.weight": (hk, h),
            pre + "self_attn.o_proj.weight": (h, hq),
            pre + "self_attn.q_norm.weight": (d,),
            pre + "self_attn.k_norm.weight": (d,),
            pre + "mlp.gate_proj.weight": (i, h),
            pre + "mlp.up_proj.weight": (i, h),
            pre + "mlp.down_proj.weight": (h, i),
            pre + "input_layernorm.weight": (h,),
            pre + "post_attention_layernorm.weight": (h,),
        }
    if r:
        keys |= {"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)}
        keys |= {"confidence_head.proj.weight": (1, h + r), "confidence_head.proj.bias": (1,)}
    if cfg.markov_head_type == "gated" and r:
        keys |= {"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)}
    if cfg.markov_head_type == "rnn" and r:
        keys |= {
            "markov_head.joint_proj.weight": (3 * r, 2 * r + h),
            "markov_head.joint_proj.bias": (3 * r,),
        }
    return keys


@pytest.mark.parametrize("kind", ["dspark", "dflash", "gated", "rnn"])
def test_state_dict_has_deepspec_keys_and_shapes(target_dir: Path, kind: str) -> None:
    cfg = DraftArch.from_hf_dict(drafter_config(target_dir, kind))
    got = {k: tuple(v.shape) for k, v in DSparkDrafter(cfg).state_dict().items()}
    assert got == expected_keys(cfg)


def naive_block(m: DSparkDrafter, taps: torch.Tensor, anchor: int, a: int) -> torch.Tensor:
    """Straight from the spec, one request, no cache: context = features of positions < a."""
    cfg = m.cfg
    c = m.hidden_norm(m.fc(taps[:a]))  # [a, H]
    ids = torch.tensor([anchor] + [cfg.mask_token_id] * (cfg.block_size - 1))
    x = m.embed_tokens(ids)
    pos_all = torch.arange(a + cfg.block_size)
    for layer in m.layers:
        att = layer.self_attn
        hn = layer.input_layernorm(x)
        kv_in = torch.cat([c, hn])  # context first, then the block
        k = att.k_norm(att.k_proj(kv_in).view(-1, att.num_kv_heads, att.head_dim))
        v = att.v_proj(kv_in).view(-1, att.num_kv_heads, att.head_dim)
        q = att.q_norm(att.q_proj(hn).view(-1, att.num_heads, att.head_dim))
        k = att.rotary.apply(pos_all, k)
        q = att.rotary.apply(pos_all[a:], q)
        rep = att.num_heads // att.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * att.head_dim**-0.5  # no mask at all
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(len(ids), -1)
        x = x + att.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return m.norm(x)


def test_padded_batched_block_equals_naive_per_request(target_dir: Path, tmp_path: Path) -> None:
    target = load_target(target_dir)
    m = load_drafter(write_drafter(tmp_path / "d", target_dir), target)
    g = torch.Generator().manual_seed(0)
    n_taps = len(m.cfg.target_layer_ids)
    lens = [5, 1, 9]
    taps = [torch.randn(n, n_taps * m.cfg.hidden_size, generator=g) for n in lens]
    anchors = torch.tensor([3, 7, 11])
    lmax = max(lens)
    with torch.no_grad():
        ctx_k = [[] for _ in m.layers]
        ctx_v = [[] for _ in m.layers]
        for t in taps:
            pad = torch.zeros(lmax - len(t), t.shape[1])
            kv = m.context_kv(m.project_context(torch.cat([t, pad])), torch.arange(lmax))
            for i, (k, v) in enumerate(kv):
                ctx_k[i].append(k)
                ctx_v[i].append(v)
        ctx = [(torch.stack(k), torch.stack(v)) for k, v in zip(ctx_k, ctx_v, strict=True)]
        mask = torch.arange(lmax)[None] < torch.tensor(lens)[:, None]
        h = m.forward_block(anchors, torch.tensor(lens), ctx, mask)
        # the runner's layout: g scratch rows after the context, overwritten by the block
        junk = torch.randn(len(lens), m.cfg.block_size, *ctx[0][0].shape[2:], generator=g)
        roomy = [(torch.cat([k, junk], 1), torch.cat([v, junk], 1)) for k, v in ctx]
        h_room = m.forward_block(anchors, torch.tensor(lens), roomy, mask, block_room=True)
        for r, t in enumerate(taps):
            want = naive_block(m, t, int(anchors[r]), lens[r])
            torch.testing.assert_close(h[r], want, atol=1e-5, rtol=1e-4)
        assert torch.equal(h_room, h)


@pytest.mark.parametrize("kind", ["dspark", "gated", "rnn", "dflash"])
def test_propose_is_sequential_and_consistent_with_teacher_forcing(
    target_dir: Path, tmp_path: Path, kind: str
) -> None:
    target = load_target(target_dir)
    m = load_drafter(write_drafter(tmp_path / kind, target_dir, kind), target)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, m.cfg.block_size, m.cfg.hidden_size, generator=g)
    anchors = torch.tensor([1, 2, 3])
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    temps = torch.tensor([0.0, 1.0, 0.7])
    with torch.no_grad():
        toks, q, conf = m.propose(h, anchors, temps, [None, gens[1], gens[2]])
        prev = torch.cat([anchors[:, None], toks[:, :-1]], dim=1)  # prev = anchor at slot 0
        logits, conf_tf = m.corrected_logits(h, prev)
    assert toks[0].tolist() == logits[0].argmax(-1).tolist()  # greedy row
    assert torch.equal(q[0], F.one_hot(logits[0].argmax(-1), q.shape[-1]).float())
    for r, t in ((1, 1.0), (2, 0.7)):
        torch.testing.assert_close(q[r], torch.softmax(logits[r].float() / t, -1))
        assert bool((q[r].gather(-1, toks[r, :, None]) > 0).all())
    if kind == "dflash":
        assert conf is None and conf_tf is None
    else:
        torch.testing.assert_close(conf, conf_tf)


@pytest.mark.parametrize("kind", ["dspark", "rnn", "dflash"])
def test_all_greedy_propose_skips_q_and_drafts_what_a_mixed_batch_does(
    target_dir: Path, tmp_path: Path, kind: str
) -> None:
    target = load_target(target_dir)
    m = load_drafter(write_drafter(tmp_path / kind, target_dir, kind), target)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(3, m.cfg.block_size, m.cfg.hidden_size, generator=g)
    anchors = torch.tensor([4, 5, 6])
    with torch.no_grad():
        toks, q, conf = m.propose(h, anchors, torch.zeros(3), [None] * 3)
        mixed = m.propose(h, anchors, torch.tensor([0.0, 0.0, 1.0]), [None, None, g])
        prev = torch.cat([anchors[:, None], toks[:, :-1]], dim=1)
        logits, conf_tf = m.corrected_logits(h, prev)
    assert q is None
    assert toks.tolist() == logits.argmax(-1).tolist()
    assert toks[:2].tolist() == mixed[0][:2].tolist()
    if kind == "dflash":
        assert conf is None
    else:
        torch.testing.assert_close(conf, conf_tf)


def test_drafter_that_does_not_fit_the_target(target_dir: Path, tmp_path: Path) -> None:
    target = load_target(target_dir)
    bad_taps = write_drafter(tmp_path / "a", target_dir, target_layer_ids=[0, 2])
    with pytest.raises(ConfigError, match="final layer is excluded"):
        load_drafter(bad_taps, target)
    d = write_drafter(tmp_path / "b", target_dir)
    cfg = (
        (d / "config.json").read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 3')
    )
    (d / "config.json").write_text(cfg)
    with pytest.raises(ConfigError, match=r"missing \['layers\.2"):
        load_drafter(d, target)
    with pytest.raises(ConfigError, match="markov_head_type"):
        DraftArch.from_hf_dict(drafter_config(target_dir, markov_head_type="lstm", markov_rank=8))


def test_stored_embeddings_load_as_stored(target_dir: Path, tmp_path: Path) -> None:
    target = load_target(target_dir)
    m = load_drafter(write_drafter(tmp_path / "e", target_dir, with_embeddings=True), target)
    assert m.embed_tokens.weight.data_ptr() != target.model.embed_tokens.weight.data_ptr()
    m2 = load_drafter(write_drafter(tmp_path / "f", target_dir), target)
    assert m2.lm_head.weight is target.lm_head.weight
