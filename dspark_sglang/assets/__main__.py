"""`python -m dspark_sglang.assets path`: print where the bundled tiny model lives (DESIGN §7)."""

from __future__ import annotations

import argparse

from dspark_sglang.assets import bundled_target_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspark_sglang.assets", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("path", help="print the bundled target model directory")
    parser.parse_args(argv)
    path = bundled_target_dir()
    if not (path / "config.json").is_file():
        parser.exit(1, f"bundled model missing at {path}; run `make tiny-model`\n")
    print(path)


if __name__ == "__main__":
    main()
