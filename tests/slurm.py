"""A real one-node Slurm cluster for the tests: ``munged``, ``slurmctld`` and ``slurmd``
(Debian's ``slurmd``, ``slurmctld``, ``slurm-client`` and ``munge``, which
``tools/preflight`` installs), started in the foreground by this process on free ports
(the daemons listen on every interface, each other and the clients reach them over
loopback; every request is signed by this cluster's own munge key), with their key,
state and logs in a temporary folder, and stopped by PID afterwards, after any job
still running is killed (a ``slurmstepd`` outlives its ``slurmd``). Nothing of the
machine's own configuration is read or changed, and nothing of an outer Slurm job:
every Slurm command the tests run gets an environment without ``SLURM_*`` or ``SRUN_*``
variables but ``SLURM_CONF``, pointing at this cluster's file.

The node claims 8 CPUs whatever the machine has (``config_overrides``) and its partition
oversubscribes, so that ``srun -n 4`` starts four tasks on a 2-core machine, as a GPU
node starts one task per GPU. Processes are tracked as plain Linux processes (no cgroup
plugins) and run as the invoking user (root here and in CI, as Slurm's daemons need).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from stepwatch.demo import launch

from .stack.servers import stop
from .wait import wait_until

NODE = "swnode"


def _conf(folder: Path, munge_socket: Path, ctld_port: int, slurmd_port: int) -> str:
    host = socket.gethostname().split(".")[0]  # slurmctld runs only where this names the host
    return "\n".join(
        [
            "ClusterName=stepwatch-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={munge_socket}",
            "CredType=cred/munge",
            f"SlurmUser={pwd.getpwuid(os.getuid()).pw_name}",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN",
            f"PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE",
            "",
        ]
    )


@contextlib.contextmanager
def cluster(folder: Path) -> Iterator[dict[str, str]]:
    """Run the cluster until exit; yields the environment its Slurm commands need."""
    for sub in ("munge", "state", "spool"):
        (folder / sub).mkdir(mode=0o700, parents=True)
    key = folder / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    munge_socket = folder / "munge" / "munge.sock"
    conf = folder / "slurm.conf"
    ctld_port = launch.free_port()
    slurmd_port = wait_until(lambda: (p := launch.free_port()) != ctld_port and p, "a second free port")
    conf.write_text(_conf(folder, munge_socket, ctld_port, slurmd_port))
    outer = ("SLURM_", "SRUN_", "SALLOC_", "SBATCH_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(outer)}
    env["SLURM_CONF"] = str(conf)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(folder / "daemons.log", "wb") as log:
            munged = [
                "munged",
                "--foreground",
                "--force",  # as root, and the socket's folder under /tmp
                f"--key-file={key}",
                f"--socket={munge_socket}",
                f"--pid-file={folder / 'munge' / 'munged.pid'}",
                f"--seed-file={folder / 'munge' / 'seed'}",
                f"--log-file={folder / 'munge' / 'munged.log'}",
            ]
            procs.append(subprocess.Popen(munged, stdout=log, stderr=subprocess.STDOUT))
            wait_until(munge_socket.exists, "munged's socket", timeout_s=30)
            for cmd in (["slurmctld", "-D", "-f", str(conf)], ["slurmd", "-D", "-N", NODE, "-f", str(conf)]):
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))

        def idle() -> bool:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited: {(folder / 'daemons.log').read_text()[-2000:]}")
            return _slurm(["sinfo", "--noheader", "--format=%t"], env) == "idle"

        wait_until(idle, "the Slurm node to be idle", timeout_s=60, every_s=0.2)
        yield env
    finally:
        try:
            if len(procs) == 3 and procs[1].poll() is None:  # slurmctld up: no job may outlive the test
                _slurm(["scancel", "--full", "--signal=KILL", "--partition=test"], env)
                wait_until(lambda: _slurm(["squeue", "-h"], env) == "", "no job left", timeout_s=60)
        finally:
            for p in reversed(procs):
                stop(p)


def _slurm(cmd: list[str], env: dict[str, str]) -> str | None:
    """A Slurm command's output, stripped; None where it failed (the daemon not yet up)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return None
    return out.stdout.strip() if out.returncode == 0 else None
