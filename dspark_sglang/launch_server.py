"""`python -m dspark_sglang.launch_server`: flags (DESIGN §7) -> Config -> serve.launch.

With no model flags it serves the bundled tiny model and its DSpark drafter.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from dspark_sglang.algo.verify_budget import parse_schedule_mode
from dspark_sglang.assets import ASSETS_DIR, bundled_target_dir
from dspark_sglang.config import (
    BLOCK_ORDERS,
    CPU_GEMMS,
    DTYPES,
    ArchConfig,
    CacheConfig,
    Config,
    ConfigError,
    DraftConfig,
    ModelConfig,
    ParallelConfig,
    SchedConfig,
    ServeConfig,
    parse_cpu_list,
)

BUNDLED_DRAFTER = ASSETS_DIR / "drafters" / "dspark"


def _defaults(cls: type) -> argparse.Namespace:
    """Field defaults of a slots dataclass (its class attributes are slot descriptors)."""
    return argparse.Namespace(**{f.name: f.default for f in dataclasses.fields(cls)})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dspark_sglang.launch_server",
        description="OpenAI-compatible DSpark server: router + prefill/decode workers over ZMQ.",
    )
    a = p.add_argument
    a(
        "--role",
        choices=("all", "router", "prefill", "decode"),
        default="all",
        help="all = router + every worker on this host (default)",
    )
    a("--worker-index", type=int, default=0, help="which prefill/decode address this worker binds")
    a("--model-path", help="HF model folder (default: the bundled tiny model)")
    a(
        "--draft-model-path",
        help="DeepSpec drafter folder (default with the bundled model: its bundled DSpark drafter)",
    )
    dc = _defaults(DraftConfig)
    a("--served-model-name", help="model id in the API (default: the model folder's name)")
    a("--engine", choices=("reference", "sglang"), default="reference")
    a("--speculative-algorithm", choices=("dspark", "none"), default="dspark")
    a("--num-speculative-tokens", type=int, help="gamma (default: the drafter's block size)")
    a(
        "--schedule-mode",
        # Serving defaults to the paper's production policy (DESIGN §3): lagged top-K, K planned
        # during the previous step. The offline LLM keeps verify-all, which needs no profile.
        default="lagged",
        help="lagged|sync|verify-all|fixed:N|threshold:C|mtp1 (default: lagged)",
    )
    a(
        "--capacity-profile",
        help="engine_profiles YAML (default: profile at start-up in the lagged and sync modes)",
    )
    a("--startup-profile-seconds", type=float, default=dc.startup_profile_seconds)
    a(
        "--startup-profile-rounds",
        type=int,
        default=dc.startup_profile_rounds,
        help="rounds of the start-up grid at most, each point priced at its median over them "
        f"(default {dc.startup_profile_rounds}; 1 = one pass)",
    )
    a(
        "--disable-capacity-tiers",
        dest="capacity_tiers",
        action="store_false",
        help="price each step at its own token count, not at the row tier the CPU engine's "
        "packed products pad it to (default: the tiers, where the engine has them)",
    )
    a("--min-user-tps", type=float, default=dc.min_user_tps, help="per-request tokens/s floor")
    a(
        "--user-rate-floor",
        type=float,
        default=dc.user_rate_floor,
        help="lagged: keep every request's expected tokens/s at or above this fraction of a "
        "plain step's (0 = off, 1 = speculation never slows a request; docs/scheduler.md)",
    )
    ov = p.add_mutually_exclusive_group()
    ov.add_argument(
        "--enable-overlap-schedule",
        dest="overlap",
        action="store_const",
        const=True,
        help="lagged mode: plan the next step's K on a thread while this step runs "
        "(default on CUDA devices only)",
    )
    ov.add_argument(
        "--disable-overlap-schedule",
        dest="overlap",
        action="store_const",
        const=False,
        help="lagged mode: plan each step's K after the previous step, not during it",
    )
    a(
        "--disable-selective-draft",
        dest="selective_draft",
        action="store_false",
        help="lagged mode: when K > 0, draft every request (default: only those K admits, "
        "the drafter priced by its rows)",
    )
    a(
        "--explore-ratio",
        type=float,
        default=dc.explore_ratio,
        help="lagged mode: draft the whole batch where the drafter's price at that batch size is "
        "untested and priced within this share of the best plan (0 = never; default %(default)s)",
    )
    a(
        "--explore-budget",
        type=float,
        default=dc.explore_budget,
        help="lagged mode: start such exploration only while what it lost so far, against plain "
        "steps, is at most this share of the decode time (1 = no cap; default %(default)s)",
    )
    a(
        "--plan-tie-margin",
        dest="tie_margin",
        type=float,
        default=dc.tie_margin,
        help="lagged mode: when the best K drafts, take the largest K whose predicted tokens/s is "
        "within this share of the best (0 = the argmax; default %(default)s)",
    )
    a(
        "--lagged-replan-every",
        dest="replan_every",
        type=int,
        default=dc.replan_every,
        help="lagged mode, K planned inline: once two K searches in a row chose the same K for "
        "the same batch (drafting every row), take it without a search for the next N - 1 steps, "
        "learning acceptance only on the one the next search reads; likewise K = 0 for batches "
        "of one size bin under the same lagged snapshot (1 = a search every step; "
        "default %(default)s)",
    )
    a(
        "--enable-lag-shrink",
        dest="lag_shrink",
        action="store_true",
        help="lagged mode: plan K from lagged confidences pulled toward the average row by how "
        "far such departures held up lag steps later, learned live (default: face value)",
    )
    a(
        "--disable-step-bias",
        dest="step_bias",
        action="store_false",
        help="lagged mode: price drafting and plain steps by the capacity model alone, without "
        "the live correction of its error on drafting steps over plain ones (default: on)",
    )
    a(
        "--step-bias-prior",
        type=float,
        default=dc.step_bias_prior,
        metavar="FRACTION",
        help="lagged mode: until drafting and plain steps at a batch size were both measured, "
        "assume drafting steps run this fraction over the capacity model's price relative to "
        "plain ones, shrunk away as they are (0 = the model's prices; default %(default)s)",
    )
    a(
        "--draft-price-prior-weight",
        type=float,
        default=dc.draft_price_prior_weight,
        metavar="RECORDS",
        help="live capacity: how many drafting steps' worth of weight the start-up profile's "
        "drafter price keeps at each batch size against the drafting steps measured there "
        "(default %(default)s)",
    )
    a(
        "--disable-resume-charge",
        dest="resume_charge",
        action="store_false",
        help="lagged mode: do not charge a drafting plan that leaves a run of plain steps for "
        "projecting the context rows that run queued (default: charged, spread over the steps "
        "its requests have left)",
    )
    a(
        "--ep-size",
        type=int,
        default=1,
        help="expert-parallel processes per worker, each owning 1/N of the experts (MoE targets)",
    )
    a("--dtype", choices=DTYPES, default="float32")
    a(
        "--draft-dtype",
        choices=("auto", *DTYPES),
        default=dc.draft_dtype,
        help="the drafter's weights and context K/V (auto: --dtype, with bf16 products of 16 "
        "rows or more on a CPU with native bf16 under a float32 target)",
    )
    a(
        "--cpu-gemm",
        choices=CPU_GEMMS,
        default=_defaults(ModelConfig).cpu_gemm,
        help="fp32 products on the CPU: oneDNN on weights packed at load, or torch's MKL "
        "(auto: each product shape timed both ways at load, oneDNN for the rows it won)",
    )
    a(
        "--cpu-malloc-keep-mib",
        type=int,
        default=_defaults(ModelConfig).cpu_malloc_keep_mib,
        metavar="MIB",
        help="CPU engines (glibc): freed heap memory kept mapped for the next step's "
        "temporaries instead of being returned to the kernel and faulted back in; 0 = glibc's "
        "defaults (default %(default)s)",
    )
    a("--device", default="cpu")
    a("--max-model-len", type=int)
    a("--page-size", type=int, default=_defaults(CacheConfig).page_size)
    a("--kv-cache-bytes", type=int, default=_defaults(CacheConfig).kv_cache_bytes)
    a("--num-blocks", type=int)
    a(
        "--kv-block-order",
        choices=BLOCK_ORDERS,
        default=_defaults(CacheConfig).block_order,
        help="which free KV block a request takes: lowest (the live KV stays compact; "
        "default) or fifo (the one freed longest ago)",
    )
    sc = _defaults(SchedConfig)
    a("--max-running-requests", type=int, default=sc.max_running_requests)
    a("--max-num-batched-tokens", type=int, default=sc.max_num_batched_tokens)
    a("--chunked-prefill-size", type=int, default=sc.chunked_prefill_size)
    a("--seed", type=int, default=0)
    s = _defaults(ServeConfig)
    a("--host", default=s.host, help="HTTP bind address")
    a("--port", type=int, default=s.port, help="HTTP port")
    a("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health")
    a("--num-prefill-workers", type=int, default=1)
    a("--num-decode-workers", type=int, default=1)
    cpus = "CPU ids and ranges, e.g. 0-3,8"
    a("--router-cpus", help=f"pin the router (HTTP front) to these CPUs ({cpus}; Linux)")
    a(
        "--prefill-cpus",
        help=f"pin the prefill workers to these CPUs ({cpus}): one list for all of them, or one "
        "per worker separated by ';' (Linux; default: the launcher's CPUs)",
    )
    a("--decode-cpus", help="pin the decode workers to these CPUs, as --prefill-cpus")
    a("--zmq-host", default="127.0.0.1", help="host of the derived ZMQ addresses")
    a(
        "--zmq-port",
        type=int,
        default=30100,
        help="first port of the derived ZMQ addresses: "
        "router, then prefill workers, then decode workers",
    )
    a("--zmq-api-addr", help="router inbox, e.g. tcp://10.0.0.1:30100 (overrides the derived)")
    a("--zmq-prefill-addrs", help="comma-separated prefill worker addresses")
    a("--zmq-decode-addrs", help="comma-separated decode worker addresses")
    a("--zmq-curve-dir", help="folder with the CurveZMQ cluster certificate")
    a("--zmq-hmac-key-file", help="file holding a shared secret that signs every ZMQ message")
    a("--gen-curve-keys", metavar="DIR", help="write a new cluster certificate to DIR and exit")
    a("--max-pending-requests", type=int, default=s.max_pending_requests)
    a("--request-timeout", type=float, default=s.request_timeout_s, help="seconds")
    a("--heartbeat-interval", type=float, default=s.heartbeat_interval_s, help="seconds")
    a("--heartbeat-timeout", type=float, default=s.heartbeat_timeout_s, help="seconds")
    a(
        "--step-log",
        metavar="DIR",
        help="each worker appends one JSON line per engine step (batch, K, timings, predicted "
        "time) to DIR/<worker>.steps.jsonl",
    )
    a("--sglang-config", help="--engine sglang: deployment YAML (launch/sglang_*.yaml)")
    a("--node-rank", type=int, default=0, help="--engine sglang: this node's rank in its server")
    a("--dry-run", action="store_true", help="--engine sglang: print the commands, start nothing")
    return p


def _addrs(args: argparse.Namespace) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    base, host = args.zmq_port, args.zmq_host
    n_pre, n_dec = args.num_prefill_workers, args.num_decode_workers
    if n_pre < 1 or n_dec < 1:
        raise ConfigError("--num-prefill-workers and --num-decode-workers must be >= 1")
    pre = tuple(f"tcp://{host}:{base + 1 + i}" for i in range(n_pre))
    dec = tuple(f"tcp://{host}:{base + 1 + n_pre + i}" for i in range(n_dec))
    split = lambda v: tuple(x.strip() for x in v.split(",") if x.strip())
    return (
        args.zmq_api_addr or f"tcp://{host}:{base}",
        split(args.zmq_prefill_addrs) if args.zmq_prefill_addrs else pre,
        split(args.zmq_decode_addrs) if args.zmq_decode_addrs else dec,
    )


def _cpu_sets(text: str | None, flag: str) -> tuple[tuple[int, ...], ...]:
    """`0-1;2-3` -> one CPU set per worker; each id must name a CPU of this host."""
    if text is None:
        return ()
    sets = tuple(parse_cpu_list(part, flag) for part in text.split(";"))
    have = os.cpu_count() or 1
    bad = sorted({c for cpus in sets for c in cpus if c >= have})
    if bad:
        raise ConfigError(f"{flag} {text!r}: CPU ids {bad} do not exist (this host has {have})")
    return sets


def config_from_args(args: argparse.Namespace) -> Config:
    if args.engine == "sglang":
        raise ConfigError("--engine sglang: main() hands it to dspark_sglang.sglang_launch")
    if args.speculative_algorithm == "dspark":  # here, not in a worker that dies at start-up
        parse_schedule_mode(args.schedule_mode)
    if args.capacity_profile is not None and not Path(args.capacity_profile).is_file():
        raise ConfigError(f"--capacity-profile {args.capacity_profile} does not exist")
    model, draft = args.model_path, args.draft_model_path
    if model is None:
        model = str(bundled_target_dir())
        if not (Path(model) / "config.json").is_file():
            raise ConfigError(f"the bundled model is not installed at {model}; pass --model-path")
        if draft is None and (BUNDLED_DRAFTER / "config.json").is_file():
            draft = str(BUNDLED_DRAFTER)
    if not (Path(model) / "config.json").is_file():
        raise ConfigError(f"--model-path {model}: no config.json there")
    if draft is not None and not (Path(draft) / "config.json").is_file():
        raise ConfigError(f"--draft-model-path {draft}: no config.json there")
    # A dead EP rank ends its worker at once, so the router sees a dead worker (docs/ep.md).
    parallel = ParallelConfig(ep_size=args.ep_size, exit_on_rank_failure=True)
    if parallel.ep_size > 1:
        try:
            arch = ArchConfig.from_model_path(model)
        except ConfigError as e:
            raise ConfigError(f"--ep-size {args.ep_size} needs a readable target: {e}") from None
        parallel.check_arch(arch)
    api, pre, dec = _addrs(args)
    router_cpus = _cpu_sets(args.router_cpus, "--router-cpus")
    if len(router_cpus) > 1:
        raise ConfigError(f"--router-cpus {args.router_cpus!r}: one CPU list (no ';')")
    return Config(
        model=ModelConfig(
            path=model,
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            cpu_gemm=args.cpu_gemm,
            cpu_malloc_keep_mib=args.cpu_malloc_keep_mib,
        ),
        cache=CacheConfig(
            page_size=args.page_size,
            kv_cache_bytes=args.kv_cache_bytes,
            num_blocks=args.num_blocks,
            block_order=args.kv_block_order,
        ),
        sched=SchedConfig(
            max_running_requests=args.max_running_requests,
            max_num_batched_tokens=args.max_num_batched_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
        ),
        draft=DraftConfig(
            path=draft,
            speculative_algorithm=args.speculative_algorithm,
            num_speculative_tokens=args.num_speculative_tokens,
            schedule_mode=args.schedule_mode,
            capacity_profile=args.capacity_profile,
            startup_profile_seconds=args.startup_profile_seconds,
            startup_profile_rounds=args.startup_profile_rounds,
            capacity_tiers=args.capacity_tiers,
            min_user_tps=args.min_user_tps,
            user_rate_floor=args.user_rate_floor,
            overlap=args.overlap,
            selective_draft=args.selective_draft,
            explore_ratio=args.explore_ratio,
            explore_budget=args.explore_budget,
            tie_margin=args.tie_margin,
            lag_shrink=args.lag_shrink,
            step_bias=args.step_bias,
            step_bias_prior=args.step_bias_prior,
            resume_charge=args.resume_charge,
            draft_price_prior_weight=args.draft_price_prior_weight,
            replan_every=args.replan_every,
            draft_dtype=args.draft_dtype,
        ),
        seed=args.seed,
        parallel=parallel,
        serve=ServeConfig(
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            api_addr=api,
            prefill_addrs=pre,
            decode_addrs=dec,
            curve_dir=args.zmq_curve_dir,
            hmac_key_file=args.zmq_hmac_key_file,
            max_pending_requests=args.max_pending_requests,
            request_timeout_s=args.request_timeout,
            heartbeat_interval_s=args.heartbeat_interval,
            heartbeat_timeout_s=args.heartbeat_timeout,
            step_log_dir=args.step_log,
            router_cpus=router_cpus[0] if router_cpus else (),
            prefill_cpus=_cpu_sets(args.prefill_cpus, "--prefill-cpus"),
            decode_cpus=_cpu_sets(args.decode_cpus, "--decode-cpus"),
        ),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.engine == "sglang":  # SGLang runs the engine; we generate and start its commands
        from dspark_sglang.sglang_launch import main as launch_sglang

        return launch_sglang(args)
    if args.gen_curve_keys:
        from dspark_sglang.serve.transport import generate_curve_keys

        generate_curve_keys(args.gen_curve_keys)
        print(f"wrote {args.gen_curve_keys}/cluster.key and cluster.key_secret")
        return 0
    try:
        cfg = config_from_args(args)
        from dspark_sglang.serve import launch
        from dspark_sglang.serve.transport import Security

        Security(cfg.serve)  # a missing key file fails here, before any process starts
        if args.role == "all":
            return launch.run_all(cfg)
        launch.run_role(cfg, args.role, args.worker_index)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
