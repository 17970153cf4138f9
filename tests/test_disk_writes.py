"""RecordWriter: the run directory's bookkeeping writes warn once per file and outage instead of ending the run.

The full-disk drills (a real tmpfs filled from outside a 2-rank run) are in tests/test_disk_full.py; here the
warn-once / writable-again protocol and the leftovers, with writes that fail for a reason any file system has.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megascale.training.fault.disk_writes import RecordWriter, append_whole


def test_replace_warns_once_per_outage_and_leaves_no_temporary_file(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    writer = RecordWriter("the progress record")
    blocker = tmp_path / "attempts"
    blocker.write_text("a file where the directory should be")
    path = blocker / "0" / "progress.json"
    assert not writer.replace(path, "{}") and not writer.replace(path, "{}")
    err = capsys.readouterr().err
    assert err.count("cannot write the progress record") == 1 and str(path) in err
    blocker.unlink()
    assert writer.replace(path, '{"step": 3}')
    assert path.read_text() == '{"step": 3}'
    assert f"{path} is writable again" in capsys.readouterr().err
    assert sorted(p.name for p in path.parent.iterdir()) == ["progress.json"]


def test_append_keeps_whole_records(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    writer = RecordWriter("the phase timers")
    path = tmp_path / "timers.jsonl"
    assert writer.append(path, '{"step": 1}\n')
    path.unlink()
    path.mkdir()  # the append fails
    assert not writer.append(path, '{"step": 2}\n')
    path.rmdir()
    assert writer.append(path, '{"step": 3}\n')
    assert path.read_text() == '{"step": 3}\n'
    err = capsys.readouterr().err
    assert err.count("cannot write the phase timers") == 1 and "is writable again" in err
    append_whole(path, b'{"step": 4}\n', exclusive=False)
    assert path.read_text().splitlines() == ['{"step": 3}', '{"step": 4}']
