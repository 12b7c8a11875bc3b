"""The output-directory lock eval and train share, and the typed reading of records (moba_hf/rundir.py)."""

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moba_hf import rundir
from moba_hf.rundir import DirInUse, field_problem, lock_dir

ROOT = Path(__file__).resolve().parents[1]


def test_a_lock_held_by_a_child_of_an_ended_run_says_so(tmp_path):
    """A process the run started (a data-loader worker) keeps the lock after the run's own process ended."""
    parent = textwrap.dedent("""
        import os, subprocess, sys
        from moba_hf.rundir import lock_dir
        held = lock_dir(sys.argv[1], why="")
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, pass_fds=[held._handle.fileno()])
        print(child.pid, flush=True)
        os._exit(0)  # ends without releasing: the child holds the lock on
    """)
    done = subprocess.run([sys.executable, "-c", parent, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    child = int(done.stdout.strip())
    try:
        with pytest.raises(DirInUse, match=r"which has ended; a process it started still holds the lock, holding "):
            lock_dir(tmp_path, why="")
    finally:
        os.kill(child, 9)


def test_a_file_system_without_locks_runs_unlocked_with_a_log_line(tmp_path, monkeypatch, caplog):
    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rundir.fcntl, "flock", no_locks)
    with caplog.at_level("WARNING", logger="moba_hf"), lock_dir(tmp_path, why=""):
        pass
    assert f"cannot lock {tmp_path}/run.lock ([Errno {errno.ENOLCK}] No locks available)" in caplog.text


@pytest.mark.parametrize(
    "value, spec, problem",
    [
        ("false", bool, "field 'x' is \"false\" (a string), expected a boolean"),
        (True, int, "field 'x' is true (a boolean), expected an integer"),
        (1.0, int, "field 'x' is 1.0 (a number), expected an integer"),
        (False, float, "field 'x' is false (a boolean), expected a number"),
        ("1", float | None, "field 'x' is \"1\" (a string), expected a number or null"),
        ({"0": None}, dict[str, float], "field 'x' is {\"0\": null} (an object), expected an object of numbers"),
        (["a", 1], list[str], "field 'x' is [\"a\", 1] (an array), expected an array of strings"),
        ("y" * 100, int, f"field 'x' is \"{'y' * 56}... (a string), expected an integer"),
    ],
)
def test_field_problem_names_field_value_and_expected_type(value, spec, problem):
    assert field_problem({"x": value}, {"x": spec}) == problem


@pytest.mark.parametrize(
    "value, spec",
    [(True, bool), (3, int), (3, float), (0.5, float), (None, float | None), ({"0": 1, "1": 0.5}, dict[str, float]),
     (["a"], list[str]), ([], list[dict]), ("s", str | int), (4, str | int)],
)  # fmt: skip
def test_field_problem_accepts_what_the_writers_write(value, spec):
    assert field_problem({"x": value}, {"x": spec}) is None


def test_a_missing_required_field_is_named():
    assert field_problem({}, {"x": int}, required=("x",)) == "no field 'x' (an integer)"
    assert field_problem({}, {"x": int}) is None  # optional unless required
