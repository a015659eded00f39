"""``ftc10d trace DIR``: which rank did not join which collective, per generation.

Reads one dump per rank (the JSON twins when present, else torch-format pickles
through an unpickler that builds nothing but plain containers), groups entries
by configuration ("generation": sequence numbers restart with each), and
reports for each one: the first collective not joined by every member, the
ranks missing or behind, mismatched op types / shapes / dtypes, ops that never
completed, and a one-line verdict.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

_RANK_RE = re.compile(r"(\d+)(?:\.json)?$")


class _PlainUnpickler(pickle.Unpickler):
    """Dumps hold dicts, lists, tuples, str, int, float, bool and None only."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a flight-recorder dump")


def _load_pickle(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        return _PlainUnpickler(io.BytesIO(f.read())).load()


def load_dir(path: str) -> dict[int, dict[str, Any]]:
    """rank -> dump. JSON twins win over pickles of the same rank."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory of flight-recorder dumps")
    dumps: dict[int, dict[str, Any]] = {}
    names = sorted(os.listdir(path))
    for name in names:
        full = os.path.join(path, name)
        if not os.path.isfile(full) or name.startswith("."):
            continue
        m = _RANK_RE.search(name)
        if m is None:
            continue
        rank = int(m.group(1))
        if name.endswith(".json"):
            with open(full) as f:
                dumps[rank] = json.load(f)
        elif rank not in dumps:
            try:
                dumps[rank] = _load_pickle(full)
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError):
                continue  # not a dump
    if not dumps:
        raise FileNotFoundError(f"no flight-recorder dumps in {path}")
    return dumps


@dataclass
class Mismatch:
    seq: int
    field: str
    values: dict[int, str]


@dataclass
class GenerationReport:
    pg_name: str
    label: str
    members: list[int]
    dumped: list[int]
    last_seq: dict[int, int]
    first_incomplete_seq: Optional[int] = None
    op: str = ""
    missing: list[int] = field(default_factory=list)
    behind: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    waited_s: float = 0.0
    not_completed: dict[int, str] = field(default_factory=dict)
    mismatches: list[Mismatch] = field(default_factory=list)
    verdict: str = ""

    @property
    def problem(self) -> bool:
        return bool(self.missing or self.mismatches or self.not_completed)


def _op_name(profiling_name: str) -> str:
    return profiling_name.split(":", 1)[-1].split(" ")[0]


def _ended_ns(e: dict[str, Any], dumped_ns: Optional[int]) -> Optional[int]:
    return e.get("time_discovered_completed_ns") or e.get("time_failed_ns") or dumped_ns


def analyze(dumps: dict[int, dict[str, Any]]) -> list[GenerationReport]:
    # pg name -> (desc, members), and per rank, pg name -> seq -> entry
    config: dict[str, tuple[str, list[int]]] = {}
    per_pg: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    first_seen: dict[str, int] = {}
    for rank, d in dumps.items():
        for name, info in d.get("pg_config", {}).items():
            ranks = [int(r) for r in str(info.get("ranks", "[]")).strip("[]").split(",") if r.strip()]
            config.setdefault(name, (str(info.get("desc", "")), ranks))
        for e in d.get("entries", []):
            if e.get("is_p2p"):
                continue
            name = e["process_group"][0]
            per_pg.setdefault(name, {}).setdefault(rank, {})[int(e["collective_seq_id"])] = e
            first_seen[name] = min(first_seen.get(name, e["time_created_ns"]), e["time_created_ns"])
    reports = []
    for name in sorted(per_pg, key=lambda n: first_seen[n]):
        desc, members = config.get(name, ("", sorted(per_pg[name])))
        by_rank = per_pg[name]
        dumped = sorted(r for r in members if r in dumps)
        last = {r: max(by_rank.get(r, {}) or {0: None}) for r in dumped}
        rep = GenerationReport(name, desc.replace("ftc10d ", "") or name, members, dumped, last)
        all_seqs = sorted({s for r in dumped for s in by_rank.get(r, {})})
        for s in all_seqs:
            have = [r for r in dumped if s in by_rank.get(r, {})]
            entries = {r: by_rank[r][s] for r in have}
            for fld in ("profiling_name", "input_sizes", "input_dtypes"):
                vals = {r: str(e[fld] if fld != "profiling_name" else _op_name(e[fld])) for r, e in entries.items()}
                if len(set(vals.values())) > 1:
                    rep.mismatches.append(Mismatch(s, fld, vals))
            if rep.first_incomplete_seq is not None:
                continue
            missing = [r for r in dumped if r not in have]
            stuck = {r: (e.get("error") or e["state"]) for r, e in entries.items() if e["state"] != "completed"}
            if missing or stuck:
                rep.first_incomplete_seq = s
                rep.op = _op_name(next(iter(entries.values()))["profiling_name"])
                rep.missing = missing
                rep.not_completed = stuck
                rep.waiting = sorted(stuck)
                waits = []
                for r in rep.waiting:
                    end = _ended_ns(entries[r], dumps[r].get("time_dumped_ns"))
                    if end:
                        waits.append((end - entries[r]["time_created_ns"]) / 1e9)
                rep.waited_s = max(waits) if waits else 0.0
        if rep.first_incomplete_seq is not None:
            top = max(last.values()) if last else 0
            rep.behind = sorted(r for r, s in last.items()
                                if s is not None and s < rep.first_incomplete_seq and s < top)
        rep.verdict = _verdict(rep)
        reports.append(rep)
    return reports


def _ranks(rs: list[int]) -> str:
    return ",".join(str(r) for r in rs)


def _verdict(rep: GenerationReport) -> str:
    where = f"{rep.op} #{rep.first_incomplete_seq} of {rep.label}"
    if rep.missing:
        who = "rank" if len(rep.missing) == 1 else "ranks"
        waited = ""
        if rep.waiting:
            whose = "rank" if len(rep.waiting) == 1 else "ranks"
            waited = f"; {whose} {_ranks(rep.waiting)} waited {rep.waited_s:.1f} s"
        return f"{who} {_ranks(rep.missing)} never entered {where}{waited}"
    if rep.mismatches:
        m = rep.mismatches[0]
        return f"{m.field} differ at collective #{m.seq} of {rep.label}: " + ", ".join(
            f"rank {r}: {v}" for r, v in sorted(m.values.items())
        )
    if rep.not_completed:
        kinds = sorted(set(rep.not_completed.values()))
        return (
            f"every member entered {where} but it did not complete ({', '.join(kinds)}) on "
            f"ranks {_ranks(sorted(rep.not_completed))}; waited {rep.waited_s:.1f} s"
        )
    return f"{rep.label}: all {len(rep.members)} members completed every recorded collective"


def format_text(reports: list[GenerationReport]) -> str:
    lines = []
    for rep in reports:
        lines.append(f"== {rep.label} ({rep.pg_name}): members {_ranks(rep.members)}")
        absent = sorted(set(rep.members) - set(rep.dumped))
        if absent:
            lines.append(f"   no dump from ranks {_ranks(absent)}")
        lines.append("   last collective per rank: " + ", ".join(f"{r}:#{s}" for r, s in sorted(rep.last_seq.items())))
        if rep.first_incomplete_seq is not None:
            lines.append(f"   first collective not completed by all: {rep.op} #{rep.first_incomplete_seq}")
        if rep.missing:
            lines.append(f"   missing: {_ranks(rep.missing)}")
        if rep.behind:
            lines.append(f"   behind: {_ranks(rep.behind)}")
        for r, why in sorted(rep.not_completed.items()):
            lines.append(f"   rank {r}: not completed ({why})")
        for m in rep.mismatches[:10]:
            lines.append(f"   mismatch at #{m.seq} in {m.field}: "
                         + ", ".join(f"{r}={v}" for r, v in sorted(m.values.items())))
        lines.append(f"   verdict: {rep.verdict}")
    return "\n".join(lines)


def main(path: str, as_json: bool = False) -> int:
    """Print the analysis of ``path``; return 1 if a problem was found, else 0."""
    reports = analyze(load_dir(path))
    if as_json:
        print(json.dumps({"problem": any(r.problem for r in reports), "generations": [
            {**asdict(r), "problem": r.problem} for r in reports
        ]}, indent=2))
    else:
        print(format_text(reports))
    return 1 if any(r.problem for r in reports) else 0
