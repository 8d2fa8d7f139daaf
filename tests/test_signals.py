"""Stops a job resumes from (issue 29): SIGTERM and Ctrl-C save the last completed step under --save, exit 128 + the
signal's number with one line, and --load goes on from the saved step; a stop during the final export is finished by
--load."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.errors import JobInterrupted
from runtime.signals import StopSignals


def test_a_signal_outside_training_stops_at_once():
    with pytest.raises(JobInterrupted, match="stopped by SIGTERM") as err:
        StopSignals().handle(signal.SIGTERM, None)
    assert err.value.signum == signal.SIGTERM


def test_a_signal_during_training_waits_for_the_step_and_a_second_one_does_not(capsys):
    signals = StopSignals()
    signals.defer()
    signals.handle(signal.SIGINT, None)  # held back: the step in training completes first
    assert "stopping once the step in training completes" in capsys.readouterr().err
    with pytest.raises(JobInterrupted, match="SIGINT"):
        signals.release()
    signals.release()  # nothing pending any more
    signals.defer()
    signals.handle(signal.SIGTERM, None)
    with pytest.raises(JobInterrupted, match="SIGTERM"):
        signals.handle(signal.SIGTERM, None)  # insisting stops now


def test_installed_handlers_raise_on_a_real_signal_and_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(JobInterrupted), StopSignals().installed():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    assert signal.getsignal(signal.SIGTERM) is before


SMALL = [
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
    "--micro-batch-size", "4", "--rollout-max-response-len", "5", "--no-use-tensorboard",
]  # fmt: skip


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def test_sigterm_saves_the_last_completed_step_and_load_goes_on(ray_session, tmp_path):
    """SIGTERM to a running job (after its second step is logged) saves the last completed step and exits 143 with
    one line; --load resumes at the saved step, so no step is lost or repeated. (The resume runs in this process, on
    the module's Ray: a second ``python -m runtime.cli`` paid its own Python and Ray start.)"""
    from runtime.cli import main

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    job = [*SMALL, "--output-dir", str(out), "--save", str(ckpt), "--save-interval", "1000"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", *job, "--num-rollout", "1000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 300
        while len(_steps(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr and "Fatal Python error" not in stderr
    saved = len(_steps(out))  # every logged step completed; the stop came after the last one's commit or before it
    assert f"rlcore-run: saved step {saved} to {ckpt / f'step_{saved:06d}'}" in stdout
    assert [line for line in stderr.splitlines() if line.startswith("rlcore-run:")][
        -1
    ] == "rlcore-run: stopped by SIGTERM"

    assert main([*job, "--load", str(ckpt), "--num-rollout", str(saved + 1)]) == 0
    assert _steps(out) == list(range(saved + 1))  # the resumed run logged exactly the step after the saved ones


@pytest.mark.slow  # a drill: a job, its export cut off, then --load (~35 s); `make test-slow` runs it
def test_a_job_stopped_during_its_final_export_finishes_it_on_load(tmp_path, capsys):
    """The last step is saved, then the export is cut off (only its partial folder is left): --load with the same
    flags exports final_model/ without training again; once it is there, --load refuses (nothing is left)."""
    from transformers import AutoConfig

    from runtime.cli import EXIT_BAD_INPUT, main

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    job = [*SMALL, "--output-dir", str(out), "--save", str(ckpt), "--num-rollout", "2"]
    assert main(job) == 0
    final = out / "final_model"
    final.rename(out / ".final_model.partial")  # as a kill during the export leaves it (export_final's rename undone)
    (out / ".final_model.partial" / "model.safetensors").unlink()
    assert main([*job, "--load", str(ckpt)]) == 0
    assert _steps(out) == [0, 1]  # nothing trained again
    assert AutoConfig.from_pretrained(final) is not None and any(final.glob("*.safetensors"))
    assert not (out / ".final_model.partial").exists()
    capsys.readouterr()
    assert main([*job, "--load", str(ckpt)]) == EXIT_BAD_INPUT
    assert "nothing is left to train and final_model/ is exported" in capsys.readouterr().err
