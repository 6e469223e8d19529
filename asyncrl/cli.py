"""`asyncrl run | config | bench` — parse arguments, load the config, hand over.

Heavy modules (torch, Ray, transformers) are imported inside the commands that need them, so
`asyncrl config ...` starts in a fraction of a second. Bad input (a config, a data file, a
model directory, a reward) is one line on stderr and exit status 2, never a traceback;
`ASYNCRL_DEBUG=1` shows the traceback (and third-party output, see `asyncrl.logs`).
"""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"
DOCS_REFERENCE = BENCH_DIR.parent / "docs" / "reference" / "config.md"  # the checkout's
# The project's "bad input" errors: (module, class). Looked up in sys.modules only, so catching
# them imports nothing; a class whose module never loaded cannot have been raised.
USER_ERRORS = (
    ("asyncrl.config.schema", "ConfigError"),  # checkpoint.ResumeError is one
    ("asyncrl.data.datasets", "DatasetError"),
    ("asyncrl.rewards.base", "RewardError"),
    ("asyncrl.envs.base", "EnvError"),
    ("asyncrl.device", "DeviceError"),
    ("asyncrl.preflight", "MissingPieceError"),
    ("asyncrl.engine.sglang", "SGLangConfigError"),
    ("asyncrl.learner.megatron.args", "MegatronConfigError"),
    ("asyncrl.learner.reference", "ReferenceConfigError"),
    ("asyncrl.rollout.settings", "PermanentRolloutError"),
    ("asyncrl.learner.placed_ranks", "RankPlacementError"),
    ("asyncrl.learner.placement", "LostRankError"),
)
MODEL_KEY = "actor_train.model_args.model_name_or_path"
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")


def _split_config_and_overrides(items: list[str]) -> tuple[str | None, list[str]]:
    """The first item is a config file unless it looks like an override (`key=value`)."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def cmd_config(args: argparse.Namespace) -> int:
    if args.action in ("docs", "explain"):
        return cmd_config_docs(args)
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
        from asyncrl.config.rank_plan import learner_placement

        placement = learner_placement(cfg)
        if placement is not None:  # the ranks' nodes, planned on cluster.accelerators_per_node
            print("\n# learner placement (rank -> node slot and device; at run time the "
                  "cluster's free counts place them, checked against this)")  # fmt: skip
            print(
                yaml.safe_dump(
                    {"learner_placement": placement}, sort_keys=False, width=200
                ).rstrip()
            )
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def cmd_config_docs(args: argparse.Namespace) -> int:
    """`config docs [--out PATH]`: write the reference generated from the schema;
    `config explain KEY`: print one key's entry."""
    from asyncrl.config import docs

    if args.action == "explain":
        if len(args.items) != 1:
            print("asyncrl config explain: give one key, e.g. async.max_staleness", file=sys.stderr)
            return 2
        print(docs.explain(args.items[0]))
        return 0
    if args.items:
        print(
            f"asyncrl config docs: unexpected {args.items[0]!r} (use --out PATH)", file=sys.stderr
        )
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(docs.render_page(), encoding="utf-8")
    print(f"wrote {out}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from asyncrl.config import load_config
    from asyncrl.logs import third_party_to_log

    path, overrides = _split_config_and_overrides(args.items)
    cfg = load_config(path, overrides)
    from asyncrl.run import run

    with third_party_to_log(cfg.output_dir), exit_on_sigterm():
        check_inputs(cfg)  # seconds now, rather than after the model build and the Ray start
        if args.overwrite:  # by keyword, and only when asked
            run(cfg, overwrite=True)
        else:
            run(cfg)
    return 0


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """SIGTERM (a scheduler's stop, `timeout`, `docker stop`) ends the run as Ctrl-C does: by
    an exception in the main thread, so every process and thread the run started is stopped in
    order and the metrics written so far are kept (exit status 143). Ray set the same handler
    when it was started from the main thread; the run starts it on a thread of its own."""
    from asyncrl.net import exit_on_signal

    previous = signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_inputs(cfg: Any) -> None:
    """The files a run reads on this machine (prompt files, the model directory) exist and
    load; `config validate` leaves them out, since a config is often checked elsewhere."""
    from asyncrl.config import ConfigError
    from asyncrl.data.datasets import DatasetError, check_file

    data = cfg.actor_train.data_args
    for key in ("file_name", "eval_file_name"):
        for name in getattr(data, key):
            try:
                check_file(name)
            except DatasetError as e:
                raise ConfigError(f"actor_train.data_args.{key}: {e}") from None
    path = cfg.actor_train.model_args.model_name_or_path
    if not path:
        return  # the embedded model, built on first use
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"{MODEL_KEY}: {path} is not a Hugging Face model directory")
    if not any(next(Path(path).glob(pattern), None) for pattern in WEIGHT_FILES):
        raise ConfigError(f"{MODEL_KEY}: {path} holds no weights (*.safetensors or *.bin)")
    from transformers import AutoConfig, AutoTokenizer

    for what, auto in (("config", AutoConfig), ("tokenizer", AutoTokenizer)):
        try:
            auto.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - OSError, ValueError, JSON and tokenizers errors
            raise ConfigError(f"{MODEL_KEY}: {path}: cannot load its {what} ({_line(e)})") from None


