"""`python -m dspark_sglang.train drafter`: DeepSpec's drafter recipe (deepspec_spec.md §3).

Data: the frozen target continues prompts drawn from the corpus (its own generations are the
labels, loss mask on the generated part). Each step runs the target over whole sequences for the
tapped features and its next-token distributions, samples anchors among generated positions,
and trains the drafter blocks with teacher forcing: 0.1 CE + 0.9 L1 + 1.0 BCE(confidence), slot
weights exp(-k / 4). Embedding and LM head are the target's, frozen and shared.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.nn import functional as F
from tqdm import tqdm

from dspark_sglang.config import ArchConfig, DraftArch
from dspark_sglang.models.attention import ForwardContext, forward_context, packed_causal_metadata
from dspark_sglang.models.drafter import DSparkDrafter
from dspark_sglang.models.loader import load_target
from dspark_sglang.models.target import Qwen3ForCausalLM

LOSS_DECAY = 4.0  # the released checkpoints decay slot weights with 4.0, not the block size
CE_W, L1_W, CONF_W = 0.1, 0.9, 1.0
KINDS = ("dspark", "dflash", "gated", "rnn")


@dataclass(frozen=True)
class Sample:
    ids: list[int]
    gen_start: int  # first generated position; the loss mask covers [gen_start, len)


def draft_config(target: ArchConfig, kind: str, args: argparse.Namespace, mask_id: int) -> dict:
    cfg = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "num_hidden_layers": args.num_draft_layers,
        "num_target_layers": target.num_hidden_layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "intermediate_size": target.intermediate_size,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_parameters": {"rope_theta": target.rope_theta, "rope_type": "default"},
        "max_position_embeddings": target.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "block_size": args.block_size,
        "mask_token_id": mask_id,
        "target_layer_ids": list(args.target_layer_ids),
        "layer_types": ["full_attention"] * args.num_draft_layers,
        "enable_confidence_head": kind != "dflash",
    }
    if kind != "dflash":
        cfg.update(
            markov_rank=args.markov_rank,
            markov_head_type="vanilla" if kind == "dspark" else kind,
            confidence_head_with_markov=True,
        )
    else:
        cfg["markov_rank"] = 0
    return cfg


def generate_samples(
    target_dir: Path,
    corpus: Path,
    num: int,
    prompt_len: int,
    gen_len: int,
    seed: int,
    sampling: tuple[float, float, int] = (1.0, 1.0, 0),
) -> list[Sample]:
    """Target-generated continuations (DeepSpec regenerates answers with the target, §3.1).

    `sampling` is (temperature, top_p, top_k). The default, plain T = 1, matches the evaluation
    protocol, so the drafter trains on the kind of context it is later measured on.
    """
    from tokenizers import Tokenizer

    from dspark_sglang.engine.engine import LLM
    from dspark_sglang.types import SamplingParams

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines() if line]
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < num:
        ids = tok.encode(rng.choice(texts), add_special_tokens=False).ids
        if len(ids) < prompt_len + 8:
            continue
        start = rng.randrange(0, len(ids) - prompt_len)
        prompts.append(ids[start : start + prompt_len])
    llm = LLM(str(target_dir), seed=seed, max_running_requests=64, max_num_batched_tokens=4096)
    temp, top_p, top_k = sampling
    params = [
        SamplingParams(
            temperature=temp, top_p=top_p, top_k=top_k, seed=seed + i, max_tokens=gen_len
        )
        for i in range(num)
    ]
    outs = llm.generate(prompts, params, use_tqdm=True)
    return [Sample(p + o.output_ids, len(p)) for p, o in zip(prompts, outs, strict=True)]


def target_features(
    target: Qwen3ForCausalLM, batch: list[Sample]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed target forward: ids [T], taps [T, n*H], next-token log-probs [T, V] (frozen)."""
    ids = torch.tensor([t for s in batch for t in s.ids])
    pos = torch.cat([torch.arange(len(s.ids)) for s in batch])
    meta = packed_causal_metadata([len(s.ids) for s in batch], "cpu")
    rows = torch.arange(len(ids))
    with torch.no_grad(), forward_context(ForwardContext(meta, None, tap_rows=rows)):
        hidden, taps = target(ids, pos)
        logp = torch.log_softmax(target.compute_logits(hidden).float(), dim=-1)
    assert taps is not None
    return ids, taps.float(), logp


