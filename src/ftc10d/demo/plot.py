"""The timeline picture: loss vs time, faults and recoveries marked (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftc10d.demo.report import Run, load_events

COLORS = {"kill": "tab:red", "freeze": "tab:blue", "join": "tab:green"}


def plot_timeline(out_dir: Path, report: dict[str, Any], path: Path | None = None) -> Path:
    """Write ``timeline.png`` (or ``path``) from the run's events and its report."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    path = Path(path) if path is not None else out_dir / "timeline.png"
    run = Run(load_events(out_dir))
    t0 = report.get("t0", run.t0)
    curve = run.loss_curve()
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    if curve:
        xs, ys = zip(*curve)
        ax.plot(xs, ys, color="black", lw=1.2, label="loss (mean over ranks)")
        ax.set_yscale("log")
    members = sorted((e["t"] - t0, e["world_size"]) for e in run.steps if e["ok"])
    if members:
        ax2 = ax.twinx()
        mx, my = zip(*members)
        ax2.step(mx, my, where="post", color="tab:gray", alpha=0.5, lw=1, label="members")
        ax2.set_ylabel("members")
        ax2.set_ylim(0, max(my) + 1)
    labelled: set[str] = set()
    for i, f in enumerate(report.get("faults", [])):
        c = COLORS.get(f["kind"], "tab:purple")
        a = f["t_fault"] - t0
        lab = None if f["kind"] in labelled else f"{f['kind']}"
        labelled.add(f["kind"])
        ax.axvline(a, color=c, ls="--", lw=1.2, label=lab)
        if f.get("t_recovered") is not None:
            b = f["t_recovered"] - t0
            ax.axvspan(a, b, color=c, alpha=0.2)
            stall = f.get("stall_s")
            ax.annotate(f"{f['kind']} slot {f['rank']}\nstall {stall * 1000:.0f} ms" if stall is not None
                        else f"{f['kind']} slot {f['rank']}",
                        xy=(b, 1.0 - 0.12 * (i % 3)), xycoords=("data", "axes fraction"), xytext=(3, -4),
                        textcoords="offset points", fontsize=7, color=c, va="top")
        if f.get("t_resumed"):
            ax.axvline(f["t_resumed"] - t0, color=c, ls=":", lw=1)
    ax.set_xlabel("seconds since the first worker started (dotted: SIGCONT)")
    ax.set_ylabel("loss")
    ident = "yes" if report.get("replicas_identical") else "NO"
    ax.set_title(f"ftc10d demo: {report.get('world_size')} workers, {report.get('steps_committed')} steps, "
                 f"replicas identical: {ident}", fontsize=10)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
