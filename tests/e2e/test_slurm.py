"""Real training launched by a real Slurm: ``srun -n 4`` on a one-node cluster this test
starts (``tests/slurm.py``: munged, slurmctld, slurmd, reached over loopback), each task
running the demo's tiny GPT under DDP through the line a job script uses to give
``torch.distributed`` its rendezvous from Slurm's variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; no ``LOCAL_RANK`` or ``LOCAL_WORLD_SIZE``, which
``srun`` does not set). The agent must read the host's ranks from what ``srun`` set, and
so batch the host's windows by default: every window of every rank through the host's
relay, every step stored once. Without Slurm's count in ``_env.local_world_size`` it
fails: each rank posts alone (relayed 0 of 11)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from stepwatch.demo import launch

from .. import slurm

RANKS, STEPS = 4, 24


@pytest.mark.parametrize("backend", ["sqlite"])
def test_srun_tasks_batch_per_host_by_default(empty_db_url: str, tmp_path: Path) -> None:
    run = "slurm-srun"
    out = tmp_path / "out"
    out.mkdir()
    train = [sys.executable, "-m", "stepwatch.demo.train", "--run", run, "--steps", str(STEPS)]
    train += ["--peak-flops", "5e10", "--send-interval", "1", "--warmup-steps", "2"]
    train += ["--out", str(out / "rank{rank}.json")]
    with (
        slurm.cluster(tmp_path / "slurm") as env,
        launch.collector(empty_db_url, log_path=str(tmp_path / "collector.log")) as col,
    ):
        # Nothing of this process's own launcher or settings reaches the tasks: only what
        # srun and the job script's line give them.
        launched = ("STEPWATCH_", "OMPI_", "PMIX_", "LOCAL_", "RANK", "WORLD_SIZE", "MASTER_")
        env = {k: v for k, v in env.items() if not k.startswith(launched)}
        # The job script's line: torch.distributed's env:// rendezvous from Slurm's variables
        # (its port picked once the daemons and the collector hold theirs).
        script = (
            "export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS MASTER_ADDR=127.0.0.1 "
            f'MASTER_PORT={launch.free_port()} OMP_NUM_THREADS=1; exec "$@"'
        )
        # Slurm's own time limit (3 min) comes before this process's timeout: a job that
        # hangs is killed by Slurm, and cluster() cancels whatever is left before it stops.
        srun = ["srun", "--ntasks", str(RANKS), "--nodes", "1", "--kill-on-bad-exit=1", "--time=3"]
        done = subprocess.run(
            [*srun, "bash", "-c", script, "job", *train],
            env={**env, "STEPWATCH_URL": col.url},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=420,
            check=False,
        )
        assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
        with httpx.Client(base_url=col.url, timeout=10) as c:
            ov = c.get(f"/api/v1/runs/{run}").raise_for_status().json()
            ranks = c.get(f"/api/v1/runs/{run}/ranks").raise_for_status().json()

    own = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    for o in own:
        sent, relayed = o["stats"]["sent_batches"], o["stats"]["relayed_batches"]
        assert sent > 1 and relayed == sent, o["stats"]  # the host's relay carried every window
    # Ran by slurmd on its node (SLURMD_NODENAME), ranks and local ranks as srun numbered them.
    expected = [(r, r, slurm.NODE) for r in range(RANKS)]
    assert [(r["rank"], r["local_rank"], r["host"]) for r in ranks] == expected
    assert all(r["last_step"] == STEPS and r["dropped_windows"] == 0 for r in ranks)
    assert ov["steps_stored"] == STEPS and ov["world_size"] == RANKS
