"""`python -m dspark_sglang.train {corpus,tokenizer,target,drafter}`: one subcommand per stage."""

from __future__ import annotations

import argparse
import importlib
import sys

# Stage name -> module with `add_args(parser)` and `main(args)`; modules load only when chosen.
STAGES = {
    "corpus": ("dspark_sglang.train.corpus", "stdlib sources -> train/heldout jsonl"),
    "tokenizer": ("dspark_sglang.train.tokenizer", "byte-level BPE + chat template"),
    "target": ("dspark_sglang.train.target", "train and export the tiny Qwen3-MoE target"),
    "drafter": ("dspark_sglang.train.drafter", "train a DSpark / DFlash drafter (DeepSpec §3)"),
    "prompts": ("dspark_sglang.train.prompts", "bundled held-out prompts for eval and bench"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspark_sglang.train", description=__doc__)
    sub = parser.add_subparsers(dest="stage", required=True)
    argv = sys.argv[1:] if argv is None else argv
    chosen = argv[0] if argv and argv[0] in STAGES else None
    modules = {}
    for name, (module, help_text) in STAGES.items():
        p = sub.add_parser(name, help=help_text)
        if name != chosen:
            continue
        try:
            modules[name] = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            parser.exit(2, f"stage {name!r} is not implemented yet ({module} is missing)\n")
        modules[name].add_args(p)
    args = parser.parse_args(argv)
    modules[args.stage].main(args)


if __name__ == "__main__":
    main()
