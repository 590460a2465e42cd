"""The frozen configuration tree and the normalised HF architecture config.

Built once at the edge (CLIs, `LLM`) and passed down; every default lives here. Measured facts (KV
block count, capacity tables) are separate values returned by whoever measured them, never written
back. Imports nothing from the package.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration, model folder or request that cannot work; the message names the problem."""


@dataclass(frozen=True, slots=True)
class ArchConfig:
    """Geometry of a Qwen3 / Qwen3-MoE target, normalised from an HF `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    # MoE (Qwen3-MoE only; num_experts == 0 means dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.is_moe
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ArchConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(d.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if d.get("use_sliding_window"):
            raise ConfigError(
                "use_sliding_window=true is not supported; all layers are full attention"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"unsupported hidden_act {act!r}; only silu is implemented")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            out = cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                intermediate_size=int(d["intermediate_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(d),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                eos_token_ids=eos_ids,
                num_experts=_num_experts(d) if arch == "Qwen3MoeForCausalLM" else 0,
                num_experts_per_tok=int(d.get("num_experts_per_tok", 0)),
                moe_intermediate_size=int(d.get("moe_intermediate_size", 0)),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                decoder_sparse_step=int(d.get("decoder_sparse_step", 1) or 1),
                mlp_only_layers=tuple(int(x) for x in d.get("mlp_only_layers") or ()),
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None
        out.validate()
        return out

    @classmethod
    def from_model_path(cls, path: str | Path) -> ArchConfig:
        p = Path(path)
        if not p.is_dir():
            raise ConfigError(f"model path {str(p)!r} is not a directory")
        cfg = p / "config.json"
        if not cfg.is_file():
            raise ConfigError(f"model path {str(p)!r} has no config.json")
        try:
            d = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d)

    def validate(self) -> None:
        checks = [
            (
                self.num_attention_heads % self.num_key_value_heads == 0,
                "num_attention_heads must be a multiple of num_key_value_heads",
            ),
            (self.head_dim % 2 == 0, "head_dim must be even for RoPE"),
            (
                min(self.vocab_size, self.hidden_size, self.num_hidden_layers) > 0,
                "vocab_size, hidden_size and num_hidden_layers must be positive",
            ),
            (
                not self.is_moe or 0 < self.num_experts_per_tok <= self.num_experts,
                "num_experts_per_tok must be in [1, num_experts]",
            ),
            (
                not self.is_moe or self.moe_intermediate_size > 0,
                "moe_intermediate_size must be positive for a MoE model",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"invalid model config: {msg}")


def _arch_from_model_type(model_type: str | None) -> str | None:
    return {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}.get(model_type or "")


def _num_experts(d: dict[str, Any]) -> int:
    # transformers>=5 writes `num_local_experts`; earlier releases and the hub use `num_experts`.
    return int(d.get("num_experts", d.get("num_local_experts", 0)) or 0)


def _rope_theta(d: dict[str, Any]) -> float:
    # transformers>=5 moved rope settings into `rope_parameters`; older configs use `rope_theta`.
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(f"unsupported rope_type {rope_type!r}; only default RoPE is implemented")
    return float(params.get("rope_theta", d.get("rope_theta", 10000.0)))


CPU_GEMMS = ("auto", "onednn", "mkl")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    tap_layer_ids: tuple[int, ...] = ()  # DeepSpec semantics: id L = residual output of layer L
    attention_backend: str = "torch_sdpa"
    # fp32 products on the CPU: oneDNN on packed weights, or torch's default (MKL); auto = each
    # product shape timed both ways at load, oneDNN for the rows it won (models/cpu_gemm.py)
    cpu_gemm: str = "auto"
    # CPU engines: freed heap memory the process keeps mapped for the next step's temporaries
    # instead of returning it to the kernel and faulting it back in (engine/malloc_tuning.py;
    # glibc only; 0 = glibc's defaults)
    cpu_malloc_keep_mib: int = 256

    def __post_init__(self) -> None:
        if self.cpu_malloc_keep_mib < 0:
            raise ConfigError(f"--cpu-malloc-keep-mib must be >= 0, got {self.cpu_malloc_keep_mib}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ConfigError(f"--cpu-gemm must be one of {CPU_GEMMS}, got {self.cpu_gemm!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError("--max-model-len must be positive")
        if list(self.tap_layer_ids) != sorted(set(self.tap_layer_ids)):
            raise ConfigError("tap layer ids must be strictly increasing")


# "lowest": the lowest-numbered free block, so the live KV stays in one compact region of the
# pool; "fifo": the block freed longest ago, so a freed block's KV survives longest.
BLOCK_ORDERS = ("lowest", "fifo")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    page_size: int = 16
    kv_cache_bytes: int = 256 << 20  # memory budget for the target KV pool
    num_blocks: int | None = None  # overrides the budget when set (tests, profiling)
    block_order: str = "lowest"  # which free KV block a grow takes: BLOCK_ORDERS

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ConfigError("--page-size must be positive")
        if self.block_order not in BLOCK_ORDERS:
            raise ConfigError(
                f"--kv-block-order must be one of {BLOCK_ORDERS}, got {self.block_order!r}"
            )
        if self.kv_cache_bytes <= 0 and self.num_blocks is None:
            raise ConfigError("--kv-cache-bytes must be positive")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError("--num-blocks must be positive")


@dataclass(frozen=True, slots=True)
class SchedConfig:
    max_running_requests: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one forward (prefill chunks + decodes)
    chunked_prefill_size: int = 512  # largest prefill chunk of one request in one step

    def __post_init__(self) -> None:
        if self.max_running_requests <= 0:
            raise ConfigError("--max-running-requests must be positive")
        if self.max_num_batched_tokens < self.max_running_requests:
            raise ConfigError("--max-num-batched-tokens must be >= --max-running-requests")
        if self.chunked_prefill_size <= 0:
            raise ConfigError("--chunked-prefill-size must be positive")


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """Speculative decoding: which drafter, how many tokens it drafts, how many get verified."""

    path: str | None = None  # DeepSpec-layout drafter folder; None = no speculation
    speculative_algorithm: str = "dspark"  # dspark | none (plain decoding of the same target)
    num_speculative_tokens: int | None = None  # gamma; None = the drafter's block size
    schedule_mode: str = "verify-all"
    capacity_profile: str | None = None  # engine_profiles YAML; None = profile at start-up
    startup_profile_seconds: float = 60.0  # bound on start-up capacity profiling
    # rounds of the start-up grid at most, each point priced at its median over them (the
    # budget above permitting; 1 = one pass, as before 2026-12-04)
    startup_profile_rounds: int = 5
    live_capacity: bool = True  # refit the capacity model from every step's timing
    # price a step at the token count its forward executes (the runner's row tiers: the packed
    # CPU products pad their rows to a grid), not at its own; applies to a profile without
    # buckets of its own and to start-up profiling (docs/capacity.md "Row tiers")
    capacity_tiers: bool = True
    min_user_tps: float = 0.0  # SLA floor on each request's expected tokens/s (0 = off)
    # lagged mode: a K must keep every request's expected tokens/s at or above this fraction of
    # what a plain step gives it (0 = off; 1 = speculation never slows a request it does not
    # pay for). A drafting step lasts longer for the whole batch, and a request whose drafts are
    # rejected (or not drafted) pays that without the tokens: under load those fall behind.
    user_rate_floor: float = 0.0
    # lagged mode: plan the next step's K on a worker thread while this step runs. None = where
    # that hides anything: CUDA, whose kernels run while the host plans. A CPU forward is the host
    # itself: the thread only contends with it (in-process, c = 1-8, steps ran 0-2.1 ms slower
    # with the thread than without over two A/B runs, docs/scheduler.md).
    overlap: bool | None = None
    # lagged mode: draft only the requests the step's K admits, pricing the drafter by its rows.
    # Where the drafter's cost grows with its batch (CPU; a compute-bound GPU drafter at large R)
    # a few confident requests can pay for drafting when the whole batch does not.
    selective_draft: bool = True
    # selective lagged with live capacity: draft the whole batch at an R whose drafter price no
    # drafting step has tested while it is priced within this share of the best plan (0 = never;
    # docs/scheduler.md "Exploring an untested drafter price")
    explore_ratio: float = 0.75
    # ... while what exploration lost so far is at most this share of the decode time (a burst in
    # progress finishes; 1 = no cap; docs/scheduler.md "The exploration budget")
    explore_budget: float = 0.01
    # lagged mode: a drafting K widens to the largest K whose predicted Θ is within this share of
    # the best (0 = the argmax; docs/scheduler.md "Near ties")
    tie_margin: float = 0.0
    # lagged mode: K reads a lagged survival row's departure from the average row only as far as
    # such departures held up lag steps later (algo.survival.LagShrink, learned from verified
    # drafts and reported in the planner's state). Off: A/B runs on the CPU engine measured no
    # difference (docs/scheduler.md "How much of a lagged row holds up").
    lag_shrink: bool = False
    # lagged mode: the K search multiplies a drafting plan's seconds by how far drafting steps at
    # that R ran over their predicted seconds, less how far plain steps did (algo.step_bias)
    step_bias: bool = True
    # ... and until both kinds were measured at an R, assumes drafting steps run this fraction
    # over their prediction relative to plain steps (0 = none; the value and its evidence are
    # algo.step_bias.DEFAULT_PRIOR's, which config may not import)
    step_bias_prior: float = 0.04
    # lagged mode: a drafting plan that leaves a run of plain steps is charged the projection of
    # the context rows that run queued, spread over the steps its requests have left
    # (engine/planner.py RESUME_HORIZON)
    resume_charge: bool = True
    # live capacity: pseudo-records holding the drafter's price at each R at the start-up
    # profile's while drafting steps there are few (algo.capacity_fit.EstimatorConfig; the
    # profile times the drafter alone, a drafting step adds its bookkeeping: docs/capacity.md)
    draft_price_prior_weight: float = 8.0
    # lagged mode, K planned inline (overlap off): once two K searches in a row chose the same K
    # for the same batch, drafting every row, search again only every this many steps; the steps
    # between take that K, and only the one whose survival the next search reads learns
    # acceptance (docs/scheduler.md "A pinned K"). 1 = a search every step.
    replan_every: int = 8
    # The drafter's weights and context K/V. auto = the target's dtype, except that an fp32
    # target on a CPU with native bf16 matrix instructions gets bf16 products of 16 rows or more
    # (4-5x faster GEMMs there: served drafter 44.4 -> 28.1 ms a pass at R = 64; docs/engine.md).
    # Any precision is lossless: the verifier divides by the q the drafts were drawn from.
    draft_dtype: str = "auto"
    # A prefill worker's engine: the drafter only projects the handoffs' context C (its fc and
    # norm); it never drafts, so no drafter K/V pool is allocated and the whole KV budget goes
    # to the target (the bundled pair: 1.5x the target blocks). Requests must be prefill-only.
    context_only: bool = False

    def __post_init__(self) -> None:
        if self.draft_dtype not in ("auto", *DTYPES):
            raise ConfigError(
                f"--draft-dtype must be one of {('auto', *DTYPES)}, got {self.draft_dtype!r}"
            )
        if self.min_user_tps < 0:
            raise ConfigError("--min-user-tps must be >= 0")
        if not 0.0 <= self.user_rate_floor <= 1.0:
            raise ConfigError(f"--user-rate-floor must be in [0, 1], got {self.user_rate_floor}")
        if not (
            math.isfinite(self.draft_price_prior_weight) and self.draft_price_prior_weight >= 0
        ):
            raise ConfigError(
                "--draft-price-prior-weight must be a finite number >= 0, "
                f"got {self.draft_price_prior_weight}"
            )
        if not 0.0 <= self.explore_ratio <= 1.0:
            raise ConfigError(f"--explore-ratio must be in [0, 1], got {self.explore_ratio}")
        if not 0.0 <= self.explore_budget <= 1.0:  # also refuses NaN
            raise ConfigError(f"--explore-budget must be in [0, 1], got {self.explore_budget}")
        if not (math.isfinite(self.tie_margin) and 0.0 <= self.tie_margin < 1.0):
            raise ConfigError(f"--plan-tie-margin must be in [0, 1), got {self.tie_margin}")
        if not (math.isfinite(self.step_bias_prior) and -0.5 < self.step_bias_prior < 1.0):
            raise ConfigError(f"--step-bias-prior must be in (-0.5, 1), got {self.step_bias_prior}")
        if self.replan_every < 1:
            raise ConfigError(f"--lagged-replan-every must be >= 1, got {self.replan_every}")
        if self.startup_profile_seconds <= 0:
            raise ConfigError("--startup-profile-seconds must be positive")
        if self.startup_profile_rounds < 1:
            raise ConfigError(
                f"--startup-profile-rounds must be >= 1, got {self.startup_profile_rounds}"
            )
        if self.speculative_algorithm not in ("dspark", "none"):
            raise ConfigError(
                "--speculative-algorithm must be 'dspark' or 'none', "
                f"got {self.speculative_algorithm!r}"
            )
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ConfigError("--num-speculative-tokens must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.path is not None and self.speculative_algorithm == "dspark"


@dataclass(frozen=True, slots=True)
class Config:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    seed: int = 0
    serve: ServeConfig = field(default_factory=lambda: ServeConfig())
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig())


MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True, slots=True)
class DraftArch:
    """A DeepSpec DSpark/DFlash drafter config (deepspec_spec.md §1.8): target geometry + extras."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int = 0  # 0 = DFlash variant (no sequential head)
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = True
    attention_bias: bool = False

    @property
    def kind(self) -> str:
        return "dspark" if self.markov_rank > 0 else "dflash"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DraftArch:
        arch = (d.get("architectures") or ["?"])[0]
        if arch not in ("Qwen3DSparkModel", "DSparkDraftModel"):
            raise ConfigError(
                f"drafter config.json has architecture {arch!r}; expected 'Qwen3DSparkModel'"
            )
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            rank = int(d.get("markov_rank", 0) or 0)
            out = cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                intermediate_size=int(d["intermediate_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(d),
                block_size=int(d["block_size"]),
                mask_token_id=int(d["mask_token_id"]),
                target_layer_ids=tuple(int(x) for x in d["target_layer_ids"]),
                markov_rank=rank,
                markov_head_type=str(d.get("markov_head_type") or "vanilla"),
                confidence_head=bool(d.get("enable_confidence_head", False)),
                confidence_with_markov=bool(d.get("confidence_head_with_markov", rank > 0)),
                attention_bias=bool(d.get("attention_bias", False)),
            )
        except KeyError as e:
            raise ConfigError(f"drafter config.json is missing field {e.args[0]!r}") from None
        out.validate()
        return out

    def validate(self) -> None:
        checks = [
            (self.block_size >= 1, "block_size must be >= 1"),
            (0 <= self.mask_token_id < self.vocab_size, "mask_token_id must be a valid token id"),
            (len(self.target_layer_ids) > 0, "target_layer_ids must not be empty"),
            (
                list(self.target_layer_ids) == sorted(set(self.target_layer_ids)),
                "target_layer_ids must be strictly increasing",
            ),
            (
                self.markov_head_type in MARKOV_HEAD_TYPES,
                f"markov_head_type must be one of {MARKOV_HEAD_TYPES}",
            ),
            (
                self.num_attention_heads % self.num_key_value_heads == 0,
                "num_attention_heads must be a multiple of num_key_value_heads",
            ),
            (
                not (
                    self.confidence_with_markov and self.confidence_head and self.markov_rank == 0
                ),
                "confidence_head_with_markov needs markov_rank > 0",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(f"invalid drafter config: {msg}")

    def check_target(self, target: ArchConfig) -> None:
        """The drafter shares the target's embedding, LM head and feature width."""
        pairs = [
            ("vocab_size", self.vocab_size, target.vocab_size),
            ("hidden_size", self.hidden_size, target.hidden_size),
        ]
        for name, mine, theirs in pairs:
            if mine != theirs:
                raise ConfigError(f"drafter {name}={mine} does not match the target's {theirs}")
        for lid in self.target_layer_ids:
            if not -1 <= lid < target.num_hidden_layers - 1:
                raise ConfigError(
                    f"drafter target_layer_ids contains {lid}; valid taps are -1..."
                    f"{target.num_hidden_layers - 2} (the final layer is excluded, as in DeepSpec)"
                )


def is_loopback_addr(addr: str) -> bool:
    """ipc://, inproc:// and tcp:// on 127.0.0.0/8 or ::1 never leave the host."""
    scheme, _, rest = addr.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    return scheme == "tcp" and (host in ("localhost", "::1") or host.startswith("127."))


def parse_cpu_list(text: str, flag: str) -> tuple[int, ...]:
    """`0-3,8` -> (0, 1, 2, 3, 8), sorted and unique; ConfigError naming `flag`."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ConfigError(
                f"{flag} {text!r}: expected CPU ids and ranges such as 0-3,8, got {part!r}"
            ) from None
        if first < 0 or last < first:
            raise ConfigError(f"{flag} {text!r}: bad CPU range {part.strip()!r}")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: tuple[int, ...] | list[int] | set[int]) -> str:
    """(0, 1, 2, 3, 8) -> `0-3,8` (what parse_cpu_list reads back)."""
    out: list[str] = []
    ids = sorted(set(cpus))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Serving processes: HTTP front, ZMQ addresses, flow control, heartbeats, peer security."""

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the model folder's name
    api_addr: str = "tcp://127.0.0.1:30100"  # the router's inbox (token deltas, heartbeats)
    prefill_addrs: tuple[str, ...] = ("tcp://127.0.0.1:30101",)
    decode_addrs: tuple[str, ...] = ("tcp://127.0.0.1:30102",)
    curve_dir: str | None = None  # holds cluster.key_secret (CurveZMQ); required off-host
    hmac_key_file: str | None = None  # shared secret; the alternative to CurveZMQ
    max_pending_requests: int = 256  # router in-flight cap; beyond it: 429 + Retry-After
    request_timeout_s: float = 600.0
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    max_retries: int = 2  # re-dispatches of a request that has not emitted a token yet
    max_message_bytes: int = 1 << 30  # larger ZMQ messages are dropped by the receiver
    # each worker appends its StepRecords to DIR/<worker>.steps.jsonl (--step-log)
    step_log_dir: str | None = None
    # CPU affinity (Linux): the router's CPUs, and the prefill / decode workers' (one set for
    # every worker of the role, or one per worker, in address order); () = the launcher's own.
    # A CPU engine's step is its host's CPU time: a decode worker sharing cores with the router,
    # the prefill worker and a load generator runs each step at whatever the others leave it.
    router_cpus: tuple[int, ...] = ()
    prefill_cpus: tuple[tuple[int, ...], ...] = ()
    decode_cpus: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        addrs = (self.api_addr, *self.prefill_addrs, *self.decode_addrs)
        if not self.prefill_addrs or not self.decode_addrs:
            raise ConfigError("at least one prefill and one decode address are required")
        if len(set(addrs)) != len(addrs):
            raise ConfigError(f"ZMQ addresses must be distinct, got {addrs}")
        bad = [a for a in addrs if a.partition("://")[0] not in ("tcp", "ipc", "inproc")]
        if bad:
            raise ConfigError(f"ZMQ addresses must be tcp://, ipc:// or inproc://, got {bad}")
        remote = [a for a in addrs if not is_loopback_addr(a)]
        if remote and not (self.curve_dir or self.hmac_key_file):
            raise ConfigError(
                f"ZMQ addresses {remote} leave this host: pass --zmq-curve-dir or "
                "--zmq-hmac-key-file so peers authenticate"
            )
        if self.curve_dir and self.hmac_key_file:
            raise ConfigError("pass one of --zmq-curve-dir and --zmq-hmac-key-file, not both")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ConfigError("need 0 < --heartbeat-interval < --heartbeat-timeout")
        if self.max_pending_requests <= 0 or self.request_timeout_s <= 0:
            raise ConfigError("--max-pending-requests and --request-timeout must be positive")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        for role, sets, addrs in (
            ("prefill", self.prefill_cpus, self.prefill_addrs),
            ("decode", self.decode_cpus, self.decode_addrs),
        ):
            if len(sets) not in (0, 1, len(addrs)):
                raise ConfigError(
                    f"--{role}-cpus: give one CPU list for every {role} worker or one per "
                    f"worker ({len(addrs)}, separated by ';'), got {len(sets)}"
                )
        for flag, sets in (
            ("--router-cpus", (self.router_cpus,) if self.router_cpus else ()),
            ("--prefill-cpus", self.prefill_cpus),
            ("--decode-cpus", self.decode_cpus),
        ):
            if any(not cpus or min(cpus) < 0 for cpus in sets):
                raise ConfigError(f"{flag}: each CPU list needs at least one CPU id >= 0")

    def cpus_for(self, role: str, index: int = 0) -> tuple[int, ...]:
        """The CPUs `role` (router, prefill or decode) worker `index` is pinned to; () = none."""
        if role == "router":
            return self.router_cpus
        sets = self.prefill_cpus if role == "prefill" else self.decode_cpus
        if not sets:
            return ()
        return sets[0] if len(sets) == 1 else sets[index]


DIST_BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Expert parallelism of the reference engine: `ep_size` processes on this host, each owning a
    contiguous 1/ep_size of every MoE layer's experts; attention is replicated (docs/ep.md)."""

    ep_size: int = 1
    dist_backend: str = "auto"  # auto: gloo on CPU, nccl on CUDA
    ep_timeout_s: float = 60.0  # a collective inside a step that waits longer fails the engine
    exit_on_rank_failure: bool = False  # serving: a dead rank ends the worker process at once

    def __post_init__(self) -> None:
        if self.ep_size < 1:
            raise ConfigError(f"--ep-size must be >= 1, got {self.ep_size}")
        if self.dist_backend not in DIST_BACKENDS:
            raise ConfigError(
                f"dist_backend must be one of {DIST_BACKENDS}, got {self.dist_backend!r}"
            )
        if self.ep_timeout_s <= 0:
            raise ConfigError("ep_timeout_s must be positive")

    def check_arch(self, arch: ArchConfig) -> None:
        """Expert parallelism needs a MoE target whose experts split evenly over the ranks."""
        if self.ep_size == 1:
            return
        if not arch.is_moe:
            raise ConfigError(f"--ep-size {self.ep_size} needs a MoE target; this one is dense")
        if arch.num_experts % self.ep_size:
            raise ConfigError(
                f"--ep-size {self.ep_size} must divide the target's num_experts {arch.num_experts}"
            )
