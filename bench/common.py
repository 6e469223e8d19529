"""What every `asyncrl bench <what>` shares: arguments, result JSON, plots, baselines, timing.

A bench builds a result dict whose `headline` maps metric names to
`{"value": float, "higher_is_better": bool, "unit": str}`, then calls `finish(name, result,
args, plot)`. That writes `bench/results/<name>.json` (smoke runs: `bench/results/smoke/`) and
`<name>.png`, compares every headline metric with the recorded baseline
`bench/results/baseline/<name>.json` and flags a change for the worse beyond `--tolerance`
(relative) as a regression. Smoke results are never compared with full-size baselines, nor a
result with a baseline measured on another device (a GPU's, or the CPU's).
`--record-baseline` also writes the result as the new baseline. A headline metric the baseline
lacks is a regression ("no baseline value"), not a silent skip: a baseline records every
headline key. Every full-size run also appends one record to `bench/results/history.jsonl`
(date, bench, command, machine with its CPU model or GPU name, commit, headline figures), so a
figure's history lives there and the result file holds the current value.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BASELINE_DIR = RESULTS_DIR / "baseline"
SMOKE_DIR = RESULTS_DIR / "smoke"
HISTORY = RESULTS_DIR / "history.jsonl"
DEFAULT_TOLERANCE = 0.25


def make_parser(doc: str | None) -> argparse.ArgumentParser:
    """The shared flags; a bench adds its own before `parse_args`."""
    first = (doc or "").strip().splitlines()[0] if doc else None
    p = argparse.ArgumentParser(description=first)
    p.add_argument("--smoke", action="store_true", help="CI sizes: seconds, not minutes")
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument("--baseline-dir", type=Path, default=BASELINE_DIR)
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="relative")
    p.add_argument("--record-baseline", action="store_true", help="also save as the baseline")
    p.add_argument("--strict", action="store_true", help="exit 1 on a regression")
    return p


def out_dir(args: argparse.Namespace) -> Path:
    path = args.out or (SMOKE_DIR if args.smoke else RESULTS_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """The commit of the checkout the bench runs from (None outside a git checkout); a
    `+dirty` suffix when tracked files differ from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True)
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--short=12", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return commit


def history_record(result: dict[str, Any], file: Path) -> dict[str, Any]:
    """One line of `history.jsonl` for a result just written to `file`."""
    info = result.get("machine", {})
    root = RESULTS_DIR.parent.parent
    path = file.resolve()
    record = {
        "date": result["created"],
        "bench": result["name"],
        "file": str(path.relative_to(root) if path.is_relative_to(root) else path),
        "command": result["command"].strip(),
        "machine": info.get("gpu") or f"{info.get('cpu_model')} ({info.get('cpus')} cores)",
        "loadavg_1m": info.get("loadavg_1m"),
        "commit": result.get("commit"),
        "figures": {k: v["value"] for k, v in result.get("headline", {}).items()},
    }
    if "met" in result:
        record["met"] = result["met"]
    return record


def headline(value: float, higher_is_better: bool = True, unit: str = "") -> dict[str, Any]:
    return {"value": float(value), "higher_is_better": higher_is_better, "unit": unit}


def compare(result: dict[str, Any], baseline: dict[str, Any], tolerance: float) -> list[str]:
    """A line per headline metric that got worse than the baseline by more than `tolerance`."""
    out = []
    for key, now in result.get("headline", {}).items():
        then = baseline.get("headline", {}).get(key)
        if not then or then.get("value") is None:
            out.append(f"{key}: {now['value']:.4g}, no baseline value (record one)")
            continue
        if not then["value"]:
            continue  # a zero baseline has no relative change
        change = (now["value"] - then["value"]) / abs(then["value"])
        worse = -change if now.get("higher_is_better", True) else change
        if worse > tolerance:
            out.append(
                f"{key}: {now['value']:.4g} vs baseline {then['value']:.4g} "
                f"({100 * change:+.0f}%, tolerance {100 * tolerance:.0f}%)"
            )
    return out


def accelerator(result: dict[str, Any]) -> str:
    """The device a result was measured on: its GPU's name, else "the CPU" (results and
    baselines recorded before GPUs were named count as the CPU's)."""
    return result.get("machine", {}).get("gpu") or "the CPU"


