"""tools/gpu_suite.py's bookkeeping on the CPU: what it runs, how it counts a pytest log, what it writes, and that a
timed-out item is killed with its children and still reports the tests it finished."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import gpu_suite  # noqa: E402

LOG = """\
tests/test_x_cuda.py::test_a PASSED                                      [ 20%]
tests/test_x_cuda.py::test_b[2-1-knobs0] FAILED                          [ 40%]
tests/test_x_cuda.py::test_c SKIPPED (needs two GPUs)                    [ 60%]
tests/test_x_cuda.py::test_d XFAIL (flex bf16)                           [ 80%]
tests/test_x_cuda.py::test_e PASSED                                      [100%]
tests/test_x_cuda.py::test_e ERROR                                       [100%]
tests/test_x_cuda.py::test_f[pp2-overlap]
"""


def test_every_cuda_test_file_is_an_item_and_the_cited_ones_come_first():
    names = [p.name for p in gpu_suite.test_files()]
    assert sorted(names) == sorted(p.name for p in Path("tests").glob("test_*_cuda.py"))
    assert names[: len(gpu_suite.TEST_ORDER)] == list(gpu_suite.TEST_ORDER)


def test_a_pytest_log_is_counted_per_test_with_a_teardown_error_winning():
    counts, failed = gpu_suite.parse_pytest_log(LOG)
    assert counts == {"PASSED": 1, "FAILED": 1, "ERROR": 1, "SKIPPED": 1, "XFAIL": 1, "XPASS": 0}
    assert failed == ["tests/test_x_cuda.py::test_b[2-1-knobs0]", "tests/test_x_cuda.py::test_e"]
    assert list(gpu_suite.test_outcomes(LOG).items())[-1] == ("tests/test_x_cuda.py::test_f[pp2-overlap]", "RUNNING")


def test_the_results_file_has_a_row_per_file_and_each_bench_table():
    tests = gpu_suite.Result("test_x_cuda.py", ["py"], status="timed out (60 s)", seconds=60.4)
    tests.counts, tests.failed = gpu_suite.parse_pytest_log(LOG)
    tests.outcomes = gpu_suite.test_outcomes(LOG)
    bench = gpu_suite.Result("logprob_gap", ["py", "tools/bench_logprob_gap.py"], status="finished", seconds=3)
    bench.output = "row | mean\ntrainer | 6.4e-03\n"
    text = gpu_suite.render([tests, bench], header={"date": "d", "machine": "m", "commit": "c"})
    assert "| `test_x_cuda.py` | timed out (60 s) | 1 | 1 | 1 | 1 | 1 | 60 |" in text
    assert "- `tests/test_x_cuda.py::test_b[2-1-knobs0]` FAILED" in text
    assert "- `tests/test_x_cuda.py::test_f[pp2-overlap]` RUNNING" in text
    assert "### bench logprob_gap" in text and "trainer | 6.4e-03" in text
    assert "- **commit**: c" in text


def test_a_timed_out_item_is_killed_with_its_children(tmp_path):
    child = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    )
    script += f"open({str(child)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)"
    start = time.monotonic()
    status, seconds, output = gpu_suite.run_item(
        [sys.executable, "-c", script], timeout_s=3, log=tmp_path / "item.log"
    )
    assert status == "timed out (3 s)" and output.strip() == "started"
    assert 3 <= seconds < 30 and time.monotonic() - start < 30
    pid = int(child.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the item's child outlived its timeout"
        time.sleep(0.1)


def test_only_naming_no_item_is_one_clear_error(capsys):
    with pytest.raises(SystemExit) as err:
        gpu_suite.main(["--only", "test_nothing_cuda.py", "--list"])
    assert err.value.code == 2 and "--only names no item: test_nothing_cuda.py" in capsys.readouterr().err


def test_a_rerun_keeps_the_hand_kept_earlier_figures_and_replaces_the_rest(tmp_path):
    out = tmp_path / "gpu-results.md"
    earlier = "## Earlier figures\n\n| id | figure |\n| --- | --- |\n| E1 | 94 ms |\n"
    out.write_text("# GPU results\n\n- **commit**: old\n\n" + earlier)
    assert gpu_suite.earlier_section(out.read_text()) == earlier
    argv = [
        "--only",
        "logprob_gap",
        "--budget-s",
        "0",
        "--out",
        str(out),
        "--log-dir",
        str(tmp_path),
        "--commit",
        "new",
    ]
    assert gpu_suite.main(argv) == 1
    text = out.read_text()
    assert "- **commit**: new" in text and "- **commit**: old" not in text
    assert text.endswith(earlier) and "not run (budget)" in text


def test_lanes_take_consecutive_slices_of_the_visible_gpus_and_too_few_is_one_error():
    assert gpu_suite.lane_devices(2, 2, None) == ["0,1", "2,3"]
    assert gpu_suite.lane_devices(2, 1, "4,6,7") == ["4", "6"]
    with pytest.raises(ValueError, match="needs 4 GPUs; CUDA_VISIBLE_DEVICES has 3"):
        gpu_suite.lane_devices(2, 2, "0,1,2")


def test_lanes_run_items_at_the_same_time_each_with_its_own_gpus(tmp_path, monkeypatch):
    # Two fake benches that each record the GPUs they see and wait until the other has started: they finish only if
    # the two lanes run them at the same time.
    script = (
        "import os, sys, time, pathlib; d = pathlib.Path(sys.argv[1]); n = sys.argv[2]\n"
        "(d / n).write_text(os.environ.get('CUDA_VISIBLE_DEVICES', ''))\n"
        "end = time.time() + 20\n"
        "while len(list(d.iterdir())) < 2 and time.time() < end: time.sleep(0.05)\n"
        "print('both' if len(list(d.iterdir())) == 2 else 'alone')\n"
    )
    seen = tmp_path / "seen"
    seen.mkdir()
    monkeypatch.setattr(gpu_suite, "test_files", lambda root=None: [])
    monkeypatch.setattr(gpu_suite, "BENCHES", tuple((n, ["-c", script, str(seen), n], 60) for n in ("one", "two")))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    out = tmp_path / "results.md"
    code = gpu_suite.main(["--lanes", "2", "--gpus-per-lane", "2", "--out", str(out), "--log-dir", str(tmp_path)])
    assert code == 0
    assert sorted(p.read_text() for p in seen.iterdir()) == ["0,1", "2,3"]
    text = out.read_text()
    assert text.count("```\nboth\n```") == 2  # each bench saw the other running
    assert "- **lanes**: lane 0: GPUs 0,1, lane 1: GPUs 2,3" in text


def test_an_item_needing_more_gpus_than_its_lane_sees_is_not_run(tmp_path, monkeypatch):
    # Two fake benches, one needing four GPUs: lanes of two skip it and say why; a lane of four runs both.
    made = tmp_path / "made"
    made.mkdir()
    script = "import pathlib, sys; (pathlib.Path(sys.argv[1]) / sys.argv[2]).write_text('ran'); print('ran')"
    monkeypatch.setattr(gpu_suite, "test_files", lambda root=None: [])
    benches = tuple((n, ["-c", script, str(made), n], 60) for n in ("small", "wide"))
    monkeypatch.setattr(gpu_suite, "BENCHES", benches)
    monkeypatch.setattr(gpu_suite, "GPUS_NEEDED", {"wide": 4})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    out = tmp_path / "results.md"
    lanes = ["--lanes", "2", "--gpus-per-lane", "2", "--out", str(out), "--log-dir", str(tmp_path / "logs")]
    assert gpu_suite.main(lanes) == 1  # not everything ran
    assert [p.name for p in made.iterdir()] == ["small"]
    assert "not run (needs 4 GPUs, the lane has 2)" in out.read_text()
    assert gpu_suite.main(["--out", str(out), "--log-dir", str(tmp_path / "logs")]) == 0  # one lane of four
    assert sorted(p.name for p in made.iterdir()) == ["small", "wide"]
    assert gpu_suite.visible_gpus("3,5,6") == 3


def test_a_sigterm_keeps_the_finished_items_and_marks_the_one_in_flight(tmp_path):
    # A fake item list: a test file that finishes, one that has finished a test when the outer `timeout` sends SIGTERM
    # (its second test and a child of its own still running), and a bench never started.
    marker, child = tmp_path / "in_flight", tmp_path / "child.pid"
    slow = (
        "import pathlib, subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"pathlib.Path({str(child)!r}).write_text(str(p.pid))\n"
        "print('tests/test_slow_cuda.py::test_a PASSED'); print('tests/test_slow_cuda.py::test_b', flush=True)\n"
        f"pathlib.Path({str(marker)!r}).write_text('1'); time.sleep(60)\n"
    )
    items = [
        ("test_fast_cuda.py", [sys.executable, "-c", "print('tests/test_fast_cuda.py::test_a PASSED')"], 60),
        ("test_slow_cuda.py", [sys.executable, "-c", slow], 60),
        ("after", [sys.executable, "-c", "print('never')"], 60),
    ]
    out = tmp_path / "results.md"
    driver = (
        f"import sys; sys.path.insert(0, {str(Path(gpu_suite.__file__).parent)!r}); import gpu_suite\n"
        f"gpu_suite.suite_items = lambda **kwargs: {items!r}\n"
        "gpu_suite.machine = lambda: 'm'\n"  # (its library imports take seconds; another test runs it)
        f"sys.exit(gpu_suite.main(['--out', {str(out)!r}, '--log-dir', {str(tmp_path)!r}, '--commit', 'c']))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the in-flight item never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, stdout
    text = out.read_text()
    assert "| `test_fast_cuda.py` | finished | 1 | 0 | 0 | 0 | 0 |" in text
    assert "| `test_slow_cuda.py` | killed at the time limit | 1 | 0 | 0 | 0 | 0 |" in text
    assert "- `tests/test_slow_cuda.py::test_a` PASSED" in text
    assert "- `tests/test_slow_cuda.py::test_b` RUNNING" in text
    assert "`python -c print('never')`: not run (killed)" in text
    pid = int(child.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the in-flight item's child outlived the SIGTERM"
        time.sleep(0.1)