def sample_anchors(s: Sample, num: int, block: int, rng: random.Random) -> list[int]:
    """Anchors a with a and a+1 both generated (deepspec_spec.md §3.2)."""
    cands = list(range(s.gen_start, len(s.ids) - 1))
    return sorted(rng.sample(cands, min(num, len(cands))))


def drafter_loss(
    drafter: DSparkDrafter,
    batch: list[Sample],
    ids: torch.Tensor,
    taps: torch.Tensor,
    logp_t: torch.Tensor,
    num_anchors: int,
    rng: random.Random,
) -> tuple[torch.Tensor, dict[str, float]]:
    cfg = drafter.cfg
    g = cfg.block_size
    losses, w_sum, stats = [], 0.0, {"ce": 0.0, "l1": 0.0, "conf": 0.0, "acc": 0.0}
    start = 0
    terms = []
    for s in batch:
        n = len(s.ids)
        c = drafter.project_context(taps[start : start + n])  # [T, H]
        ctx = drafter.context_kv(c, torch.arange(n))
        anchors = sample_anchors(s, num_anchors, g, rng)
        if not anchors:  # the target stopped at once: nothing generated to learn from
            start += n
            continue
        a = torch.tensor(anchors, dtype=torch.long)
        nb = len(anchors)
        kv = [(k.expand(nb, *k.shape), v.expand(nb, *v.shape)) for k, v in ctx]
        mask = torch.arange(n)[None, :] < a[:, None]  # context strictly before the anchor
        h = drafter.forward_block(ids[start + a], a, kv, mask)  # [nb, g, H]
        lab_pos = a[:, None] + 1 + torch.arange(g)[None, :]  # slot k predicts a+k+1
        valid = lab_pos < n
        lab = ids[start + lab_pos.clamp(max=n - 1)]
        prev = torch.cat([ids[start + a][:, None], lab[:, :-1]], dim=1)  # teacher forcing
        logits, conf = drafter.corrected_logits(h, prev)
        logq = torch.log_softmax(logits.float(), dim=-1)
        logp = logp_t[start + (lab_pos - 1).clamp(max=n - 1)]  # target's view of position a+k+1
        mask_k = valid.float().cumprod(dim=1)
        w = mask_k * torch.exp(-torch.arange(g) / LOSS_DECAY)[None, :]
        ce = F.nll_loss(logq.reshape(-1, logq.shape[-1]), lab.reshape(-1), reduction="none")
        l1 = (logq.exp() - logp.exp()).abs().sum(-1)  # plain L1 (2 TV), gradient through q
        target_c = (1 - 0.5 * l1.detach()).clamp(0, 1)
        terms.append((w, ce.view(nb, g), l1, conf, target_c))
        start += n
    w_sum = sum(float(t[0].sum()) for t in terms)
    for w, ce, l1, conf, target_c in terms:
        loss = CE_W * (w * ce).sum() + L1_W * (w * l1).sum()
        if conf is not None:
            bce = F.binary_cross_entropy_with_logits(conf, target_c, reduction="none")
            loss = loss + CONF_W * (w * bce).sum()
            stats["conf"] += float((w * bce).sum().detach()) / w_sum
        losses.append(loss / w_sum)
        stats["ce"] += float((w * ce).sum().detach()) / w_sum
        stats["l1"] += float((w * l1).sum().detach()) / w_sum
        stats["acc"] += float((w * target_c).sum()) / w_sum
    return torch.stack(losses).sum(), stats


def new_drafter(cfg: dict, target: Qwen3ForCausalLM, seed: int) -> DSparkDrafter:
    torch.manual_seed(seed)
    d = DSparkDrafter(DraftArch.from_hf_dict(cfg))
    for name, p in d.named_parameters():
        if "norm" in name:
            torch.nn.init.ones_(p)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
        else:
            torch.nn.init.normal_(p, std=0.02)
    d.embed_tokens.weight = target.model.embed_tokens.weight  # frozen, shared (§2.3)
    d.lm_head.weight = target.lm_head.weight
    return d


