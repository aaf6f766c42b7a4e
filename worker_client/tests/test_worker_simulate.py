"""`muninn-worker simulate`: the command as a user runs it (a subprocess), and its non-IID partition."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import muninn_worker
from muninn_worker import cli, simulation

PACKAGE_ROOT = str(Path(muninn_worker.__file__).resolve().parent.parent)


def _simulate(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "muninn_worker", "simulate", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def _main_exit_code(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exit_:  # argparse's refusals
        return exit_.code


def _blobs_csv(path: Path, rows: int = 240, classes: int = 3) -> Path:
    """Three well-separated clusters in four features, labelled by cluster, in random row order."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, classes, rows)
    features = rng.normal(size=(rows, 4)) + labels[:, None] * 3.0
    lines = ["a,b,c,d,label"] + [",".join(f"{v:.4f}" for v in x) + f",c{k}" for x, k in zip(features, labels)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_simulate_prints_a_table_of_rounds_and_a_json_last_line(tmp_path):
    csv = _blobs_csv(tmp_path / "blobs.csv")

    result = _simulate(str(csv), "--rounds", "2", "--devices", "3", "--hparam", "epochs=1",
                       "--hparam", "hidden=[16]", "--encoding", "int8", "--json")

    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["round", "accuracy"])
    assert [line.split()[0] for line in lines[header + 1:header + 3]] == ["1", "2"]
    summary = json.loads(lines[-1])
    assert summary["metric"] == "accuracy" and summary["rounds"] == 2 and summary["devices"] == 3
    assert summary["accuracy"] > 0.6  # three separated clusters; chance is 1/3
    assert [r["devices"] for r in summary["history"]] == [3, 3]
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > r["bytes_up"] for r in summary["history"])
    assert summary["bytes_up"] == sum(r["bytes_up"] for r in summary["history"])


@pytest.mark.parametrize("args, says", [
    (["missing.csv"], "cannot read"),
    (["{tmp}/one_row.csv"], "rows"),
    (["{tmp}/blobs.csv", "--template", "transformer9000"], "unknown model template"),
    (["{tmp}/blobs.csv", "--hparam", "lr=-1"], "lr"),
    (["{tmp}/blobs.csv", "--hparam", "lr"], "NAME=VALUE"),
])
def test_simulate_refuses_bad_input_with_one_sentence_and_exit_2(tmp_path, capsys, args, says):
    _blobs_csv(tmp_path / "blobs.csv")
    (tmp_path / "one_row.csv").write_text("a,label\n1,x\n")

    code = _main_exit_code(["simulate", *[a.format(tmp=tmp_path) for a in args]])  # in-process: no torch start-up

    stderr = capsys.readouterr().err
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith("muninn-worker: error:") and says in stderr


def test_non_iid_gives_each_device_a_different_mix_of_labels(tmp_path):
    job = simulation.job_prepare(_blobs_csv(tmp_path / "blobs.csv").read_bytes(), "blobs.csv", template="mlp",
                                 hparams={"epochs": 1, "hidden": [8]}, seed=1)

    platform = next(simulation.simulate(job, rounds=1, devices=4))
    skewed = next(simulation.simulate(job, rounds=1, devices=4, non_iid=0.1))

    shares = [np.array(c) / sum(c) for c in skewed.shard_labels]
    assert sum(map(sum, skewed.shard_labels)) == len(job.y_train)  # every training row, once
    assert max(abs(a - b).sum() for a in shares for b in shares) > 1.0  # some devices see mostly other labels
    assert all(min(c) > 0 for c in platform.shard_labels)  # shuffled rows: every device sees every class


def test_non_iid_needs_a_classification_dataset(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=100)
    (tmp_path / "line.csv").write_text("x,y\n" + "".join(f"{a:.4f},{2 * a + 1:.4f}\n" for a in x))
    job = simulation.job_prepare((tmp_path / "line.csv").read_bytes(), "line.csv", template="mlp", hparams={},
                                 seed=0)

    with pytest.raises(simulation.SimulationError, match="classification"):
        simulation.simulate(job, rounds=1, devices=2, non_iid=0.5)
