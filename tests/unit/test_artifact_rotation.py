"""playbooks.rotate_artifacts: the newest runs are kept, and gpuctl commands
rotating the same artifacts directory at once (they share the cluster's
ansible-runner private data dir) never fail on each other's removals."""

from __future__ import annotations

import threading
from pathlib import Path

from gpuctl.configplane.playbooks import rotate_artifacts


def _runs(root: Path, n: int) -> list[Path]:
    paths = []
    for i in range(n):
        p = root / f"20260101T{i // 60:02d}{i % 60:02d}00-run-{i:06x}"  # run_playbook's ident: start time first
        (p / "job_events").mkdir(parents=True)
        (p / "job_events" / "1-event.json").write_text("{}")
        (p / "stdout").write_text("x")
        paths.append(p)
    return paths


def test_keeps_the_newest(tmp_path: Path) -> None:
    runs = _runs(tmp_path, 12)
    rotate_artifacts(tmp_path, keep=5)
    assert sorted(tmp_path.iterdir()) == runs[-5:]
    rotate_artifacts(tmp_path, keep=5)
    assert sorted(tmp_path.iterdir()) == runs[-5:]


def test_missing_dir_is_fine(tmp_path: Path) -> None:
    rotate_artifacts(tmp_path / "absent", keep=1)


def test_concurrent_rotations_do_not_fail(tmp_path: Path) -> None:
    runs = _runs(tmp_path, 300)
    errors: list[BaseException] = []
    go = threading.Barrier(6)

    def rotate() -> None:
        go.wait()
        try:
            rotate_artifacts(tmp_path, keep=10)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=rotate) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(tmp_path.iterdir()) == runs[-10:]
