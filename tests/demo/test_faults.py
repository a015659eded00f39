"""`ftc10d demo --faults`: the schedule syntax and its errors."""

from __future__ import annotations

import pytest

from ftc10d.demo.faults import DEFAULT_FREEZE_S, Fault, FaultScheduleError, parse_schedule
from ftc10d.types import InvalidOptionError


def test_parses_kill_and_freeze_in_step_order() -> None:
    out = parse_schedule("freeze:2@70:2.5, kill:1@30", world_size=4, steps=100)
    assert out == [Fault("kill", 1, 30), Fault("freeze", 2, 70, 2.5)]
    assert [str(f) for f in out] == ["kill:1@30", "freeze:2@70:2.5"]


def test_freeze_duration_defaults_and_none_is_empty() -> None:
    assert parse_schedule("freeze:0@5", world_size=2, steps=10) == [Fault("freeze", 0, 5, DEFAULT_FREEZE_S)]
    assert parse_schedule("none", world_size=2, steps=10) == []
    assert parse_schedule("", world_size=2, steps=10) == []
    assert parse_schedule(None, world_size=2, steps=10) == []


@pytest.mark.parametrize("text, words", [
    ("kil:1@30", "unknown kind 'kil'"),
    ("kill:1", "KIND:SLOT@STEP"),
    ("kill@30", "KIND:SLOT@STEP"),
    ("kill:x@30", "KIND:SLOT@STEP"),
    ("kill:4@30", "slot 4 is not in [0, 4)"),
    ("kill:1@0", "step 0 is not in [1, 100)"),
    ("kill:1@100", "step 100 is not in [1, 100)"),
    ("kill:1@30:2", "a kill takes no duration"),
    ("freeze:1@30:0", "freeze duration must be in (0, 60]"),
    ("freeze:1@30:1.2.3", "not a number"),
    ("kill:1@30,,freeze:2@40", "empty item"),
    ("kill:1@30,freeze:1@30", "at the same step"),
    ("kill:0@30,kill:1@30,kill:2@30,kill:3@30", "at least one worker must survive"),
])
def test_errors_say_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(FaultScheduleError) as info:
        parse_schedule(text, world_size=4, steps=100)
    assert words in str(info.value)
    assert isinstance(info.value, InvalidOptionError)


def test_cli_rejects_a_bad_schedule_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    from ftc10d.cli import main

    with pytest.raises(SystemExit) as info:
        main(["demo", "--faults", "kill:9@30"])
    assert info.value.code == 2
    assert "slot 9 is not in [0, 4)" in capsys.readouterr().err


def test_cli_rejects_a_pause_bound_that_is_not_positive(capsys: pytest.CaptureFixture[str]) -> None:
    from ftc10d.cli import main

    with pytest.raises(SystemExit) as info:
        main(["demo", "--max-pause", "0"])
    assert info.value.code == 2
    assert "--max-pause must be positive" in capsys.readouterr().err
