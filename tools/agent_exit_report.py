"""What a user sees when the collector is wrong: exit time and log lines, measured.

Not a test (wall time is no test assertion here) and not a ratio benchmark: it prints
the figures quoted in reviews of the agent's failure behaviour.

- ``exit``: wall time of a one-rank training process's exit (from its last step to the
  process ending) with ``flush_timeout_s`` (default 5) against a collector that is
  unreachable (a closed loopback port), black-holed (a loopback socket that accepts and
  never answers) and misnamed (a host name that does not resolve).
- ``token``: a real collector with a write token, and ``--ranks`` processes posting with a
  wrong one for ``--seconds``; prints every line the ranks wrote to stderr.

    python tools/agent_exit_report.py exit [--deadline 5]
    python tools/agent_exit_report.py token [--ranks 4] [--seconds 30]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

TRAIN = """
import atexit, sys, time
atexit.register(lambda: print("closed", time.monotonic(), flush=True))  # runs after stepwatch's
import stepwatch
sw = stepwatch.init(run="exit-report", url=sys.argv[1], flush_timeout_s=float(sys.argv[2]),
                    send_interval_s=0.05, rank=0, world_size=1, host="h", profile_every=0,
                    flops_per_token=1e6)
for _ in range(200):
    sw.step(tokens=1)
    time.sleep(0.001)
print("done", time.monotonic(), flush=True)
"""

RANK = """
import sys, time, stepwatch
rank, world, url, seconds = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
sw = stepwatch.init(run="wrong-token", url=url, token="not-the-right-token-at-all", rank=rank,
                    world_size=world, host="h", send_interval_s=1.0, flush_timeout_s=2.0,
                    profile_every=0, peak_flops=1e12, flops_per_token=1e6)
t_end = time.monotonic() + seconds
while time.monotonic() < t_end:
    sw.step(tokens=8)
    time.sleep(0.01)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _exit_time(url: str, deadline_s: float, script: Path) -> tuple[float, float, str]:
    """(seconds from the last step to the process's end, of which in stepwatch's exit hook,
    stderr). The monotonic clock is system-wide, so the child's readings compare."""
    proc = subprocess.Popen(
        [sys.executable, str(script), url, str(deadline_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=120)
    ended = time.monotonic()
    marks = {w[0]: float(w[1]) for w in (ln.split() for ln in out.decode().splitlines()) if len(w) == 2}
    if "done" not in marks or "closed" not in marks:
        raise SystemExit(f"the training script failed: {err.decode()}")
    return ended - marks["done"], marks["closed"] - marks["done"], err.decode()


def exit_report(deadline_s: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(textwrap.dedent(TRAIN))
        hole = socket.create_server(("127.0.0.1", 0), backlog=64)  # accepts (kernel), never answers
        try:
            cases = {
                "unreachable (closed port)": f"http://127.0.0.1:{_free_port()}",
                "black-holed (accepts, never answers)": f"http://127.0.0.1:{hole.getsockname()[1]}",
                "misnamed host (DNS fails)": "http://stepwatch-collector.invalid:8321",
            }
            for name, url in cases.items():
                exit_s, hook_s, stderr = _exit_time(url, deadline_s, script)
                print(
                    f"{name:38s} exit {exit_s:5.2f} s, of which the exit flush {hook_s:5.2f} s "
                    f"(flush_timeout_s={deadline_s:g})"
                )
                for line in stderr.strip().splitlines():
                    print(f"    | {line}")
        finally:
            hole.close()


def token_report(ranks: int, seconds: float) -> None:
    from stepwatch.demo.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'c.db'}"
        port = free_port()
        env = {**os.environ, "STEPWATCH_WRITE_TOKENS": "the-right-token-0123456789"}
        log = open(Path(tmp) / "collector.log", "wb")  # noqa: SIM115 - closed below
        collector = subprocess.Popen(
            [sys.executable, "-m", "stepwatch", "serve", "--port", str(port), "--database-url", db],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_up(url, collector)
            script = Path(tmp) / "rank.py"
            script.write_text(textwrap.dedent(RANK))
            procs = [
                subprocess.Popen(
                    [sys.executable, str(script), str(r), str(ranks), url, str(seconds)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
                for r in range(ranks)
            ]
            lines: list[str] = []
            for r, p in enumerate(procs):
                _, err = p.communicate(timeout=seconds + 60)
                lines += [f"rank {r}: {line}" for line in err.decode().strip().splitlines()]
        finally:
            collector.terminate()
            collector.wait(10)
            log.close()
    print(f"{ranks} ranks, wrong token, {seconds:g} s of training: {len(lines)} line(s) on stderr")
    for line in lines:
        print(f"    | {line}")


def _wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the collector exited")
        try:
            httpx.get(f"{url}/healthz", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit("the collector did not come up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("exit")
    e.add_argument("--deadline", type=float, default=5.0)
    t = sub.add_parser("token")
    t.add_argument("--ranks", type=int, default=4)
    t.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    if args.what == "exit":
        exit_report(args.deadline)
    else:
        token_report(args.ranks, args.seconds)


if __name__ == "__main__":
    main()