def _baseline_check(name: str, result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    path = args.baseline_dir / f"{name}.json"
    if not path.exists():
        print(f"baseline: none recorded at {path}")
        return []
    baseline = json.loads(path.read_text())
    if bool(baseline.get("smoke")) != bool(result.get("smoke")):
        print(f"baseline: {path} is a {'smoke' if baseline.get('smoke') else 'full'} run; skipped")
        return []
    then, now = accelerator(baseline), accelerator(result)
    # A GPU's ratios are not the CPU's (kernel launches vs host ops), nor another GPU's.
    if then != now:
        print(f"baseline: {path} was measured on {then}, this run on {now}; skipped")
        return []
    regressions = compare(result, baseline, args.tolerance)
    for line in regressions:
        print(f"REGRESSION {name}: {line}")
    if not regressions:
        print(f"baseline: no regression beyond {100 * args.tolerance:.0f}% vs {path}")
    return regressions


def finish(
    name: str,
    result: dict[str, Any],
    args: argparse.Namespace,
    plot: Callable[[Any], None] | None = None,
    argv: Sequence[str] | None = None,
    bench: str | None = None,
) -> int:
    """Stamp, compare, write JSON (+ PNG) and optionally the baseline; the exit code. `bench`:
    the `asyncrl bench` command that wrote it, when not `name` (one bench, several results)."""
    result = {
        "name": name,
        "smoke": bool(args.smoke),
        "command": f"asyncrl bench {bench or name.replace('_', '-')} " + " ".join(argv or []),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "commit": git_commit(),
        **result,
    }
    result["regressions"] = _baseline_check(name, result, args)
    folder = out_dir(args)
    text = json.dumps(result, indent=2, default=_jsonable) + "\n"
    (folder / f"{name}.json").write_text(text)
    if not args.smoke:  # a full-size figure: its history beside the result files
        with (folder / HISTORY.name).open("a") as history:
            history.write(json.dumps(history_record(result, folder / f"{name}.json")) + "\n")
    if plot is not None:
        save_plot(plot, folder / f"{name}.png")
    if args.record_baseline:
        args.baseline_dir.mkdir(parents=True, exist_ok=True)
        (args.baseline_dir / f"{name}.json").write_text(text)
    print(f"wrote {folder / f'{name}.json'}")
    return 1 if args.strict and result["regressions"] else 0


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def save_plot(draw: Callable[[Any], None], path: Path) -> None:
    """`draw(fig)` on a fresh matplotlib figure (Agg backend), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(9, 4.5))
    try:
        draw(fig)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain fixed-width table (floats as 4 significant digits)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    sys.stdout.flush()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1, sync: Callable | None = None):
    """Seconds of each of `repeats` calls after `warmup` untimed ones (`sync` e.g. cuda)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - start)
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


class PeakMemory:
    """Extra peak memory (bytes) of the block above what was allocated on entry.

    CUDA: `torch.cuda.max_memory_allocated`. CPU (Linux): the process's peak RSS, reset on
    entry through /proc/self/clear_refs, after `malloc_trim` returned freed heap memory to the
    OS (call `strict_malloc` first for exact figures). Page granular; None where unavailable.
    """

    def __init__(self, cuda: bool = False) -> None:
        self.cuda, self.bytes = cuda, None

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            _trim_malloc()
            self._start = _reset_peak_rss()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self._start
        elif self._start is not None:
            self.bytes = max(0, _status_kb("VmHWM") * 1024 - self._start)


def _status_kb(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1))


def _reset_peak_rss() -> int | None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_kb("VmRSS") * 1024
    except (OSError, AttributeError):
        return None


def strict_malloc() -> None:
    """Make glibc serve every block over 128 KB by mmap (a fixed threshold, no dynamic growth),
    so freed memory goes back to the OS at once and a later peak cannot hide in reused heap.
    For the rest of the process: allocation gets slower, so take timings before calling it."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _trim_malloc() -> None:
    """Hand freed heap memory back to the OS, so a block that reuses it still shows in RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def build_model_dir(path: Path, **spec: Any) -> Path:
    """A randomly initialised Qwen2 model directory (the embedded model's architecture and
    character tokenizer) of the given `TinyModelSpec` sizes; built once per path."""
    if (path / "config.json").exists():
        return path
    from asyncrl.models.tiny import TinyModelSpec, build_model, build_tokenizer

    tok = build_tokenizer()
    build_model(TinyModelSpec(**spec), tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads per process (0: torch's default); 1 keeps figures stable on a "
        "shared box, where OpenMP threads spin-waiting for descheduled peers collapse",
    )
