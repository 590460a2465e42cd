"""Train the bundled tiny Qwen3-MoE target with our model classes and export it in HF hub format.

Packed no-cache forward (`packed_causal_metadata`), AdamW + warmup/cosine, grad clipping, a
Switch-style load-balancing loss read off the routers, periodic held-out loss, time budget.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from dspark_sglang.config import ArchConfig
from dspark_sglang.models.attention import (
    AttentionMetadata,
    ForwardContext,
    forward_context,
    packed_causal_metadata,
)
from dspark_sglang.models.loader import build_target, load_target
from dspark_sglang.models.moe import Router
from dspark_sglang.models.target import Qwen3ForCausalLM
from dspark_sglang.train.corpus import read_texts
from dspark_sglang.train.export import export_target, hf_config
from dspark_sglang.train.tokenizer import ENDOFTEXT, special_ids

# Fits, with two ~3-4 MB drafters, in the 32 MiB package-data budget once stored in bf16.
TINY_MOE = dict(
    hidden_size=256,
    intermediate_size=512,  # dense MLP width; no target layer uses it, the drafter copies it
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


@dataclass(frozen=True, slots=True)
class TrainSettings:
    steps: int = 1200
    batch_size: int = 8  # sequences per step
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.04
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01
    eval_every: int = 100
    eval_windows: int = 32
    seed: int = 0
    max_minutes: float = 35.0
    bf16: bool = False


def tiny_moe_config(vocab_size: int, ids: dict[str, int], **overrides: object) -> dict[str, object]:
    return hf_config({**TINY_MOE, **overrides}, vocab_size, ids)


def new_model(cfg: dict[str, object], seed: int) -> Qwen3ForCausalLM:
    """GPT-2 style init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)."""
    arch = ArchConfig.from_hf_dict(cfg)
    model = build_target(arch, "float32", "cpu", (), "torch_sdpa").train()
    g = torch.Generator().manual_seed(seed)
    resid_std = 0.02 / math.sqrt(2 * arch.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                std = resid_std if name.endswith(("o_proj.weight", "down_proj")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def token_windows(texts: list[str], tok: Tokenizer, seq_len: int) -> torch.Tensor:
    """Documents joined by <|endoftext|>, cut into non-overlapping [N, seq_len + 1] windows."""
    eot = tok.token_to_id(ENDOFTEXT)
    stream: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        stream += enc.ids
        stream.append(eot)
    n = len(stream) // (seq_len + 1)
    return torch.tensor(stream[: n * (seq_len + 1)], dtype=torch.long).view(n, seq_len + 1)


class RouterStats:
    """Keeps each router's input during a training forward, for the load-balancing loss."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.inputs: list[torch.Tensor] = []
        for r in self.routers:
            r.register_forward_hook(self._keep)

    def _keep(self, router: nn.Module, args: tuple[torch.Tensor], _out: object) -> None:
        if router.training:  # eval forwards need no balance loss
            self.inputs.append(args[0])

    def balance_loss(self) -> torch.Tensor:
        """Switch Transformer eq. 4, averaged over layers: E * sum_e f_e * P_e (1 when uniform)."""
        losses = []
        for router, x in zip(self.routers, self.inputs, strict=True):
            probs = torch.softmax(F.linear(x, router.weight).float(), dim=-1)  # [T, E]
            top = torch.topk(probs, router.top_k, dim=-1).indices
            frac = F.one_hot(top, probs.shape[-1]).float().mean(dim=(0, 1))  # [E] routed share
            losses.append(probs.shape[-1] * (frac * probs.mean(0)).sum())
        self.inputs.clear()
        return torch.stack(losses).mean()


