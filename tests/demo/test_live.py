"""The live view and the summary render from a JobState / report without a job."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest

from ftc10d.demo.driver import DemoConfig, JobState
from ftc10d.demo.live import PlainView, print_summary
from ftc10d.demo.report import build_report
from tests.demo.test_report import synthetic_run


def state() -> JobState:
    st = JobState(DemoConfig(Path("unused"), steps=50))
    now = time.time()
    st.apply({"t": now, "kind": "admitted", "pid": 7, "slot": 0, "rank": 0, "world_size": 2, "epoch": 1})
    for s in range(1, 4):
        st.apply({"t": now + s, "kind": "step", "pid": 7, "slot": 0, "step": s, "ok": True, "loss": 0.5,
                  "epoch": 1, "rank": 0, "world_size": 2})
    st.apply({"t": now + 5, "kind": "fenced", "pid": 7, "slot": 0})
    return st


def test_plain_view_prints_each_event_once() -> None:
    out = io.StringIO()
    view, st = PlainView(out), state()
    view.update(st)
    view.update(st)
    text = out.getvalue()
    assert text.count("admitted as rank 0 of 2") == 1
    assert "found itself fenced" in text


def test_rich_view_renders() -> None:
    pytest.importorskip("rich")
    from rich.console import Console

    from ftc10d.demo.live import LiveView

    con = Console(width=100, file=io.StringIO())
    con.print(LiveView()._render(state()))
    text = con.file.getvalue()
    assert "step 3/50" in text and "rejoining" in text


def test_summary_plain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = build_report(synthetic_run(tmp_path), world_size=3, steps=20)
    print_summary(report, str(tmp_path), rich_output=False)
    out = capsys.readouterr().out
    assert "kill" in out and "join" in out and "replicas bitwise-identical: yes" in out
