"""`folders.Folder`: below a folder's root no link is followed, by any write, rename, delete or read; a FIFO is
refused, not waited on; an over-long line is measured, not held (issue 54)."""

from __future__ import annotations

import io
import json
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest

from parity.config import ConfigError
from parity.files import LineTooLong, bounded_lines
from parity.folders import Folder, LinkError, NotRegularError, atomic_write_text, links_below, refuse_links


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder of the user's beside the one Parity works in, holding a private file."""
    folder = tmp_path / "home"
    folder.mkdir()
    (folder / "id_rsa").write_text("PRIVATE\n")
    return folder


def _untouched(outside: Path) -> bool:
    return sorted(p.name for p in outside.iterdir()) == ["id_rsa"] and (outside / "id_rsa").read_text() == "PRIVATE\n"


@pytest.fixture
def run(tmp_path) -> Path:
    root = tmp_path / "run"
    (root / "checkpoints" / "step_000001").mkdir(parents=True)
    (root / "metrics.jsonl").write_text('{"step": 1}\n')
    return root


@pytest.mark.parametrize("linked", ["checkpoints", "checkpoints/step_000001"])
def test_a_link_on_the_way_is_refused_naming_the_entry(linked, run, outside):
    (run / linked).rename(run / f"{linked}.moved")
    (run / linked).symlink_to(outside)
    with Folder.open(run, key="run_dir") as folder:
        with pytest.raises(LinkError, match=rf"run_dir {run}: {linked} is a symbolic link"):
            folder.write_text("checkpoints/step_000001/state.json", "{}")
        with pytest.raises(LinkError, match=rf"{linked} is a symbolic link"):
            folder.sub("checkpoints/step_000001", create=True)
        with pytest.raises(LinkError, match=rf"{linked} is a symbolic link"):
            folder.remove("checkpoints/step_000001")
        with pytest.raises(LinkError, match=rf"{linked} is a symbolic link"):
            folder.read_bytes("checkpoints/step_000001/id_rsa")
    assert _untouched(outside)


def test_a_linked_file_is_never_read_appended_to_or_locked(run, outside):
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(outside / "id_rsa")
    (run / ".lock").symlink_to(outside / "id_rsa")
    with Folder.open(run, key="run_dir") as folder:
        for act in (
            lambda: folder.read_bytes("metrics.jsonl"),
            lambda: folder.append_text("metrics.jsonl", "{}\n"),
            lambda: folder.open_lock(".lock"),
            lambda: folder.remove("metrics.jsonl"),
        ):
            with pytest.raises(LinkError, match="is a symbolic link"):
                act()
    assert _untouched(outside)


def test_a_lock_file_with_a_second_name_or_of_another_kind_is_refused_unwritten(run, outside):
    """A hard-linked .lock made a resume write its pid into the file it was linked to, outside the run."""
    os.link(outside / "id_rsa", run / ".lock")
    with Folder.open(run, key="run_dir") as folder:
        with pytest.raises(NotRegularError, match=r"\.lock: a file with 2 names, which Parity never makes"):
            folder.open_lock(".lock")
        (run / ".lock").unlink()
        os.mkfifo(run / ".lock")
        with pytest.raises(NotRegularError, match=r"\.lock: not a regular file"):
            folder.open_lock(".lock")
    assert _untouched(outside)


@pytest.mark.parametrize(
    "entry, make", [("checkpoints", "file"), ("completions", "file"), ("metrics.jsonl", "dir"), (".lock", "fifo")]
)
def test_a_run_entry_of_the_wrong_kind_is_refused_before_anything_is_written(entry, make, run):
    """`checkpoints` as a file read as a run without checkpoints: its resume wiped metrics.jsonl, then failed."""
    from parity.rundir import check_run_dir

    (run / "config.yaml").write_text("steps: 2\n")
    target = run / entry
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    {"file": lambda: target.write_text("x"), "dir": target.mkdir, "fifo": lambda: os.mkfifo(target)}[make]()
    with pytest.raises(ConfigError, match=rf"^run_dir: {run / entry} is not a (regular file|folder), as a run's"):
        check_run_dir(run)


def test_a_write_replaces_a_link_instead_of_writing_through_it(run, outside):
    """A rename replaces the name itself; the temporary file is created exclusively, never through a link."""
    (run / "config.yaml").symlink_to(outside / "id_rsa")
    with Folder.open(run) as folder:
        folder.write_text("config.yaml", "steps: 2\n")
    assert not (run / "config.yaml").is_symlink() and (run / "config.yaml").read_text() == "steps: 2\n"
    assert _untouched(outside)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl"]


def test_removing_a_folder_does_not_follow_the_links_inside_it(run, outside):
    (run / "checkpoints" / "step_000001" / "model").symlink_to(outside)
    with Folder.open(run) as folder:
        folder.remove("checkpoints/step_000001")
    assert not (run / "checkpoints" / "step_000001").exists() and _untouched(outside)