def train(
    drafter: DSparkDrafter,
    target: Qwen3ForCausalLM,
    samples: list[Sample],
    args: argparse.Namespace,
) -> dict[str, float]:
    shared = {id(drafter.embed_tokens.weight), id(drafter.lm_head.weight)}
    params = [p for p in drafter.parameters() if id(p) not in shared]
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    warm = max(1, int(0.04 * args.steps))
    bar = tqdm(range(args.steps), desc=f"drafter[{args.kind}]", file=sys.stderr, mininterval=5)
    ema: dict[str, float] = {}
    step = 0
    for step in bar:
        # Progress follows the step count or the time budget, whichever is further along, so a
        # slowed machine still completes the cosine decay by the deadline.
        progress = max(step / args.steps, (time.monotonic() - t0) / (60 * args.max_minutes))
        warm_frac = warm / args.steps
        lr = args.lr * (
            max(progress / warm_frac, 1 / warm)
            if progress < warm_frac
            else 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warm_frac) / (1 - warm_frac))))
        )
        for grp in opt.param_groups:
            grp["lr"] = lr
        batch = rng.sample(samples, args.batch_size)
        ids, taps, logp = target_features(target, batch)
        loss, stats = drafter_loss(drafter, batch, ids, taps, logp, args.num_anchors, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        for k, v in stats.items():
            ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
        bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()}, refresh=False)
        if progress >= 1.0:
            break
    return {**ema, "steps": step + 1, "minutes": (time.monotonic() - t0) / 60}


def export(drafter: DSparkDrafter, cfg: dict, out: Path, summary: dict) -> None:
    """DeepSpec key layout (§2.2) in bf16, minus the frozen embedding/LM-head copies: the loader
    aliases the target's (identical by construction), which keeps the bundle small."""
    out.mkdir(parents=True, exist_ok=True)
    sd = {
        k: v.detach().to(torch.bfloat16).contiguous()
        for k, v in drafter.state_dict().items()
        if k not in ("embed_tokens.weight", "lm_head.weight")
    }
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}, indent=2))
    (out / "training.json").write_text(json.dumps(summary, indent=2))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, required=True, help="trained target HF folder")
    p.add_argument("--corpus", type=Path, required=True, help="train.jsonl for prompts")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--kind", choices=KINDS, default="dspark")
    p.add_argument("--samples", type=Path, help="cache of generated samples (jsonl); reused")
    p.add_argument("--num-samples", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--gen-len", type=int, default=160)
    p.add_argument("--gen-temperature", type=float, default=1.0, help="sampling of the samples")
    p.add_argument("--gen-top-p", type=float, default=1.0)
    p.add_argument("--gen-top-k", type=int, default=0, help="0 = no top-k truncation")
    p.add_argument("--gen-seed", type=int, help="seed of the generated samples (default --seed)")
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--num-draft-layers", type=int, default=2)
    p.add_argument(
        "--target-layer-ids", type=lambda s: tuple(int(x) for x in s.split(",")), default=(0, 1, 2)
    )
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--num-anchors", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest here)")
    p.add_argument("--init-from", type=Path, help="start from an exported drafter's weights")


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    target = load_target(args.target, tap_layer_ids=args.target_layer_ids)
    tcfg = target.cfg
    mask_id = json.loads((args.target / "tokenizer_config.json").read_text()).get("mask_token_id")
    if mask_id is None:
        from tokenizers import Tokenizer

        mask_id = Tokenizer.from_file(str(args.target / "tokenizer.json")).token_to_id("<|mask|>")
    if args.samples is not None and args.samples.is_file():
        samples = [Sample(**json.loads(x)) for x in args.samples.read_text().splitlines() if x]
    else:
        samples = generate_samples(
            args.target,
            args.corpus,
            args.num_samples,
            args.prompt_len,
            args.gen_len,
            args.seed if args.gen_seed is None else args.gen_seed,
            (args.gen_temperature, args.gen_top_p, args.gen_top_k),
        )
        if args.samples is not None:
            args.samples.parent.mkdir(parents=True, exist_ok=True)
            args.samples.write_text(
                "\n".join(json.dumps({"ids": s.ids, "gen_start": s.gen_start}) for s in samples)
            )
    cfg = draft_config(tcfg, args.kind, args, int(mask_id))
    drafter = new_drafter(cfg, target, args.seed)
    if args.init_from is not None:  # continue a previous run (its exported weights)
        from safetensors.torch import load_file

        sd = load_file(str(args.init_from / "model.safetensors"))
        missing, unexpected = drafter.load_state_dict(
            {k: v.float() for k, v in sd.items()}, strict=False
        )
        if unexpected or set(missing) - {"embed_tokens.weight", "lm_head.weight"}:
            raise SystemExit(
                f"--init-from {args.init_from}: keys do not match {missing} {unexpected}"
            )
    summary = train(drafter, target, samples, args)
    summary.update(command=" ".join(sys.argv), kind=args.kind, num_samples=len(samples))
    export(drafter, cfg, args.out, summary)
    print(json.dumps(summary))
