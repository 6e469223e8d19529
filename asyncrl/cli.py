"""`asyncrl run | config | bench` — parse arguments, load the config, hand over.

Heavy modules (torch, Ray, transformers) are imported inside the commands that need them, so
`asyncrl config ...` starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path


def _split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    """The first item is a config file unless it looks like an override (`key=value`)."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from asyncrl.config import derive_plan, load_config, to_dict

    path, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(path, overrides)
    plan = derive_plan(cfg)
    if args.action == "validate":
        print(f"ok: {path or '<embedded default>'}")
    else:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False, width=100).rstrip())
        print("\n# derived plan")
        plan_dict = {k: v for k, v in dataclasses.asdict(plan).items() if k != "warnings"}
        print(yaml.safe_dump({"plan": plan_dict}, sort_keys=False).rstrip())
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from asyncrl.config import load_config

    path, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(path, overrides)
    from asyncrl.run import run

    run(cfg)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib.util

    bench_dir = Path(__file__).resolve().parent.parent / "bench"
    script = bench_dir / f"{args.what.replace('-', '_')}.py"
    if not script.exists() or script.stem == "common":  # common.py: shared helpers
        available = sorted(
            p.stem.replace("_", "-") for p in bench_dir.glob("*.py") if p.stem != "common"
        )
        print(f"asyncrl bench: unknown benchmark {args.what!r}; available: {available}")
        return 2
    if str(bench_dir) not in sys.path:
        sys.path.insert(0, str(bench_dir))  # benches share bench/common.py
    spec = importlib.util.spec_from_file_location(f"asyncrl_bench_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    result = module.main(args.rest)
    return result if isinstance(result, int) else 0  # some benches return their result dict


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train (no config: the embedded CPU default)")
    run.add_argument("items", nargs="*", help="[CONFIG.yaml] [key.path=value ...]")
    run.set_defaults(func=cmd_run)
    config = sub.add_parser("config", help="show or validate a config")
    config.add_argument("action", choices=["show", "validate"])
    config.add_argument("items", nargs="*", help="[CONFIG.yaml] [key.path=value ...]")
    config.set_defaults(func=cmd_config)
    bench = sub.add_parser("bench", help="throughput benchmarks (bench/<what>.py)")
    bench.add_argument("what")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from asyncrl.config import ConfigError

    try:
        return args.func(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
