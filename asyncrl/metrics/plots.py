"""PNG plots of a finished run, drawn with matplotlib's object API on the Agg canvas (no
pyplot, so no global backend switch and no GUI). A series that never appeared gets no plot."""

from __future__ import annotations

from pathlib import Path

from asyncrl.metrics import keys
from asyncrl.metrics.history import History, Point

DPI = 110


def _figure(rows: int, cols: int, width: float = 6.0, height: float = 3.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _line(ax, points: list[Point], x: str, label: str, color: str, pct: bool = False) -> None:
    xs = [p.step if x == "step" else p.time for p in points]
    ys = [100 * p.value if pct else p.value for p in points]
    # A single point draws no line; the marker keeps a 1-step run visible.
    ax.plot(
        xs, ys, marker="o" if len(points) < 30 else None, markersize=3, label=label, color=color
    )
    ax.set_xlabel("step" if x == "step" else "wall time (s)")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)


def plot_reward_accuracy(history: History, path: Path) -> bool:
    """Reward and held-out accuracy over steps (left) and wall time (right), one row each."""
    series = [
        (keys.REWARD, "reward (mean)", "tab:blue", False),
        (keys.ACCURACY, "held-out accuracy (%)", "tab:green", True),
    ]
    present = [(history.points(k), *rest) for k, *rest in series if history.points(k)]
    if not present:
        return False
    fig = _figure(len(present), 2)
    axes = fig.subplots(len(present), 2, squeeze=False)
    for row, (points, label, color, pct) in enumerate(present):
        for col, x in enumerate(("step", "time")):
            _line(axes[row][col], points, x, label, color, pct)
    fig.suptitle("reward and held-out accuracy")
    fig.savefig(path, dpi=DPI)
    return True


def plot_staleness(history: History, path: Path) -> bool:
    """Trained groups per staleness, summed over the run."""
    hist = history.staleness_hist()
    if not hist:
        return False
    fig = _figure(1, 1)
    ax = fig.subplots()
    ks = list(range(max(hist) + 1))
    ax.bar(ks, [hist.get(k, 0) for k in ks], color="tab:orange")
    ax.set_xticks(ks)
    ax.set_xlabel("staleness (learner version − sampling version)")
    ax.set_ylabel("groups trained")
    ax.set_title("staleness of trained groups")
    ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=DPI)
    return True


def plot_throughput(history: History, path: Path) -> bool:
    """Generated tokens per second over steps."""
    points = history.points(keys.TOKENS_PER_S)
    if not points:
        return False
    fig = _figure(1, 1)
    ax = fig.subplots()
    _line(ax, points, "step", "tokens/s", "tab:purple")
    ax.set_title("throughput")
    fig.savefig(path, dpi=DPI)
    return True


def write_plots(history: History, plot_dir: Path) -> list[Path]:
    """Every plot the run has data for; returns the files written."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in (
        ("reward_accuracy.png", plot_reward_accuracy),
        ("staleness_hist.png", plot_staleness),
        ("throughput.png", plot_throughput),
    ):
        if plot(history, plot_dir / name):
            written.append(plot_dir / name)
    return written
