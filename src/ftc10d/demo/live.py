"""What the demo shows while it runs: a rich live view, or plain log lines (``--no-live``),
and the summary table at the end."""

from __future__ import annotations

import sys
import time
from typing import Any, Optional

STATUS_STYLE = {"training": "green", "frozen": "bold blue", "killed": "bold red", "rejoining": "yellow",
                "starting": "dim", "done": "cyan", "exited": "dim"}


class PlainView:
    """One line per event, as it happens (for CI logs and pipes)."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout

    def start(self, state: Any) -> None:
        pass

    def update(self, state: Any) -> None:
        for t, text in state.new_log:
            print(f"[{t:7.2f}s] {text}", file=self.stream, flush=True)
        state.new_log.clear()

    def stop(self) -> None:
        pass


class LiveView:
    """A rich ``Live`` panel: progress, members, per-worker rows, recent events."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console()
        self._live: Optional[Any] = None
        self._last = 0.0

    def start(self, state: Any) -> None:
        from rich.live import Live

        self._live = Live(self._render(state), console=self.console, refresh_per_second=8, transient=False)
        self._live.start()

    def update(self, state: Any) -> None:
        state.new_log.clear()
        now = time.monotonic()
        if self._live is not None and now - self._last > 0.1:
            self._last = now
            self._live.update(self._render(state))

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()

    def _render(self, state: Any) -> Any:
        from rich.console import Group
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        cfg = state.cfg
        stall = state.stall_now()
        head = Text()
        head.append(f"step {state.step}/{cfg.steps}", style="bold")
        head.append(f"   loss {state.loss:.4g}" if state.loss is not None else "   loss -")
        head.append(f"   members {state.members}   epoch {state.epoch}   ")
        head.append(f"stall {stall * 1000:.0f} ms", style="bold red" if stall > 0.5 and state.step else "")
        head.append(f"   longest {state.longest_stall * 1000:.0f} ms", style="dim")
        bar = ProgressBar(total=cfg.steps, completed=state.step)
        rows = Table(box=None, header_style="bold", pad_edge=False)
        for col in ("slot", "pid", "rank", "status", "step", "loss", "not committed"):
            rows.add_column(col, justify="right" if col not in ("status",) else "left")
        for w in sorted(state.workers.values(), key=lambda w: (w.slot, w.pid)):
            rows.add_row(str(w.slot), str(w.pid), "-" if w.rank is None else str(w.rank),
                         Text(w.status, style=STATUS_STYLE.get(w.status, "")), str(w.step),
                         "-" if w.loss is None else f"{w.loss:.4g}", str(w.aborted))
        log = []
        for t, text in list(state.log)[-10:]:
            style = "red" if "SIGKILL" in text else "blue" if "SIGSTOP" in text or "SIGCONT" in text else ""
            log.append(Text(f"{t:7.2f}s  {text}", style=style, no_wrap=True, overflow="ellipsis"))
        return Panel(Group(head, bar, Text(""), rows, Text(""), *log), title="ftc10d demo", border_style="cyan")


def _fmt(v: Optional[float], unit: str = "ms") -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if unit == "ms" else f"{v:.3g}"


def summary_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for f in report["faults"]:
        extra = ""
        if f["kind"] == "join" and f.get("too_late"):
            extra = f"{'warm' if f.get('warm') else 'cold'}; the job finished before it could join"
        elif f["kind"] == "join":
            extra = f"{'warm' if f.get('warm') else 'cold'}; first commit {_fmt(f.get('first_commit_s'))} after " \
                    f"hand-over, {_fmt(f.get('since_kill_s'))} after the kill"
        elif f["kind"] == "freeze":
            extra = f"{f.get('duration_s'):g} s; " + ("removed, rejoined" if f.get("rejoined") else
                                                      "removed" if f.get("removed") else "not removed")
        else:
            extra = f"{f.get('survivors')} survivors"
        rows.append([f["kind"], str(f["rank"]), str(f["at_step"]), _fmt(f.get("stall_s")),
                     "-" if f.get("steps_lost") is None else str(f["steps_lost"]),
                     "yes" if f["recovered"] else "NO", extra])
    return rows


HEADERS = ["fault", "slot", "at step", "stall", "steps lost", "recovered", "notes"]


def _pause_line(pause: Optional[dict[str, Any]], bound: Optional[float] = None) -> str:
    if not pause:
        return "longest pause between commits: -"
    why = ", ".join(pause["faults"] + [k for k in pause["events"] if k in ("reconfigured", "recovered", "fenced")])
    verdict = "" if bound is None else f"; bound {bound:g} s: {'ok' if pause['seconds'] <= bound else 'EXCEEDED'}"
    return (f"longest pause between commits: {_fmt(pause['seconds'])} (steps {pause['after_step']} -> "
            f"{pause['to_step']}, at {pause['t_start_s']} s{'; ' + why if why else ''}{verdict})")


def _hash_text(report: dict[str, Any]) -> str:
    """The final hashes in words: per shard index under FT-HSDP (each rank hashes its shard)."""
    shards = report.get("final_hashes_by_shard")
    if shards:
        distinct = ", ".join(f"shard {k}: {len(v)}" for k, v in shards.items())
        return f"final state_hash on {report['final_ranks']} ranks, distinct per shard index: {distinct}"
    return f"final state_hash on {report['final_ranks']} ranks: {len(report['final_hashes'])} distinct"


def print_summary(report: dict[str, Any], out_dir: str, *, rich_output: bool) -> None:
    med = report.get("step_time_median_s")
    fp = report["fingerprint_checks"]
    lines = [
        f"completed: {'yes' if report['completed'] else 'NO'} ({report['steps_committed']}/{report['steps']} steps, "
        f"{report.get('duration_s')} s)",
        f"replicas bitwise-identical: {'yes' if report['replicas_identical'] else 'NO'} "
        f"({_hash_text(report)}; "
        f"fingerprints agreed at {fp['checked_steps'] - len(fp['disagreeing_steps'])}/{fp['checked_steps']} "
        f"checked steps)",
        f"step time (median, no fault): {_fmt(med)}; loss {report.get('loss_first') or 0:.4g} -> "
        f"{report.get('loss_last') or 0:.4g}",
        _pause_line(report.get("longest_pause"), report.get("longest_pause_bound_s")),
        f"wrote {out_dir}/report.json and {out_dir}/timeline.png",
    ]
    rows = summary_rows(report)
    if rich_output:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="faults", header_style="bold")
        for h in HEADERS:
            table.add_column(h)
        for r in rows:
            table.add_row(*r)
        con = Console()
        con.print(table)
        for line in lines:
            con.print(line)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(HEADERS)]
    print("  ".join(h.ljust(w) for h, w in zip(HEADERS, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if not rows:
        print("(no faults)")
    for line in lines:
        print(line)