def bench_scripts() -> dict[str, Path]:
    """`asyncrl bench` name → script: every bench/*.py except the shared helpers (common.py,
    and modules named `_*.py`, parts of a bench)."""
    return {
        p.stem.replace("_", "-"): p
        for p in sorted(BENCH_DIR.glob("*.py"))
        if p.stem != "common" and not p.stem.startswith("_")
    }


def bench_listing() -> str:
    """One line per bench: its name and the first line of its docstring (read with ast, so no
    bench module, nor what it imports, is loaded)."""
    lines = ["benchmarks (`asyncrl bench <name> --help` shows a bench's flags):"]
    scripts = bench_scripts()
    width = max(map(len, scripts), default=0)
    for name, path in scripts.items():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path))) or ""
        lines.append(f"  {name:<{width}}  {(doc.strip().splitlines() or ['-'])[0]}")
    return "\n".join(lines) + "\n"


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib.util

    if args.what is None:  # a bare `asyncrl bench`: what there is to run
        print(args.usage(), end="")
        print(bench_listing(), end="")
        return 2
    script = bench_scripts().get(args.what)
    if script is None:
        available = sorted(bench_scripts())
        print(f"asyncrl bench: unknown benchmark {args.what!r}; available: {available}")
        return 2
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))  # benches share bench/common.py
    spec = importlib.util.spec_from_file_location(f"asyncrl_bench_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    result = module.main(args.rest)
    return result if isinstance(result, int) else 0  # some benches return their result dict


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help can end with text computed only when help is shown."""

    help_tail: Callable[[], str] | None = None

    def format_help(self) -> str:
        text = super().format_help()
        return f"{text}\n{self.help_tail()}" if self.help_tail else text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="asyncrl",
        description=__doc__.splitlines()[0],
        epilog="ASYNCRL_DEBUG=1: tracebacks and third-party output on the console.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train (no config: the embedded CPU default)")
    run.add_argument("items", nargs="*", help="[CONFIG.yaml] [key.path=value ...]")
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an output_dir that holds a run (its files are moved aside)",
    )
    run.set_defaults(func=cmd_run)
    config = sub.add_parser(
        "config", help="show or validate a config; docs: the key reference; explain KEY"
    )
    config.add_argument("action", choices=["show", "validate", "docs", "explain"])
    config.add_argument(
        "items", nargs="*", help="[CONFIG.yaml] [key.path=value ...] (explain: one KEY)"
    )
    config.add_argument(
        "--out", default=str(DOCS_REFERENCE), help="config docs: where the page goes"
    )
    config.set_defaults(func=cmd_config)
    bench = sub.add_parser("bench", help="throughput benchmarks (bench/<what>.py)")
    bench.help_tail = bench_listing
    bench.add_argument("what", nargs="?", help="a benchmark listed below")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    bench.set_defaults(func=cmd_bench, usage=bench.format_usage)
    return parser


def _line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (its type when it has none)."""
    return next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)


def user_error(exc: BaseException) -> BaseException | None:
    """`exc` (or the error a Ray task error wraps) when it is one of `USER_ERRORS`."""
    for _ in range(4):  # a Ray task error carries its cause; unwrap a few levels at most
        for module, name in USER_ERRORS:
            cls = getattr(sys.modules.get(module), name, None)
            if cls is not None and isinstance(exc, cls):
                return exc
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException):
            return None
        exc = cause
    return None


def _end_quickly(status: list[int]) -> None:
    """An exit handler for `asyncrl run` on the command line, registered before the run
    imports anything that registers its own, so it runs last: once every thread has finished
    and every other handler has run (Ray's shutdown, logging's flush), it ends the process
    without tearing the interpreter down. With torch and transformers loaded that teardown
    takes seconds (2.0-4.5 s measured on the 2-core box, against 0.1) and frees nothing the
    operating system would not; the engine server ends the same way."""
    if status:  # empty: `main` left by an exception, which exits as Python does
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status[0])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # `run a.yaml --overwrite k=v`: argparse ends a positional list at a flag
        if args.command != "run" or any(x.startswith("-") for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.items += extra
    # The process's own command line (the console script, `python -m`), never a caller's
    # `main([...])`: that process is the caller's, to end as it likes.
    quick = argv is None and args.command == "run"
    ended: list[int] = []  # the status `_end_quickly` ends the process with
    if quick:
        atexit.register(_end_quickly, ended)
    status = _dispatch(parser, args)
    if quick:  # an exception leaving `main` exits as Python does (its traceback shown)
        ended.append(status)
    return status


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from asyncrl.logs import debug_enabled

        found = user_error(e)
        if found is None or debug_enabled():
            raise
        config_error = getattr(sys.modules.get("asyncrl.config.schema"), "ConfigError", ())
        label = "config error" if isinstance(found, config_error) else "error"
        print(f"{label}: {_line(found)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
