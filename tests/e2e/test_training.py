"""End to end: `stepwatch serve` as a real process, 4 gloo ranks training a tiny GPT with
the hook, and the numbers read back over HTTP compared with what the ranks measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest

from stepwatch.demo import launch
from stepwatch.flops import Convention

RANKS, STEPS, WARMUP = 4, 30, 3
PEAK = 5.0e10  # declared peak FLOP/s of one CPU rank (CPUs have no datasheet row)


def _own_measurements(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]


#: PostgreSQL, the production backend; the demo's test trains on the embedded SQLite, and
#: the storage tests hold both backends to the same rows.
@pytest.mark.solo
@pytest.mark.parametrize("backend", ["postgresql"])
@pytest.mark.parametrize(
    ("host_batch", "launcher"),
    [(False, "torchrun"), (True, "torchrun"), (True, "srun")],
    ids=["per-rank", "host-batch", "host-batch-srun"],
)
def test_four_gloo_ranks_end_to_end(
    empty_db_url: str, tmp_path: Path, host_batch: bool, launcher: Literal["torchrun", "srun"]
) -> None:
    """With per-host batching, the default where the launcher says the host runs several
    ranks (``launch.ranks`` sets torchrun's ``LOCAL_WORLD_SIZE``, or what Slurm's ``srun``
    sets instead): every window of every rank through the host's relay; and with it
    turned off (``STEPWATCH_HOST_BATCH=0``), each rank posting its own: the same rows
    stored."""
    run = "e2e-gloo"
    args = [
        "--run",
        run,
        "--steps",
        str(STEPS),
        "--peak-flops",
        str(PEAK),
        "--send-interval",
        "1",
        "--warmup-steps",
        str(WARMUP),
        "--out",
        str(tmp_path / "rank{rank}.json"),
    ]
    with launch.collector(empty_db_url, log_path=str(tmp_path / "collector.log")) as col:
        # Host batching as the default leaves it (on), or turned off.
        env = {"STEPWATCH_URL": col.url, **({} if host_batch else {"STEPWATCH_HOST_BATCH": "0"})}
        with launch.ranks(RANKS, args, env=env, log_dir=str(tmp_path), launcher=launcher) as procs:
            launch.wait_all(procs, timeout_s=180, log_dir=str(tmp_path))
        with httpx.Client(base_url=col.url, timeout=10) as c:
            runs = c.get("/api/v1/runs").raise_for_status().json()
            ov = c.get(f"/api/v1/runs/{run}").raise_for_status().json()
            ranks = c.get(f"/api/v1/runs/{run}/ranks").raise_for_status().json()
            reporting = c.get(
                f"/api/v1/runs/{run}/series", params={"metric": "ranks_reporting", "max_points": 1}
            ).json()

    own = _own_measurements(tmp_path)
    assert all(o["flushed"] for o in own), "every rank flushed its last window before exiting"
    for o in own:
        sent, relayed = o["stats"]["sent_batches"], o["stats"]["relayed_batches"]
        assert sent > 1 and relayed == (sent if host_batch else 0), o["stats"]
    assert [(r["name"], r["world_size"], r["ranks_reporting"]) for r in runs] == [(run, RANKS, RANKS)]
    assert [r["rank"] for r in ranks] == list(range(RANKS))
    assert all(r["last_step"] == STEPS and r["dropped_windows"] == 0 for r in ranks)
    assert ov["steps_stored"] == STEPS and (ov["first_step"], ov["last_step"]) == (1, STEPS)
    (point,) = reporting["points"]
    assert point["min"] == point["max"] == RANKS, "every step was reported by every rank exactly once"
    assert ov["tokens_total"] == sum(sum(o["tokens"]) for o in own)

    # Throughput after warm-up, as the ranks measured it themselves with their own clocks.
    tokens = sum(sum(o["tokens"][WARMUP:]) for o in own)
    seconds = sum(o["step_ends"][-1] - o["step_ends"][WARMUP - 1] for o in own) / RANKS
    measured = tokens / seconds
    assert ov["tokens_per_s"]["mean"] == pytest.approx(measured, rel=0.10)

    # MFU is exactly the calculator's value for the declared convention.
    conv = Convention.from_dict(ov["convention"])
    assert conv.peak_flops == PEAK and conv.formula == "6N+12LHQT"
    assert ov["mfu"]["mean"] == pytest.approx(conv.mfu(ov["tokens_per_s"]["mean"], RANKS), rel=1e-9)
    assert 0 < ov["mfu"]["mean"] < 1
