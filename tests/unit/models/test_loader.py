"""Checkpoint folders that cannot work are refused with a message naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_sglang.config import ArchConfig, ConfigError
from dspark_sglang.models.loader import load_target
from tests.conftest import write_hf_model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("moe"), moe=True)


def clone(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_folder_and_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a directory"):
        load_target(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        load_target(tmp_path)


def test_unknown_architecture(moe_dir: Path, tmp_path: Path) -> None:
    p = clone(moe_dir, tmp_path / "m")
    edit_config(p, architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError, match="unsupported architecture 'LlamaForCausalLM'"):
        load_target(p)


def test_config_that_disagrees_with_weights(moe_dir: Path, tmp_path: Path) -> None:
    p = clone(moe_dir, tmp_path / "a")
    edit_config(p, intermediate_size=100)
    with pytest.raises(ConfigError, match=r"weight model\.layers\.1\.mlp\.gate_proj\.weight"):
        load_target(p)
    p = clone(moe_dir, tmp_path / "b")
    edit_config(p, num_experts=8, num_local_experts=8)
    with pytest.raises(ConfigError, match="num_experts=8"):
        load_target(p)
    p = clone(moe_dir, tmp_path / "c")
    edit_config(p, num_hidden_layers=4)
    with pytest.raises(ConfigError, match=r"missing \['model\.layers\.3"):
        load_target(p)


def test_missing_weights_and_bad_json(moe_dir: Path, tmp_path: Path) -> None:
    p = clone(moe_dir, tmp_path / "a")
    (p / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no \\*\\.safetensors"):
        load_target(p)
    p = clone(moe_dir, tmp_path / "b")
    (p / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_target(p)
    with pytest.raises(ConfigError, match="missing required field 'hidden_size'"):
        ArchConfig.from_hf_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8})


def test_unsupported_features_are_named() -> None:
    base = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 8,
    }
    ArchConfig.from_hf_dict(base)  # the base itself is fine
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        ArchConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        ArchConfig.from_hf_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="sliding_window"):
        ArchConfig.from_hf_dict({**base, "use_sliding_window": True})


def test_fused_expert_checkpoint_loads_identically(moe_dir: Path, tmp_path: Path) -> None:
    """transformers>=5 in-memory layout (fused experts) and the hub layout give the same model."""
    sd = load_file(str(moe_dir / "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in sd.items():
        if ".mlp.experts." in k:
            prefix, rest = k.split(".mlp.experts.")
            e, proj, _ = rest.split(".")
            groups.setdefault(prefix, {}).setdefault(int(e), {})[proj] = v
        else:
            fused[k] = v
    for prefix, ex in groups.items():
        ids = sorted(ex)
        fused[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([ex[i]["gate_proj"], ex[i]["up_proj"]]) for i in ids]
        )
        fused[f"{prefix}.mlp.experts.down_proj"] = torch.stack([ex[i]["down_proj"] for i in ids])
    p = tmp_path / "fused"
    p.mkdir()
    (p / "config.json").write_bytes((moe_dir / "config.json").read_bytes())
    save_file(fused, str(p / "model.safetensors"))
    a, b = load_target(moe_dir), load_target(p)
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(ta, tb)


def test_sharded_checkpoint_with_index(moe_dir: Path, tmp_path: Path) -> None:
    sd = load_file(str(moe_dir / "model.safetensors"))
    keys = sorted(sd)
    p = tmp_path / "sharded"
    p.mkdir()
    (p / "config.json").write_bytes((moe_dir / "config.json").read_bytes())
    half = len(keys) // 2
    shards = {
        "model-00001-of-00002.safetensors": keys[:half],
        "model-00002-of-00002.safetensors": keys[half:],
    }
    for name, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(p / name))
    index = {"weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (p / "model.safetensors.index.json").write_text(json.dumps(index))
    ref = load_target(moe_dir).state_dict()
    got = load_target(p).state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    (p / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="shards listed in the index are missing"):
        load_target(p)