def lm_forward(
    model: Qwen3ForCausalLM, windows: torch.Tensor, meta: AttentionMetadata, bf16: bool
) -> torch.Tensor:
    """Mean next-token cross-entropy of a [B, L + 1] batch, packed as B causal sequences."""
    b, l1 = windows.shape
    ids = windows[:, :-1].reshape(-1)  # [B*L]
    positions = torch.arange(l1 - 1).repeat(b)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        with forward_context(ForwardContext(meta, None)):
            hidden, _ = model(ids, positions)  # [B*L, H]
        logits = model.compute_logits(hidden)
    return F.cross_entropy(logits.float(), windows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: Qwen3ForCausalLM, windows: torch.Tensor, batch_size: int, bf16: bool) -> float:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        chunk = windows[i : i + batch_size]
        meta = packed_causal_metadata([chunk.shape[1] - 1] * chunk.shape[0], "cpu")
        total += lm_forward(model, chunk, meta, bf16).item() * chunk.numel()
        count += chunk.numel()
    model.train(was_training)
    return total / count


def lr_at(progress: float, s: TrainSettings) -> float:
    """Linear warmup then cosine to `min_lr_ratio * lr`, over training progress in [0, 1]."""
    if progress < s.warmup_ratio:
        return s.lr * max(progress / s.warmup_ratio, 1 / max(1, s.steps))
    t = min(1.0, (progress - s.warmup_ratio) / (1 - s.warmup_ratio))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: nn.Module, s: TrainSettings) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": s.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(0.9, 0.95), eps=1e-8)


