"""`python -m dspark_sglang.profile`: target forward step time vs batch tokens on this machine.

Times ModelRunner.forward (+ logits) on decode-like and verify-like batches built with the real
engine pieces; prints a table or one JSON line. A CLI: imports engine/models; nothing imports it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from dspark_sglang.config import (
    CPU_GEMMS,
    DTYPES,
    ArchConfig,
    CacheConfig,
    ConfigError,
    DraftConfig,
    ModelConfig,
)
from dspark_sglang.engine.block_pool import BlockPool
from dspark_sglang.engine.profiler import (
    GridPoint,
    blocks_needed,
    time_draft,
    time_point,
    warm_up,
)
from dspark_sglang.engine.runner import ModelRunner, draft_precision
from dspark_sglang.hostinfo import cpu_model
from dspark_sglang.models.attention import create_backend
from dspark_sglang.models.cpu_gemm import measured_shapes
from dspark_sglang.models.loader import torch_dtype
from dspark_sglang.models.target import Qwen3ForCausalLM

SYNTHETIC_NAME = "synthetic:tiny-moe"
# The synthetic target's config.json, written by hand so the package never needs transformers.
SYNTHETIC_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,  # unused: every layer is MoE
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
SEED = 0

# Grid defaults; explicit flags override either preset.
FULL = {
    "batch_sizes": (1, 2, 4, 8, 16, 32),
    "verify_lens": (0, 3, 7),
    "num_reqs": (1, 4, 16),
    "context_len": (256,),
    "repeats": 10,
    "warmup": 2,
}
QUICK = {
    "batch_sizes": (1, 4, 16),
    "verify_lens": (0, 3),
    "num_reqs": (1, 4),
    "context_len": (64,),
    "repeats": 5,
    "warmup": 1,
}
# --ep-size N > 1 (bench/ep.py): decode steps up to larger B, where expert load imbalance shows.
EP_FULL = {"batch_sizes": (1, 2, 4, 8, 16, 32, 64, 128, 256), "context_len": (32,), "repeats": 5}
EP_QUICK = {"batch_sizes": (1, 8, 64), "context_len": (16,), "repeats": 3}


def write_synthetic_model(path: Path) -> None:
    """Random Qwen3-MoE checkpoint: matrices ~ N(0, 0.02) from a fixed seed, norm weights = 1."""
    arch = ArchConfig.from_hf_dict(SYNTHETIC_CONFIG)
    with torch.device("meta"):  # parameter names and shapes only; no memory
        model = Qwen3ForCausalLM(arch, create_backend("torch_sdpa"))
    shapes = {name: p.shape for name, p in model.named_parameters()}  # tied head listed once
    gen = torch.Generator().manual_seed(SEED)
    sd = {
        # Unit norm weights keep activations O(1) through the layers, as in a trained model.
        name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
        for name, shape in shapes.items()
    }
    save_file(sd, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(SYNTHETIC_CONFIG, indent=2))


def make_grid(args: argparse.Namespace) -> list[GridPoint]:
    decode = [GridPoint("decode", b, 1, c) for c in args.context_len for b in args.batch_sizes]
    verify = [
        GridPoint("verify", r, 1 + lv, c)
        for c in args.context_len
        for r in args.num_reqs
        for lv in args.verify_lens
    ]
    return decode + verify


def profile(
    model_path: str, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], tuple[int, ...], str]:
    """(target forward points, drafter points: one drafting pass per R, empty without a
    drafter; the token counts the target's forward executes at, the runner's row tiers; what
    multiplied its fp32 weights, ModelRunner.cpu_gemm)."""
    points = make_grid(args)
    page_size = CacheConfig().page_size
    # Size the pool to the largest point exactly: the default byte budget may be too small for a
    # big grid, and a larger pool only costs memory (timing does not depend on the pool size).
    cache_cfg = CacheConfig(page_size=page_size, num_blocks=blocks_needed(points, page_size))
    # Check the length limit before the runner allocates a KV pool sized for it.
    limit = ArchConfig.from_model_path(model_path).max_position_embeddings
    longest = max(args.context_len) + 1 + max(args.verify_lens)
    if longest > limit:
        raise ConfigError(
            f"--context-len {max(args.context_len)} plus {1 + max(args.verify_lens)} new tokens "
            f"exceeds the model's max_position_embeddings {limit}"
        )
    draft_cfg = (
        DraftConfig(path=args.draft_model_path, draft_dtype=args.draft_dtype)
        if args.draft_model_path
        else None
    )
    runner = ModelRunner(
        ModelConfig(model_path, dtype=args.dtype, device=args.device, cpu_gemm=args.cpu_gemm),
        cache_cfg,
        draft_cfg,
    )
    # The KV context is random, not a prefill of real tokens: attention cost does not depend on
    # the values, and random keys keep the attention and MoE routing away from degenerate zeros.
    kv_gen = torch.Generator(device=runner.device).manual_seed(SEED)
    for k, v in runner.kv:
        k.normal_(generator=kv_gen)
        v.normal_(generator=kv_gen)
    gen = torch.Generator().manual_seed(SEED)  # token ids, drawn on the host
    pool = BlockPool(runner.num_blocks, runner.page_size)
    warm_up(runner, pool, points[0], gen)
    rows = [
        time_point(runner, pool, p, args.repeats, args.warmup, gen)
        for p in tqdm(points, desc="profile", file=sys.stderr, disable=args.json)
    ]
    drafts = []
    if runner.drafter is not None:  # the capacity model's draft term: one pass per R
        ctx = max(args.context_len)  # the draft term is a curve over R only
        for r in sorted({*args.num_reqs, *args.batch_sizes}):
            secs = time_draft(runner, pool, r, ctx, args.repeats, args.warmup, gen)
            drafts.append({"R": r, "ctx": ctx, "median_s": secs})
    return rows, drafts, runner.row_tiers, runner.cpu_gemm


def _int_list(minimum: int) -> Callable[[str], tuple[int, ...]]:
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = [int(x) for x in text.split(",")]  # int() strips spaces, rejects ""
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers, got {text!r}"
            ) from None
        if min(values) < minimum:
            raise argparse.ArgumentTypeError(f"every value must be >= {minimum}, got {text!r}")
        return tuple(sorted(set(values)))

    return parse


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dspark_sglang.profile",
        description="Time target forward steps (decode and verify batches) vs batch tokens.",
    )

    p.add_argument(
        "--model-path",
        metavar="PATH",
        help=f"HF folder (config.json + safetensors); default: random {SYNTHETIC_NAME} "
        "(Qwen3-MoE, 4 layers, hidden 256, 8 experts top-2, vocab 4096)",
    )
    fmt = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else str(v)
    for flag, parse, what in (
        ("--batch-sizes", _int_list(1), "decode B = R list"),
        ("--verify-lens", _int_list(0), "verify draft lengths l"),
        ("--num-reqs", _int_list(1), "verify R list"),
        (
            "--context-len",
            _int_list(0),
            "tokens in KV per request (two or more fit the context term)",
        ),
        ("--repeats", _int_at_least(1), "timed forwards per point"),
        ("--warmup", _int_at_least(0), "untimed forwards per point"),
    ):
        key = flag[2:].replace("-", "_")
        p.add_argument(
            flag,
            metavar="LIST"
            if key in ("batch_sizes", "verify_lens", "num_reqs", "context_len")
            else "N",
            type=parse,
            help=f"{what} (default {fmt(FULL[key])}; --quick: {fmt(QUICK[key])})",
        )
    p.add_argument(
        "--quick", action="store_true", help="small grid (well under 30 s on 2 CPU cores)"
    )
    p.add_argument(
        "--draft-model-path",
        metavar="PATH",
        help="also time this drafter (one drafting pass per R; needs --model-path): the capacity "
        "model's draft term, written into --write-profile",
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV dtype")
    p.add_argument(
        "--draft-dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="the drafter's weights and context K/V (auto: --dtype, with bf16 products of 16 "
        "rows or more on a CPU with native bf16 under a float32 target)",
    )
    p.add_argument(
        "--cpu-gemm",
        choices=CPU_GEMMS,
        default="auto",
        help="fp32 products on the CPU: oneDNN on packed weights, or torch's MKL (auto: each "
        "product shape timed both ways at load, oneDNN for the rows it won); profile with the "
        "engine's setting",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON line to stdout")
    p.add_argument("--output", metavar="FILE", help="also write the JSON to this file")
    p.add_argument(
        "--write-profile",
        metavar="YAML",
        help="fit a capacity model to the points and write an engine_profiles YAML",
    )
    p.add_argument("--profile-name", help="name field of the written profile")
    p.add_argument("--gamma", type=_int_at_least(1), default=7, help="gamma recorded in it")
    p.add_argument(
        "--ep-size",
        type=_int_at_least(1),
        default=1,
        help="> 1: benchmark decode steps at EP=1 and EP=N with balanced and skewed routing, and "
        "the EP-aware capacity model's error (docs/ep.md)",
    )
    p.add_argument("--rounds", type=_int_at_least(1), default=4, help="--ep-size: timed rounds")
    p.add_argument("--plot", metavar="PNG", help="--ep-size: write the plot here")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    if args.ep_size > 1:
        preset = {**preset, **(EP_QUICK if args.quick else EP_FULL)}
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.model_path is not None and not Path(args.model_path).is_dir():
        p.error(f"argument --model-path: {args.model_path!r} is not a directory")
    if args.draft_model_path is not None:
        if args.model_path is None:
            p.error("argument --draft-model-path: needs --model-path (the drafter's target)")
        if not Path(args.draft_model_path).is_dir():
            p.error(f"argument --draft-model-path: {args.draft_model_path!r} is not a directory")
        if args.ep_size > 1:
            p.error("argument --draft-model-path: not supported with --ep-size")
    if args.ep_size > 1 and len(args.context_len) > 1:
        p.error("argument --context-len: --ep-size takes one context length")
    if args.output is not None and not Path(args.output).parent.is_dir():
        p.error(f"argument --output: directory of {args.output!r} does not exist")
    if args.write_profile is not None and not Path(args.write_profile).parent.is_dir():
        p.error(f"argument --write-profile: directory of {args.write_profile!r} does not exist")
    return args


def format_table(report: dict[str, Any]) -> str:
    hw = report["hardware"]
    lines = [
        f"model {report['model']}  dtype {report['dtype']}  device {report['device']}  "
        f"torch {report['torch']}  cpu {hw['cpu']} x{hw['num_threads']} threads",
        f"{'kind':<7}{'R':>5}{'tok/req':>8}{'B':>6}{'ctx':>6}"
        f"{'median ms':>11}{'p10 ms':>9}{'p90 ms':>9}{'tok/s':>10}",
    ]
    for pt in report["points"]:
        lines.append(
            f"{pt['kind']:<7}{pt['R']:>5}{pt['tokens_per_req']:>8}{pt['B']:>6}{pt['ctx']:>6}"
            f"{pt['median_s'] * 1e3:>11.2f}{pt['p10_s'] * 1e3:>9.2f}{pt['p90_s'] * 1e3:>9.2f}"
            f"{pt['B'] / pt['median_s']:>10.0f}"
        )
    for pt in report.get("draft_points", []):
        lines.append(
            f"{'draft':<7}{pt['R']:>5}{'':>8}{'':>6}{pt['ctx']:>6}{pt['median_s'] * 1e3:>11.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.ep_size > 1:
        from dspark_sglang.bench.ep import main as ep_main

        try:
            return ep_main(args, argv, write_synthetic_model)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        with tempfile.TemporaryDirectory(prefix="dspark-profile-") as tmp:
            model_path = args.model_path
            if model_path is None:
                write_synthetic_model(Path(tmp))
                model_path = tmp
            points, draft_points, tiers, gemm = profile(model_path, args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = {
        "tool": "dspark_sglang.profile",
        "model": args.model_path or SYNTHETIC_NAME,
        "dtype": args.dtype,
        "device": args.device,
        "torch": torch.__version__,
        "hardware": {
            "cpu": cpu_model(),
            "num_threads": torch.get_num_threads(),
            "cpu_gemm": gemm,
            # auto: per "KxN" weight shape, the rows from which oneDNN multiplied (null: never)
            **({"cpu_gemm_crossovers": measured_shapes()} if gemm == "auto" else {}),
        },
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "dspark_sglang.profile", *argv]),
        "points": points,
        "row_tiers": list(tiers),
    }
    if args.draft_model_path:
        report["drafter"] = args.draft_model_path
        dt, gemm = draft_precision(args.draft_dtype, torch_dtype(args.dtype), args.device)
        report["draft_dtype"] = str(dt).removeprefix("torch.") + (
            f" ({str(gemm).removeprefix('torch.')} products of >= 16 rows)" if gemm else ""
        )
        report["draft_points"] = draft_points
    if args.device.startswith("cuda"):
        report["hardware"]["gpu"] = torch.cuda.get_device_name(args.device)
    line = json.dumps(report)
    if args.output is not None:
        Path(args.output).write_text(line + "\n")
    if args.write_profile is not None:
        from dspark_sglang.capacity_profile import profile_from_report, save_profile

        name = args.profile_name or Path(args.write_profile).stem
        target = args.model_path or SYNTHETIC_NAME
        save_profile(
            profile_from_report(
                report, name=name, gamma=args.gamma, target=target, drafter=args.draft_model_path
            ),
            args.write_profile,
        )
    print(line if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
