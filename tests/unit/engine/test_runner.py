"""ModelRunner: the drafter's dtype (resolution, its own copies, handed-off context) and the
packed CPU products."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark_sglang import LLM, SamplingParams
from dspark_sglang.config import ConfigError, DraftConfig
from dspark_sglang.engine import runner as runner_mod
from dspark_sglang.engine.runner import draft_precision, native_bf16
from dspark_sglang.models.cpu_gemm import PackedLinear, row_tiers
from dspark_sglang.models.row_buckets import RowBucketedLinear
from tests.conftest import VOCAB, write_drafter, write_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    target = write_hf_model(root / "target", moe=True)
    return target, write_drafter(root / "drafter", target, block_size=5)


def test_native_bf16_reads_the_cpu_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert not native_bf16("cpu", str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n")
    assert native_bf16("cpu", str(info))
    info.write_text("flags\t\t: fpu amx_bf16 amx_tile\n")
    assert native_bf16("cpu", str(info))
    assert not native_bf16("cpu", str(tmp_path / "absent"))  # not Linux: keep the target's
    assert not native_bf16("cuda:0", str(info))  # GPUs: the target's dtype


def test_auto_draft_dtype_uses_bf16_products_only_under_fp32_on_native_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert draft_precision("float32", torch.bfloat16, "cpu") == (torch.float32, None)
    assert draft_precision("bfloat16", torch.float32, "cpu") == (torch.bfloat16, None)
    for native in (True, False):
        monkeypatch.setattr(runner_mod, "native_bf16", lambda device, n=native: n)
        assert draft_precision("auto", torch.float32, "cpu") == (
            (torch.float32, torch.bfloat16) if native else (torch.float32, None)
        )
        assert draft_precision("auto", torch.float16, "cpu") == (torch.float16, None)
    with pytest.raises(ConfigError, match="--draft-dtype"):
        DraftConfig(draft_dtype="fp8")


def test_auto_on_native_bf16_keeps_an_fp32_drafter_with_bf16_batched_products(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_mod, "native_bf16", lambda device: True)
    target, drafter = pair
    ps = [[(5 * i + j) % VOCAB for j in range(2 + i)] for i in range(8)]
    base = LLM(str(target), num_blocks=128, page_size=4).generate(ps, GREEDY)
    spec = LLM(str(target), draft_model=str(drafter), num_blocks=128, page_size=4)
    d = spec.runner.drafter
    assert d is not None and spec.runner.draft_gemm_dtype == torch.bfloat16
    assert {p.dtype for p in d.parameters()} == {torch.float32}
    assert d.lm_head.weight is spec.runner.model.lm_head.weight  # fp32: aliased as before
    linears = [m for m in d.modules() if isinstance(m, torch.nn.Linear)]
    assert all(type(m) is RowBucketedLinear for m in linears)
    assert all(m.low_weight is not None and m.low_weight.dtype == torch.bfloat16 for m in linears)
    outs = spec.generate(ps, GREEDY)  # 8 requests: batched products take the bf16 copies
    assert [o.output_ids for o in outs] == [o.output_ids for o in base]
    assert spec.stats.rounds > 0


def test_a_bf16_drafter_owns_bf16_copies_and_stays_lossless(pair: tuple[Path, Path]) -> None:
    """A bf16 drafter under an fp32 target: its own bf16 embedding and LM head (not the
    target's tensors), a bf16 context pool, and greedy output identical to plain decoding."""
    target, drafter = pair
    ps = [[(7 * i + j) % VOCAB for j in range(3 + i)] for i in range(6)]
    base = LLM(str(target), num_blocks=128, page_size=4).generate(ps, GREEDY)
    spec = LLM(
        str(target), draft_model=str(drafter), num_blocks=128, page_size=4, draft_dtype="bfloat16"
    )
    d, t = spec.runner.drafter, spec.runner.model
    assert d is not None and spec.runner.draft_dtype == torch.bfloat16
    assert {p.dtype for p in d.parameters()} == {torch.bfloat16}
    assert t.lm_head.weight.dtype == torch.float32
    assert d.lm_head.weight.data_ptr() != t.lm_head.weight.data_ptr()
    torch.testing.assert_close(d.lm_head.weight.float(), t.lm_head.weight, atol=1e-2, rtol=1e-2)
    assert all(k.dtype == torch.bfloat16 for kv in spec.runner.draft_kv for k in kv)
    linears = [m for m in d.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is RowBucketedLinear for m in linears)  # bounded kernels
    outs = spec.generate(ps, GREEDY)
    assert [o.output_ids for o in outs] == [o.output_ids for o in base]
    assert spec.stats.rounds > 0 and spec.stats.accepted > 0


def test_a_float32_drafter_keeps_plain_linears(pair: tuple[Path, Path]) -> None:
    target, drafter = pair
    spec = LLM(str(target), draft_model=str(drafter), num_blocks=16, draft_dtype="float32")
    assert spec.runner.drafter is not None
    assert all(type(m) is not RowBucketedLinear for m in spec.runner.drafter.modules())


def test_handed_off_fp32_context_is_written_in_the_drafters_dtype(pair: tuple[Path, Path]) -> None:
    """A prefill worker in another draft dtype hands off fp32 C: the decode side's bf16 pool
    gets exactly the K/V of C cast to bf16."""
    target, drafter = pair
    spec = LLM(
        str(target), draft_model=str(drafter), num_blocks=16, page_size=4, draft_dtype="bfloat16"
    )
    r = spec.runner
    assert r.drafter is not None
    c = torch.randn(5, r.drafter.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    pos, slots = torch.arange(5), torch.tensor([8, 9, 10, 11, 12])
    r.write_draft_context(c, pos, slots)
    want = r.drafter.context_kv(c.bfloat16(), pos)
    for (k_cache, v_cache), (k, v) in zip(r.draft_kv, want, strict=True):
        assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v)


def test_onednn_products_pack_target_and_drafter_and_stay_lossless(
    pair: tuple[Path, Path],
) -> None:
    """--cpu-gemm onednn: the target's linears and experts and the drafter's fp32 products are
    packed, and greedy speculative output equals plain decoding on the same products; mkl packs
    nothing. (The drafter in float32: on a CPU with native bf16, `--draft-dtype auto` gives its
    larger products to bf16 instead.)"""
    target, drafter = pair
    ps = [[(3 * i + j) % VOCAB for j in range(2 + i)] for i in range(6)]
    base = LLM(str(target), num_blocks=128, page_size=4, cpu_gemm="onednn").generate(ps, GREEDY)
    spec = LLM(
        str(target),
        draft_model=str(drafter),
        num_blocks=128,
        page_size=4,
        cpu_gemm="onednn",
        max_num_batched_tokens=96,
        draft_dtype="float32",
    )
    t, d = spec.runner.model, spec.runner.drafter
    assert d is not None
    assert type(t.lm_head) is PackedLinear and t.lm_head.gemm.max_rows == 96
    assert all(m.gemm is not None for m in t.modules() if hasattr(m, "pack_gemm"))
    assert all(
        getattr(m, "gemm", None) is not None for m in d.modules() if isinstance(m, torch.nn.Linear)
    )
    outs = spec.generate(ps, GREEDY)
    assert [o.output_ids for o in outs] == [o.output_ids for o in base]
    assert spec.stats.rounds > 0
    plain = LLM(str(target), draft_model=str(drafter), num_blocks=16, cpu_gemm="mkl")
    assert not any(isinstance(m, PackedLinear) for m in plain.runner.model.modules())
    assert spec.runner.row_tiers == row_tiers(96) and plain.runner.row_tiers == ()


@pytest.mark.parametrize("gemm, tiers", [("onednn", True), ("onednn", False), ("mkl", True)])
def test_the_planner_prices_the_tier_the_runner_executes(
    pair: tuple[Path, Path], gemm: str, tiers: bool
) -> None:
    """Start-up profiling: lagged's capacity model carries the runner's row tiers (a step of B
    tokens priced at the tier above B) unless --disable-capacity-tiers or nothing is packed; a
    profile with buckets of its own keeps them."""
    target, drafter = pair
    llm = LLM(
        str(target),
        draft_model=str(drafter),
        schedule_mode="lagged",
        num_blocks=64,
        page_size=4,
        cpu_gemm=gemm,
        capacity_tiers=tiers,
        max_running_requests=4,
        max_num_batched_tokens=64,
        startup_profile_seconds=1.0,
    )
    cap = llm.planner.capacity
    assert cap is not None
    want = row_tiers(64) if gemm == "onednn" and tiers else ()
    assert cap.form.buckets == want
    if want:  # 9-12 and 13-16 tokens each cost one price
        at = [float(cap.step_seconds(2, b, 200)) for b in range(9, 17)]
        assert len(set(at[:4])) == 1 and len(set(at[4:])) == 1
    else:
        assert llm.runner.row_tiers == (() if gemm == "mkl" else row_tiers(64))


def test_auto_packs_what_it_measured_faster_and_lays_out_the_rest_for_mkl(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--cpu-gemm auto: oneDNN takes the rows it measured faster on (here, by a stand-in timer:
    the LM heads at 2-15 rows), every other product reads a column-major weight through MKL,
    the forward keeps exact token counts (no row tiers), and greedy speculative output equals
    plain decoding."""
    from dspark_sglang.models import cpu_gemm

    def timer(k: int, n: int, rows: int, bias: bool) -> tuple[float, float]:
        return 1.0, (0.5 if n == VOCAB and rows <= 8 else 2.0)

    monkeypatch.setattr(cpu_gemm, "time_product", timer)
    monkeypatch.setattr(cpu_gemm, "_measured", {})
    target, drafter = pair
    ps = [[(7 * i + j) % VOCAB for j in range(3 + i)] for i in range(6)]
    base = LLM(str(target), num_blocks=128, page_size=4, cpu_gemm="mkl").generate(ps, GREEDY)
    spec = LLM(str(target), draft_model=str(drafter), num_blocks=128, page_size=4)
    t, d = spec.runner.model, spec.runner.drafter
    assert d is not None and spec.runner.cpu_gemm == "auto"
    assert type(t.lm_head) is PackedLinear
    assert (t.lm_head.gemm.min_rows, t.lm_head.gemm.max_rows) == (2, 15)
    attn = t.model.layers[0].self_attn
    assert (
        type(attn.q_proj) is torch.nn.Linear and attn.q_proj.weight.transpose(0, 1).is_contiguous()
    )
    assert all(m.gemm is None for m in t.modules() if hasattr(m, "pack_gemm"))
    assert spec.runner.row_tiers == ()
    assert cpu_gemm.measured_shapes()[f"64x{VOCAB}"] == [2, 15]
    outs = spec.generate(ps, GREEDY)
    assert [o.output_ids for o in outs] == [o.output_ids for o in base]
    assert spec.stats.rounds > 0


def test_mkl_products_read_column_major_weights_and_stay_lossless(pair: tuple[Path, Path]) -> None:
    """--cpu-gemm mkl: the target's and the drafter's fp32 linears, router and experts are laid
    out column-major (models/weight_layout.py), the tied LM head is one copy the drafter still
    aliases, the embeddings keep their rows, and greedy speculative output equals plain
    decoding; onednn packs instead and keeps the checkpoint's layout."""
    target, drafter = pair
    ps = [[(5 * i + j) % VOCAB for j in range(3 + i)] for i in range(6)]
    base = LLM(str(target), num_blocks=128, page_size=4, cpu_gemm="mkl").generate(ps, GREEDY)
    spec = LLM(str(target), draft_model=str(drafter), num_blocks=128, page_size=4, cpu_gemm="mkl")
    t, d = spec.runner.model, spec.runner.drafter
    assert d is not None
    linears = [
        m.weight for root in (t, d) for m in root.modules() if isinstance(m, torch.nn.Linear)
    ]
    experts = [p for n, p in t.named_parameters() if "experts" in n]
    assert experts and all(w.transpose(-1, -2).is_contiguous() for w in linears + experts)
    assert all(not w.is_contiguous() for w in linears if min(w.shape) > 1)
    assert t.model.embed_tokens.weight.is_contiguous() and d.embed_tokens.weight.is_contiguous()
    assert d.lm_head.weight is t.lm_head.weight is not t.model.embed_tokens.weight
    outs = spec.generate(ps, GREEDY)
    assert [o.output_ids for o in outs] == [o.output_ids for o in base]
    assert spec.stats.rounds > 0
    packed = LLM(str(target), num_blocks=16, page_size=4, cpu_gemm="onednn")
    assert packed.runner.model.model.layers[0].self_attn.q_proj.weight.is_contiguous()