def test_the_root_may_be_a_link_the_user_made(run, tmp_path):
    link = tmp_path / "latest"
    link.symlink_to(run)
    with Folder.open(link) as folder:
        folder.append_text("metrics.jsonl", '{"step": 2}\n')
        assert folder.read_bytes("metrics.jsonl").count(b"step") == 2
    refuse_links(link, "run_dir")  # nothing below it is a link


def test_links_below_finds_links_at_any_depth_without_entering_them(run, outside):
    (run / "checkpoints" / "step_000001" / "adapter").symlink_to(outside)
    (run / "tensorboard").symlink_to(outside)
    assert links_below(run) == ["checkpoints/step_000001/adapter", "tensorboard"]
    with pytest.raises(LinkError, match="checkpoints/step_000001/adapter is a symbolic link"):
        refuse_links(run, "run_dir")


def test_a_fifo_is_refused_not_waited_on(run):
    os.mkfifo(run / "metrics.jsonl.fifo")
    with Folder.open(run) as folder, pytest.raises(NotRegularError, match="not a regular file"):
        folder.read_bytes("metrics.jsonl.fifo")  # a blocking open would wait here for a writer for ever


def test_a_library_path_names_the_folder_that_was_opened(run, tmp_path):
    """`Folder.path` goes through the open descriptor: renaming the folder (and linking its old name to
    another one) after it was opened does not redirect a write."""
    with Folder.open(run) as root, root.sub("checkpoints") as checkpoints:
        (run / "checkpoints").rename(run / "moved")
        (run / "checkpoints").symlink_to(tmp_path)
        (checkpoints.path() / "written").write_text("x")
    assert (run / "moved" / "written").is_file() and not (tmp_path / "written").exists()


def test_atomic_write_text_leaves_no_temporary_file(tmp_path):
    atomic_write_text(tmp_path / "a" / "b.json", "{}\n")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.json"]


def test_an_over_long_line_is_measured_not_held():
    """A 64 MiB line under a 1 MiB bound: its length is reported, and no more than a few chunks are held."""
    data = io.BytesIO(b'{"step": 1}\n' + b"x" * (64 * 2**20) + b"\n")
    tracemalloc.start()
    try:
        with pytest.raises(LineTooLong, match="line 2 is 67,108,864 bytes, more than the 1,048,576"):
            list(bounded_lines(data, 2**20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20


def test_links_in_a_trackers_folder_may_lead_only_where_the_tracker_keeps_files(tmp_path, monkeypatch):
    """W&B's own links in a run's wandb/ (to its runs there, to its cache) pass; one leading anywhere else, or
    wandb/ itself a link, is refused, naming it."""
    from parity.rundir import refuse_run_links

    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    (run / "wandb" / "run-1" / "files").mkdir(parents=True)
    (tmp_path / "cache" / "logs").mkdir(parents=True)
    (run / "wandb" / "latest-run").symlink_to("run-1")
    (run / "wandb" / "run-1" / "files" / "debug.log").symlink_to(tmp_path / "cache" / "logs")
    refuse_run_links(run, "run_dir")
    (tmp_path / "elsewhere").mkdir()
    (run / "wandb" / "run-1" / "files" / "out").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="wandb/run-1/files/out"):
        refuse_run_links(run, "run_dir")
    (run / "wandb" / "run-1" / "files" / "out").unlink()
    (run / "wandb").rename(tmp_path / "w")
    (run / "wandb").symlink_to(tmp_path / "w")
    with pytest.raises(ConfigError, match="wandb"):
        refuse_run_links(run, "run_dir")


def test_a_resumed_runs_log_is_read_line_by_line_and_a_line_no_step_makes_is_refused(run):
    """`--resume` read metrics.jsonl whole: a file of gigabytes was a MemoryError traceback."""
    from parity.rl.metrics_log import MAX_LINE_BYTES, MetricsLog

    lines = [json.dumps({"step": s, "mismatch/k3": 0.1}) for s in (1, 2, 3)] + ['{"step": 4, "mism']
    (run / "metrics.jsonl").write_text("\n".join(lines))
    log = MetricsLog(run, [])
    log.truncate_after(2)  # the steps past the checkpoint, and a line a kill cut short, go
    assert [row["step"] for row in log.rows()] == [1, 2]
    with open(run / "metrics.jsonl", "ab") as f:
        f.truncate(f.tell() + MAX_LINE_BYTES + 10)  # sparse: a line of zeros no step's metrics make
    with pytest.raises(ConfigError, match=rf"^{run}/metrics.jsonl:3: 16,777,226 bytes, more than a step's metrics"):
        log.truncate_after(2)


def test_an_os_error_names_the_entry_by_its_whole_path(run):
    """Through a descriptor the OS names only the leaf: `error: .step_000020.jsonl.4c72c9c0.tmp: Permission
    denied`, a temporary file's name without the run's."""
    name = "x" * 250  # its temporary file's name is past the 255 bytes a name may hold
    with Folder.open(run, key="run_dir") as folder:
        with pytest.raises(OSError) as caught:
            folder.write_text(name, "")
    assert caught.value.filename == str(run / name) and "too long" in caught.value.strerror