def train(
    model: Qwen3ForCausalLM,
    train_windows: torch.Tensor,
    eval_windows: torch.Tensor,
    s: TrainSettings,
    log: list[dict[str, float]] | None = None,
) -> dict[str, float]:
    """Runs `s.steps` optimizer steps or until `s.max_minutes`; returns summary numbers.

    Progress is the larger of the step and the time fraction, so a machine slowed by other work
    still finishes the cosine schedule at the deadline (the run is then not bit-reproducible).
    """
    start = time.monotonic()
    budget_s = 60 * s.max_minutes
    opt = make_optimizer(model, s)
    stats = RouterStats(model)
    g = torch.Generator().manual_seed(s.seed)
    num_windows = train_windows.shape[0]
    epochs: list[torch.Tensor] = []  # one shuffle of all windows per epoch, drawn when reached
    meta = packed_causal_metadata([s.seq_len] * s.batch_size, "cpu")
    tokens_per_step = s.batch_size * s.seq_len
    bar = tqdm(total=s.steps, desc="target", file=sys.stderr, mininterval=5, dynamic_ncols=True)
    loss_ema, step, progress = float("nan"), 0, 0.0
    while progress < 1.0:
        sample = torch.arange(step * s.batch_size, (step + 1) * s.batch_size)
        while len(epochs) <= int(sample[-1]) // num_windows:
            epochs.append(torch.randperm(num_windows, generator=g))
        batch = train_windows[[int(epochs[i // num_windows][i % num_windows]) for i in sample]]
        lr = lr_at(progress, s)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = lm_forward(model, batch, meta, s.bf16)
        aux = stats.balance_loss()
        opt.zero_grad(set_to_none=True)
        (loss + s.aux_loss_coef * aux).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        step += 1
        elapsed = time.monotonic() - start
        progress = max(step / s.steps, elapsed / budget_s)
        loss_ema = loss.item() if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * loss.item()
        tok_s = step * tokens_per_step / elapsed
        bar.update()
        bar.set_postfix(loss=f"{loss_ema:.3f}", aux=f"{aux.item():.3f}", tok_s=f"{tok_s:.0f}")
        row = {"step": step, "loss": loss.item(), "aux": aux.item(), "lr": lr}
        row["grad_norm"] = float(grad_norm)
        if step % s.eval_every == 0 or progress >= 1.0:
            row["heldout_loss"] = evaluate(model, eval_windows, s.batch_size, s.bf16)
            tqdm.write(json.dumps({**row, "elapsed_s": round(elapsed, 1)}), file=sys.stderr)
        if log is not None:
            log.append(row)
    bar.close()
    if step < s.steps:
        print(f"time budget of {s.max_minutes} min ended training at step {step}/{s.steps}")
    wall = time.monotonic() - start
    return {
        "steps": step,
        "tokens_seen": step * tokens_per_step,
        "train_loss_ema": loss_ema,
        "wall_s": wall,
        "tokens_per_s": step * tokens_per_step / wall,
    }


def probe_steps(
    cfg: dict[str, object], windows: torch.Tensor, s: TrainSettings, seconds: float
) -> float:
    """Seconds per optimizer step, measured on a throwaway model (the real run stays seeded)."""
    model = new_model(cfg, s.seed + 1)
    probe = TrainSettings(**{**asdict(s), "steps": 10**6, "eval_every": 10**9})
    opt, stats = make_optimizer(model, probe), RouterStats(model)
    meta = packed_causal_metadata([s.seq_len] * s.batch_size, "cpu")
    g = torch.Generator().manual_seed(s.seed + 1)
    times: list[float] = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds or len(times) < 3:
        t = time.monotonic()
        batch = windows[torch.randint(0, windows.shape[0], (s.batch_size,), generator=g)]
        loss = lm_forward(model, batch, meta, s.bf16) + s.aux_loss_coef * stats.balance_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.monotonic() - t)
    return sorted(times[1:])[len(times[1:]) // 2]  # median, first step excluded (warm-up)


def add_args(p: argparse.ArgumentParser) -> None:
    d = TrainSettings()
    p.add_argument("--corpus", type=Path, required=True, help="directory with train/heldout jsonl")
    p.add_argument("--tokenizer", type=Path, required=True, help="directory with tokenizer.json")
    p.add_argument("--out", type=Path, required=True, help="export directory (HF model folder)")
    p.add_argument("--steps", type=int, default=None, help="default: fit --max-minutes by a probe")
    p.add_argument("--max-minutes", type=float, default=d.max_minutes, help="hard time budget")
    p.add_argument("--probe-seconds", type=float, default=30.0)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-ratio", type=float, default=d.warmup_ratio)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--aux-loss-coef", type=float, default=d.aux_loss_coef)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-windows", type=int, default=d.eval_windows)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def main(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    cfg = tiny_moe_config(tok.get_vocab_size(), special_ids(tok))
    train_w = token_windows(read_texts(args.corpus / "train.jsonl"), tok, args.seq_len)
    heldout_w = token_windows(read_texts(args.corpus / "heldout.jsonl"), tok, args.seq_len)
    given = {f: getattr(args, f) for f in TrainSettings.__dataclass_fields__ if hasattr(args, f)}
    s = TrainSettings(**{**given, "steps": args.steps or 1})
    print(f"train windows {tuple(train_w.shape)}, held-out windows {tuple(heldout_w.shape)}")
    if args.steps is None:
        sec = probe_steps(cfg, train_w, s, args.probe_seconds)
        # Leave ~12% of the budget for the periodic held-out evals and the final full eval.
        steps = int(0.88 * (60 * args.max_minutes - (time.monotonic() - t0)) / sec)
        tps = s.batch_size * s.seq_len / sec
        print(f"probe: {sec:.2f} s/step, {tps:.0f} tokens/s -> --steps {steps}", flush=True)
        s = TrainSettings(**{**asdict(s), "steps": max(1, steps)})
    print(json.dumps({"settings": asdict(s)}), flush=True)
    model = new_model(cfg, s.seed)
    summary = train(model, train_w, heldout_w[: s.eval_windows], s)
    export_target(model, cfg, args.tokenizer, args.out)
    # Score what ships: the bf16-rounded export, reloaded through our loader, on all held-out text.
    shipped = load_target(args.out, dtype="float32")
    summary["heldout_loss"] = evaluate(shipped, heldout_w, s.batch_size, bf16=False)
    summary["heldout_ppl"] = math.exp(summary["heldout_loss"])
    summary["heldout_tokens"] = heldout_w[:, :-1].numel()
    summary["total_wall_s"] = time.monotonic() - t0
    summary["size_bytes"] = sum(f.stat().st_size for f in args.out.iterdir())
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
