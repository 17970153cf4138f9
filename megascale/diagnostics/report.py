"""Turn every rank's published record into the doctor's verdict: a table and a JSON report.

A group's number is the slowest member's (a collective finishes when its last
member does); a link's number is what its receiving rank measured. Anything a
rank did not publish (it died, hung or skipped the check) becomes a failing
status that names the ranks, so a broken rank is reported rather than silently
missing from the table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from megascale.diagnostics.checks import GROUP_CHECKS
from megascale.diagnostics.detect import OK, Finding, Measurement, find_problems, suspect_ranks
from megascale.distributed.topology import AXES, GROUP_AXES, RankLayout

# Worst first: the status a unit gets when its members disagree.
STATUS_ORDER = ("timeout", "error", "missing", "skipped", OK)
COLLECTIVES = tuple(name for name in GROUP_CHECKS if name != "p2p")


def _find(record: Optional[dict], check: str, kind: Optional[str], ranks: list[int]) -> Optional[dict]:
    if record is None:
        return None
    for result in record.get("results", []):
        if result["check"] == check and result["kind"] == kind and list(result["ranks"]) == list(ranks):
            return result
    return None


def _combine(records: dict[int, Optional[dict]], members: list[int], check: str, kind: Optional[str],
             measured_by: Optional[list[int]] = None) -> tuple[str, str, list[dict], list[int]]:
    """(status, detail, ok results, culprit ranks) of one unit over the ranks that measure it.

    The culprits are the ranks with the worst status; among ranks that timed
    out, those that never arrived at the collective (the others waited for them).
    """
    statuses: dict[int, tuple[str, str]] = {}
    absent: set[int] = set()
    oks: list[dict] = []
    for rank in measured_by or members:
        result = _find(records.get(rank), check, kind, members)
        if result is None:
            statuses[rank] = ("missing", "no result")
        elif result["status"] != OK:
            statuses[rank] = (result["status"], result.get("error", ""))
            if result.get("arrived") is False:
                absent.add(rank)
        else:
            oks.append(result)
    if not statuses:
        return OK, "", oks, []
    worst = min((status for status, _ in statuses.values()), key=STATUS_ORDER.index)
    detail = "; ".join(f"rank {rank} {status}" + (f": {why}" if why and status != "skipped" else "")
                       for rank, (status, why) in sorted(statuses.items()))
    culprits = sorted(rank for rank, (status, _) in statuses.items() if status == worst)
    return worst, detail, oks, sorted(absent & set(culprits)) or culprits


def rank_rows(layout: RankLayout, records: dict[int, Optional[dict]]) -> list[dict]:
    """One row per rank: host, device, coordinates and matmul throughput."""
    rows = []
    for rank in range(layout.world_size):
        record = records.get(rank) or {}
        status, detail, oks, _ = _combine(records, [rank], "matmul", None)
        rows.append({"rank": rank, "host": record.get("host"), "device": record.get("device"),
                     "coords": layout.coords(rank), "matmul_tflops": oks[0]["tflops"] if oks else None,
                     "peak_tflops": record.get("peak_tflops"), "status": status, "detail": detail,
                     "finished": bool(record.get("done"))})
    return rows


def group_rows(layout: RankLayout, records: dict[int, Optional[dict]]) -> list[dict]:
    """One row per group of each axis of size > 1: bus bandwidths and latency of its slowest member."""
    rows = []
    for kind in AXES:
        if layout.size(kind) < 2:
            continue
        for members in layout.all_groups(GROUP_AXES[kind]):
            row: dict[str, Any] = {"kind": kind, "ranks": members}
            for check in COLLECTIVES:
                status, detail, oks, culprits = _combine(records, members, check, kind)
                seconds = max((r["seconds"] for r in oks), default=None) if status == OK else None
                row[check] = {"status": status, "detail": detail, "seconds": seconds, "culprits": culprits,
                              **_rates(check, oks, seconds, len(members))}
            rows.append(row)
    return rows


def _rates(check: str, oks: list[dict], seconds: Optional[float], size: int) -> dict:
    if seconds is None or not oks:
        return {}
    if check == "latency":
        return {"latency_us": seconds * 1e6}
    factor = 2 * (size - 1) / size if check == "all_reduce" else (size - 1) / size
    return {"bytes": oks[0]["bytes"], "busbw_gbps": oks[0]["bytes"] / seconds * factor / 1e9}


def link_rows(layout: RankLayout, records: dict[int, Optional[dict]]) -> list[dict]:
    """One row per ring link (previous -> next member) of every group: point-to-point bandwidth."""
    rows = []
    for kind in AXES:
        if layout.size(kind) < 2:
            continue
        for members in layout.all_groups(GROUP_AXES[kind]):
            for index, dst in enumerate(members):
                src = members[index - 1]
                status, detail, oks, _ = _combine(records, members, "p2p", kind, measured_by=[dst])
                rows.append({"kind": kind, "src": src, "dst": dst, "status": status, "detail": detail,
                             "bw_gbps": oks[0]["bw_gbps"] if oks else None,
                             "seconds": oks[0]["seconds"] if oks else None})
    return rows


def _measurements(ranks: list[dict], groups: list[dict], links: list[dict],
                  records: dict[int, Optional[dict]]) -> list[Measurement]:
    items = [Measurement(f"rank {row['rank']}", "matmul", (row["rank"],), row["status"], row["matmul_tflops"],
                         "TFLOP/s", peak=row["peak_tflops"], detail=row["detail"], peer_group="matmul")
             for row in ranks]
    for row in groups:
        for check in COLLECTIVES:
            cell = row[check]
            latency = check == "latency"
            value = cell.get("latency_us" if latency else "busbw_gbps")
            # a failed unit blames its culprits; a slow one, all its members
            involved = tuple(cell["culprits"] or row["ranks"])
            items.append(Measurement(f"{row['kind']} group {row['ranks']}", check, involved, cell["status"],
                                     value, "us" if latency else "GB/s", higher_is_better=not latency,
                                     detail=cell["detail"], peer_group=f"{check}/{row['kind']}"))
    items += [Measurement(f"{row['kind']} link {row['src']}->{row['dst']}", "p2p", (row["src"], row["dst"]),
                          row["status"], row["bw_gbps"], "GB/s", detail=row["detail"], peer_group=f"p2p/{row['kind']}")
              for row in links]
    for rank, record in sorted(records.items()):  # failures outside any table cell (a barrier after a check)
        for result in (record or {}).get("results", []):
            if result["check"] == "barrier":
                items.append(Measurement(f"rank {rank}", f"barrier after {result['kind'] or 'matmul'}", (rank,),
                                         result["status"], detail=result.get("error", "")))
    return items


def build_report(layout: RankLayout, records: dict[int, Optional[dict]], threshold: float,
                 min_peak_fraction: float, exit_codes: Optional[dict[int, int]] = None,
                 frozen: Optional[dict[int, float]] = None) -> dict:
    """The whole verdict as a JSON-ready dict: rows, findings, suspect ranks and ``healthy``.

    ``exit_codes`` are the non-zero exit codes of ranks (from the launcher);
    ``frozen`` maps a rank the launcher had to end to its seconds without a heartbeat.
    """
    ranks, groups, links = rank_rows(layout, records), group_rows(layout, records), link_rows(layout, records)
    findings = find_problems(_measurements(ranks, groups, links, records), threshold, min_peak_fraction)
    primary = [f for f in findings if f.reason != "skipped"] or findings  # skips follow from another failure
    for rank, row in enumerate(ranks):
        if not records.get(rank):
            code = (exit_codes or {}).get(rank)
            primary.insert(0, Finding(f"rank {rank}", "start", "missing", (rank,),
                                      detail="published nothing" + (f"; exit code {code}" if code is not None else "")))
        elif not row["finished"]:
            primary.append(Finding(f"rank {rank}", "finish", "missing", (rank,), detail="stopped before the end"))
        if frozen and rank in frozen:
            primary.append(Finding(f"rank {rank}", "heartbeat", "timeout", (rank,),
                                   detail=f"no heartbeat for {frozen[rank]:.0f} s (stopped or frozen); ended"))
        code = (exit_codes or {}).get(rank)
        # A rank that died (killed, crashed) after publishing something; once a rank is done, an exit code
        # is the launcher ending it because another rank failed, which says nothing about this one.
        if records.get(rank) and code and not row["finished"]:
            primary.append(Finding(f"rank {rank}", "exit", "error", (rank,), detail=f"exit code {code}"))
    flagged = {finding.subject for finding in primary}
    for row in ranks:
        row["flagged"] = f"rank {row['rank']}" in flagged
    return {
        "world_size": layout.world_size,
        "layout": {axis: layout.size(axis) for axis in AXES} | {"order": layout.order},
        "threshold": threshold,
        "min_peak_fraction": min_peak_fraction,
        "ranks": ranks,
        "groups": groups,
        "links": links,
        "findings": [finding.to_dict() for finding in primary],
        "suspect_ranks": suspect_ranks(primary),
        "healthy": not primary,
    }


def _fmt(value: Optional[float], digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _cell(cell: dict, key: str) -> str:
    return _fmt(cell.get(key)) if cell["status"] == OK else cell["status"].upper()


def format_table(report: dict) -> str:
    """The human table: ranks, groups, links, then what was flagged."""
    layout = report["layout"]
    lines = [f"megascale doctor: {report['world_size']} rank(s), "
             + ", ".join(f"{axis} {layout[axis]}" for axis in AXES)
             + f"; flag: {report['threshold']:.0%} slower than peers' median, or failing", ""]
    flagged_subjects = {f["subject"] for f in report["findings"]}
    lines.append(f"{'rank':>4}  {'host':<16} {'device':<22} {'tp cp dp pp':<12} {'matmul TFLOP/s':>14} "
                 f"{'peak':>6}  status")
    for row in report["ranks"]:
        coords = " ".join(f"{row['coords'][a]:>2}" for a in AXES)
        status = row["status"].upper() if row["status"] != OK else ("FLAGGED" if row["flagged"] else "ok")
        lines.append(f"{row['rank']:>4}  {str(row['host'])[:16]:<16} {str(row['device'])[:22]:<22} {coords:<12} "
                     f"{_fmt(row['matmul_tflops']):>14} {_fmt(row['peak_tflops'], 4):>6}  {status}")
    if report["groups"]:
        lines += ["", f"{'group':<22} {'all-reduce GB/s':>16} {'all-gather GB/s':>16} {'latency us':>11}  status"]
        for row in report["groups"]:
            subject = f"{row['kind']} group {row['ranks']}"
            status = "FLAGGED" if subject in flagged_subjects else "ok"
            lines.append(f"{subject[:22]:<22} {_cell(row['all_reduce'], 'busbw_gbps'):>16} "
                         f"{_cell(row['all_gather'], 'busbw_gbps'):>16} {_cell(row['latency'], 'latency_us'):>11}  "
                         f"{status}")
    if report["links"]:
        lines += ["", f"{'link':<22} {'p2p GB/s':>16}  status"]
        for row in report["links"]:
            subject = f"{row['kind']} link {row['src']}->{row['dst']}"
            value = _fmt(row["bw_gbps"]) if row["status"] == OK else row["status"].upper()
            lines.append(f"{subject[:22]:<22} {value:>16}  {'FLAGGED' if subject in flagged_subjects else 'ok'}")
    lines.append("")
    if report["healthy"]:
        lines.append("healthy: no rank or link slower than its peers by the threshold, nothing failed")
    else:
        lines.append(f"FLAGGED ({len(report['findings'])}):")
        lines += [f"  {finding['message']}" for finding in report["findings"]]
        lines.append("suspect ranks: " + ", ".join(map(str, report["suspect_ranks"])))
    return "\n".join(lines)


def write_json(report: dict, path: str | Path) -> None:
    """Write the report as indented JSON (parent directories created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


__all__ = ["build_report", "format_table", "group_rows", "link_rows", "rank_rows", "write_json"]
