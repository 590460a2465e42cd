"""DSpark / DFlash drafter (DeepSpec layout): context projection, parallel block, sequential head.

Follows deepspec_spec.md §1: C = hidden_norm(fc(taps)) is projected per layer into context K/V
(the engine caches those; block K/V are never persisted); the block [anchor, MASK x (g-1)] at
positions a..a+g-1 attends to all context (< a) and to its whole block, non-causally; slot k
drafts position a+k+1. The Markov / gated / RNN head corrects the LM-head logits left to right
with prev = anchor at slot 0, and the confidence head reads [h_k ; W1[prev_k]].
Module names equal DeepSpec checkpoint keys. Knows nothing about paging or scheduling.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from dspark_sglang.config import DraftArch
from dspark_sglang.models.draws import inverse_cdf
from dspark_sglang.models.layers import GatedMLP, RMSNorm, RotaryEmbedding

KV = tuple[torch.Tensor, torch.Tensor]


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftArch) -> None:
        super().__init__()
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(d, cfg.rope_theta)

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> KV:
        """x [..., T, H] -> roped, k-normed K and V, each [..., T, h_kv, d]."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape))
        v = self.v_proj(x).view(shape)
        return self.rotary.apply(positions, k), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx: KV,
        ctx_mask: torch.Tensor,
        block_room: bool = False,
    ) -> torch.Tensor:
        # x: [N, g, H] block; ctx K/V: [N, L, h_kv, d]; ctx_mask: [N, L] True = visible.
        # block_room: ctx K/V are [N, L+g, ...], a scratch copy whose last g rows the block's
        # own K/V overwrite in place (a 30-row CPU drafting pass spent up to 8 ms in the cat).
        n, g, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, g, self.num_heads, self.head_dim))
        q = self.rotary.apply(positions, q)
        kb, vb = self.kv(x, positions)  # [N, g, h_kv, d]
        if block_room:
            k, v = ctx[0].to(kb.dtype), ctx[1].to(vb.dtype)  # no copy when they agree
            k[:, -g:] = kb
            v[:, -g:] = vb
        else:
            k = torch.cat([ctx[0].to(kb.dtype), kb], dim=1)  # [N, L+g, h_kv, d]
            v = torch.cat([ctx[1].to(vb.dtype), vb], dim=1)
        vis = torch.cat([ctx_mask, ctx_mask.new_ones(n, g)], dim=1)  # whole block visible
        # Every query row sees the same keys, so the G query heads sharing a KV head attend as
        # that head's G * g rows: SDPA over h_kv heads, no K/V expansion (R = 64, 207 context:
        # 1.91 -> 1.69 ms a call).
        hk, grp, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        qf = q.view(n, g, hk, grp, d).permute(0, 2, 3, 1, 4).reshape(n, hk, grp * g, d)
        out = F.scaled_dot_product_attention(
            qf,
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=vis[:, None, None, :],
            scale=d**-0.5,
        )  # [N, h_kv, G * g, d]
        out = out.view(n, hk, grp, g, d).permute(0, 3, 1, 2, 4)  # [N, g, h_kv, G, d]
        return self.o_proj(out.reshape(n, g, self.num_heads * d))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftArch) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx: KV,
        ctx_mask: torch.Tensor,
        block_room: bool = False,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx, ctx_mask, block_room)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """bias_k from prev_k (and h_k, s_{k-1} for gated / rnn); deepspec_spec.md §1.6, paper Eq. 6."""

    def __init__(self, cfg: DraftArch) -> None:
        super().__init__()
        r, h, v = cfg.markov_rank, cfg.hidden_size, cfg.vocab_size
        self.kind = cfg.markov_head_type
        self.rank = r
        self.markov_w1 = nn.Embedding(v, r)
        self.markov_w2 = nn.Linear(r, v, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(h + r, r, bias=True)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + h, 3 * r, bias=True)

    def init_state(self, h: torch.Tensor) -> torch.Tensor:
        return h.new_zeros(*h.shape[:-1], self.rank)

    def step(
        self, h_k: torch.Tensor, prev: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h_k [N, H], prev [N] -> (bias [N, V], next state)."""
        e = self.markov_w1(prev)  # [N, r]
        if self.kind == "vanilla":
            return self.markov_w2(e), state
        if self.kind == "gated":
            g = torch.sigmoid(self.gate_proj(torch.cat([h_k, e], dim=-1)))
            return self.markov_w2(g * e), state
        z = torch.cat([state, e, h_k], dim=-1)
        gate, cand, out = self.joint_proj(z).chunk(3, dim=-1)
        # The output reads z, which holds s_{k-1}, not s_k (as DeepSpec trains it).
        nxt = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), nxt


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: DraftArch) -> None:
        super().__init__()
        d_in = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0)
        self.with_markov = cfg.confidence_with_markov
        self.proj = nn.Linear(d_in, 1, bias=True)

    def forward(self, h_k: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor:
        x = torch.cat([h_k, prev_emb], dim=-1) if self.with_markov else h_k
        return F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: DraftArch) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.markov_head = MarkovHead(cfg) if cfg.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(cfg) if cfg.confidence_head else None

    # -- context ----------------------------------------------------------------------------
    def project_context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [T, n_taps*H] -> C [T, H]; the only per-token state the decode side needs."""
        return self.hidden_norm(self.fc(taps))

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """C [..., T, H] at positions [..., T] -> per-layer context (K, V) [..., T, h_kv, d]."""
        return [layer.self_attn.kv(c, positions) for layer in self.layers]

    # -- block ------------------------------------------------------------------------------
    def forward_block(
        self,
        anchors: torch.Tensor,
        anchor_pos: torch.Tensor,
        ctx: list[KV],
        ctx_mask: torch.Tensor,
        block_room: bool = False,
    ) -> torch.Tensor:
        """anchors [N], anchor_pos [N], ctx per layer [N, L, h_kv, d] -> h [N, g, H] (post-norm).

        block_room: each layer's ctx K/V is [N, L+g, h_kv, d], its own scratch copy, and the
        last g rows (whatever they hold) are overwritten with the block's K/V instead of
        concatenating them; ctx_mask stays [N, L]."""
        g = self.cfg.block_size
        ids = anchors.new_full((anchors.shape[0], g), self.cfg.mask_token_id)
        ids[:, 0] = anchors
        pos = anchor_pos[:, None] + torch.arange(g, device=anchors.device)  # [N, g]
        x = self.embed_tokens(ids)
        for layer, kv in zip(self.layers, ctx, strict=True):
            x = layer(x, pos, kv, ctx_mask, block_room)
        return self.norm(x)

    def corrected_logits(
        self, h: torch.Tensor, prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Teacher-forced (training / scoring): h [N, g, H], prev [N, g] -> logits, conf logits."""
        logits = self.lm_head(h)
        conf = None
        if self.markov_head is not None:
            state = self.markov_head.init_state(h[:, 0])
            biases = []
            for k in range(h.shape[1]):
                b, state = self.markov_head.step(h[:, k], prev[:, k], state)
                biases.append(b)
            logits = logits + torch.stack(biases, dim=1)
        if self.confidence_head is not None:
            emb = self.markov_head.markov_w1(prev) if self.confidence_head.with_markov else None
            conf = self.confidence_head(h, emb)
        return logits, conf

    def propose(
        self,
        h: torch.Tensor,
        anchors: torch.Tensor,
        temperatures: torch.Tensor,
        generators: list[torch.Generator | None],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Sample drafts left to right. -> tokens [N, g], q [N, g, V] fp32, conf logits [N, g].

        q is the one distribution the tokens were drawn from and the verifier divides by;
        temperature 0 makes it one-hot at the argmax (greedy verification = exact match).
        q is None when every row is greedy: nothing reads it then, and the softmax, the race
        and the one-hot over the vocabulary were a quarter of a 30-row CPU drafting pass.
        """
        g = h.shape[1]
        base = self.lm_head(h).float()  # [N, g, V]
        prev = anchors
        state = self.markov_head.init_state(h[:, 0]) if self.markov_head is not None else None
        greedy = temperatures <= 0
        if bool(greedy.all()):
            toks = []
            for k in range(g):
                logits = base[:, k]
                if self.markov_head is not None:
                    bias, state = self.markov_head.step(h[:, k], prev, state)
                    logits = logits + bias.float()
                # max's indices, not argmax: the same first maximum, 3x faster on CPU over
                # [64, 4096] (105 against 325 us, one thread), seven times a drafting pass
                prev = logits.max(-1).indices
                toks.append(prev)
            tokens = torch.stack(toks, dim=1)
            return tokens, None, self._confidence(h, anchors, tokens)
        any_greedy = bool(greedy.any())  # host-side once, so sampled rows skip the one-hot path
        temp = torch.where(greedy, torch.ones_like(temperatures), temperatures)[:, None]
        # A row's g uniforms in one draw (the same stream order as slot by slot); greedy rows
        # draw none (their tokens are the argmax below).
        u_all = torch.full(base.shape[:2], 0.5, device=base.device)
        for i, gen in enumerate(generators):
            if gen is not None:
                u_all[i].uniform_(generator=gen)
        toks, qs = [], []
        for k in range(g):
            logits = base[:, k]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(h[:, k], prev, state)
                logits = logits + bias.float()
            probs = torch.softmax(logits / temp, dim=-1)
            tok = inverse_cdf(probs, u_all[:, k])
            if any_greedy:
                best = logits.max(-1).indices
                probs = torch.where(
                    greedy[:, None], F.one_hot(best, probs.shape[-1]).float(), probs
                )
                tok = torch.where(greedy, best, tok)
            toks.append(tok)
            qs.append(probs)
            prev = tok
        tokens = torch.stack(toks, dim=1)  # [N, g]
        return tokens, torch.stack(qs, dim=1), self._confidence(h, anchors, tokens)

    def _confidence(
        self, h: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        # reads prev_k, all known once the drafts are: one batched call
        prevs = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
        emb = self.markov_head.markov_w1(prevs) if self.confidence_head.with_markov else None
        return self.confidence_head(h, emb)
