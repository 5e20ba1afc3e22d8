"""Real-training scenarios: 4 gloo ranks, the real agent, a real collector, real faults.

The simulator scores the detectors on modelled timings; this module scores the whole
product on real training. Each scenario starts a ``stepwatch serve`` process (its own
SQLite database), four ranks of :mod:`.real_rank` (a tiny GPT under DDP with small
buckets) and a CPU burner that keeps every core busy, injects one fault from a given step,
waits for the collector's analysis to pass the last step (or, for a hang, for the hang
event) and scores the events the API returns: flagged (an event names the faulty rank or
host), right cause, and windows from the onset to the flag.

The slowed-link scenario runs in network namespaces it creates: one per rank, each joined
by a veth pair to a bridge in a namespace of the harness (addresses in 10.211.0.0/24,
inside those namespaces only), with the faulty rank's veth limited by ``tc tbf``. The
collector and the reads run in the bridge's namespace (the scenario re-executes this
module there), so nothing leaves the namespaces. Needs root; everything it made is
removed on exit.

Run: ``python -m stepwatch_server.evaluation.real [--scenario NAME ...] [--runs N]``;
``stepwatch evaluate --real [--scenario NAME ...] [--runs N]`` runs the same.

Longer than the usual module: the scenarios, the namespaces, the run and its scoring
and the table are one harness, read together when a row looks wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx

from stepwatch.demo import launch

RANKS = 4
#: The ranks' program (``python -m``, forked by :func:`launch.forked`).
RANK_MODULE = "stepwatch_server.evaluation.real_rank"
#: glibc's allocator in the ranks and the collector keeps what it got from the kernel
#: instead of handing it back every step (no heap trim; blocks up to 32 MiB, all of this
#: model's tensors, from the heap, not their own mmap), so that the training loop makes no
#: ``brk``/``munmap`` calls. Why: the virtual machines this runs on have a DAMON scheme
#: (``/sys/kernel/mm/damon/admin/kdamonds``: ``pageout`` of physical memory it sees
#: idle for 60 s) whose thread walks the reverse maps of the ranks' pages, and a ``brk``
#: that shrinks the heap then waits for it for tens of seconds, holding the GIL: the rank
#: stands still and its peers wait in the next collective. Measured on 2026-12-04 with
#: the steady scenario and a sampler of the kernel stacks of every thread in D state:
#: in 7 of 13 runs a rank stood still 14-57 s (the collector rightly reported a hang),
#: in 2 more 11-14 s; a rank's training thread sat in ``__do_sys_brk`` ->
#: ``do_vmi_align_munmap`` -> ``anon_vma_clone`` while ``kdamond`` walked
#: ``__rmap_walk_file``. Locking the ranks' memory (``mlockall``) did not help (2 of 2
#: runs); with these settings the longest step of 12 runs was 0.8 s, under heavier load
#: (two stray busy loops beside them).
#: Such a freeze is a real hang of that rank (a real job on such a host would have it
#: too), but a run with one is no evidence about the detector under test. Not given to the
#: demo's ranks (``stepwatch.demo.launch``), which take the allocator's defaults as a
#: user's job does. (With them 3 of 4 demos ran slower and ended with the straggler flag
#: open; the cause was the analysis comparing profiled windows before their profiler
#: entries came, which a slow demo met more often, since fixed with
#: ``steps.profiles_through``, not these settings.)
MALLOC_ENV = {
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TOP_PAD_": str(64 << 20),
}
#: Collector settings: windows of about 8 s of steps (8-16 steps here: the late-arrival
#: sign test needs more than the 4 steps a 4 s window gets when the first batch's steps
#: were slow), a fast analysis loop, and a hang floor of 15 s (production: 60 s) so that
#: a hang scenario fits in a test. Not less: a rank's silence, as the collector sees it,
#: includes its sender's lag, and on 2 cores shared with other work whole processes are
#: descheduled for seconds (a 5 s floor flagged hangs in clean runs at load 15-20).
COLLECTOR_ENV = {
    "STEPWATCH_WINDOW_SECONDS": "8",
    "STEPWATCH_ANALYSIS_INTERVAL_S": "0.5",
    "STEPWATCH_ANALYSIS_GRACE_S": "5",
    "STEPWATCH_HANG_FLOOR_S": "15",
    # The first steps on a loaded machine take longer than the floor (a false hang at step 1).
    "STEPWATCH_HANG_STARTUP_S": "60",
    "STEPWATCH_HANG_K": "10",
}
NET = "10.211.0"  # the private /24 inside the harness' namespaces
BRIDGE_IP = f"{NET}.254"


@dataclass(frozen=True)
class RealScenario:
    """One fault on real ranks and the flag it should raise (``expect_key`` None: clean)."""

    name: str
    fault: str = "none"
    fault_ranks: tuple[int, ...] = ()
    size: float = 0.2
    hosts: tuple[str, ...] | None = None  # per rank; None: the machine's own host name
    expect_key: str | None = None
    expect_ranks: tuple[int, ...] = ()
    link_rate: str | None = None  # tbf rate of the faulty rank's veth (link scenario)
    comm_mb: float = 4.0
    #: Busy loops pinned beside a contended rank's training thread (``contention``), and
    #: their niceness.
    burners: int = 1
    contention_nice: int = -5
    #: Niceness of every process the scenario starts (collector, ranks, burner). Negative
    #: keeps other work on the machine from changing the job's speed mid-run, so that the
    #: load is the scenario's own burner: what a job-wide regression test needs, since
    #: anything else that slows the whole job is a real change of its step time.
    nice: int = 0
    #: Collector settings for this scenario on top of ``COLLECTOR_ENV``.
    env: tuple[tuple[str, str], ...] = ()
    #: The scenario's own run length and onset (else the caller's).
    steps: int | None = None
    fault_from: int | None = None
    #: A regression scenario: the breakdown part its attribution must name.
    expect_component: str | None = None
    #: The harness' warm-up (steps the agent tags ``warmup``): the first steps of a
    #: fresh process run slower for a while (allocator, caches), not a baseline.
    warmup_steps: int = 5
    #: Niceness of the burner relative to the ranks (``nice`` + this): positive keeps both
    #: cores busy while the ranks' wake-ups go first, as a job outranks background work.
    burner_nice: int = 0
    #: DDP bucket size (MB): small buckets give a step many collectives to time, each a
    #: hop through the scheduler on a loaded host; a job-wide scenario uses large ones.
    bucket_cap_mb: float = 0.05
    #: Ranks in network namespaces joined by a bridge (always so with ``link_rate``).
    netns: bool = False

    @property
    def in_namespaces(self) -> bool:
        return self.netns or self.link_rate is not None


#: The job-wide regression scenarios: windows of 16 steps (about 3 s here), a warm-up of
#: 24 steps, a baseline of 8 windows after it, the onset at window 10, 6 windows after
#: it; every rank's extra compute is 10% of its step time; DDP's default 25 MB buckets;
#: the session at niceness -20 (see ``nice``), the burner 10 below the ranks.
STEADY = RealScenario(
    "clean, steady load",
    nice=-20,
    burner_nice=10,
    bucket_cap_mb=25.0,
    warmup_steps=24,
    # 16-step windows fixed: chosen from the first batch's pace they became 32 once that
    # pace left out the slow first and warm-up steps (0.19 s a step, 5 s windows), and 256
    # steps then held too few windows for the baseline and the onset (CI, quiet machine).
    env=(("STEPWATCH_WINDOW_STEPS", "16"), ("STEPWATCH_ANALYSIS_BASELINE_WINDOWS", "8")),
    steps=256,
    fault_from=161,
)

SCENARIOS: tuple[RealScenario, ...] = (
    RealScenario("clean"),
    RealScenario("clean (namespaces)", netns=True),
    RealScenario(
        "compute +20%", "compute", (2,), 0.2, expect_key="straggler:compute:rank=2", expect_ranks=(2,)
    ),
    RealScenario(
        "host stall +20%",
        "host_stall",
        (1,),
        0.2,
        expect_key="straggler:host_stall:rank=1",
        expect_ranks=(1,),
    ),
    RealScenario(
        "loader stall +20%", "loader", (3,), 0.2, expect_key="straggler:data:rank=3", expect_ranks=(3,)
    ),
    RealScenario(
        "slow host +30% (2 ranks)",
        "compute",
        (2, 3),
        0.3,
        hosts=("node-a", "node-a", "node-b", "node-b"),
        expect_key="straggler:host:host=node-b",
        expect_ranks=(2, 3),
    ),
    # Ranks 1 and 2 all-reduce 4 MiB tensors on a group of their own, as many per step
    # as take 20% of it: both move the extra bytes (one rank cannot communicate alone),
    # so both are right to flag. (A fixed 16 MiB a step raised no flag at all in 2 runs
    # at load 5-12, with 0.57-0.61 s steps.)
    RealScenario(
        "extra comm +20% (pair 1-2)",
        "comm",
        (1,),
        0.2,
        expect_key="straggler:link:rank=1",
        expect_ranks=(1, 2),
        comm_mb=4.0,
    ),
    # Other work takes rank 1's cores: its training thread pinned to one core beside a
    # busy loop of higher priority; it waits on the run queue and does no more work than
    # its peers. Its flag needs 4 windows: 256 steps leave room for them after the onset.
    RealScenario(
        "cpu contention (rank 1)",
        "contention",
        (1,),
        expect_key="straggler:cpu_contention:rank=1",
        expect_ranks=(1,),
        steps=256,
        fault_from=49,
    ),
    # The whole run stops: one run-level flag naming rank 2 as the one that never
    # entered the all-reduce its peers wait in.
    RealScenario("hang in all_reduce", "hang", (2,), expect_key="hang:run", expect_ranks=(2,)),
    replace(
        STEADY,
        name="job-wide +10%",
        fault="compute",
        fault_ranks=tuple(range(RANKS)),
        size=0.1,
        expect_key="regression:step_time",
        expect_component="compute_s",
    ),
    STEADY,
    RealScenario(
        "slow link (tbf)",
        "link",
        (1,),
        link_rate="150mbit",
        expect_key="straggler:link:rank=1",
        expect_ranks=(1,),
    ),
)


@dataclass
class RealOutcome:
    scenario: str
    flagged: bool
    right: bool
    windows_to_flag: int | None
    seconds_to_flag: float | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    window_steps: int = 0
    step_time_s: float = 0.0
    seconds: float = 0.0
    note: str = ""
    #: How far the collector's analysis got (the scenario's steps when it finished in time).
    analysed_through_step: int = 0
    #: A hang scenario: whether the first hang event read already named who never
    #: entered the stuck collective (None: no hang event read).
    first_hang_diagnosed: bool | None = None
    #: The longest time the whole machine stood still during the run (:class:`Stillness`)
    #: and when it began (epoch seconds).
    paused_s: float = 0.0
    paused_at: float | None = None
    #: The run's captures as the collector served them at the end (``GET .../captures``).
    captures: list[dict[str, Any]] = field(default_factory=list)
    #: Wall time each step ended, the latest over the ranks (step 1 first).
    step_ends: list[float] = field(default_factory=list)

    @property
    def false_flags(self) -> int:
        return sum(1 for e in self.events if e.get("_false"))


# -- the machine's load ---------------------------------------------------------------
class Stillness:
    """The longest stretch in which a thread that wakes every ``interval_s`` did not run.

    On this kind of machine (a virtual machine on a shared host) everything sometimes
    stops at once: measured during a clean scenario, training (one step of 34.9 s, on the
    ranks' own monotonic clocks), the collector and a shell loop sampling them all stood
    still for about 35 s together. No scheduler gives a waiting thread nothing for
    seconds while it is runnable, so a gap of seconds is the machine, not the load. A run
    with such a pause is not evidence about a detector: the collector rightly sees no step
    for 35 s (a hang), and the job's speed after the pause can differ from before it (a
    real step-time change). The tests that assume a steady machine read it as
    :attr:`RealOutcome.paused_s`. (A gap can also be this process holding the GIL that
    long; the harness does nothing of the kind while a scenario runs.)
    """

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.longest_s = 0.0
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stillness", daemon=True)

    def _watch(self) -> None:
        last = time.monotonic()
        stopped = False
        while not stopped:  # the wake-up that sees the stop measures its gap too
            stopped = self._stop.wait(self.interval_s)
            now = time.monotonic()
            gap = now - last - self.interval_s
            if gap > self.longest_s:
                # It began when the wake-up after ``last`` was due.
                self.longest_s, self.at = gap, time.time() - (now - last) + self.interval_s
            last = now

    def __enter__(self) -> Stillness:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def cpu_burner(n: int | None = None, *, nice: int = 0) -> Iterator[list[int]]:
    """Busy-loop processes, one per core (at niceness ``nice``), stopped by their PIDs on exit."""
    procs = [
        subprocess.Popen([*_niced(nice), sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL)
        for _ in range(n or os.cpu_count() or 2)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _niced(nice: int) -> list[str]:
    """A command prefix that runs at niceness ``nice`` (nothing for 0)."""
    return ["nice", "-n", str(nice)] if nice else []


def autogroup_nice(text: str) -> str | None:
    """The niceness in ``/proc/self/autogroup`` ("/autogroup-103 nice 0"), or None where the
    kernel keeps no autogroup for the process (the file empty, as on some CI machines with
    ``sched_autogroup_enabled=0``): nothing to weigh then."""
    m = re.fullmatch(r"/autogroup-\d+ nice (-?\d+)", text.strip())
    return m.group(1) if m else None


@contextlib.contextmanager
def _session_niceness(nice: int) -> Iterator[None]:
    """The niceness of this process' scheduler autogroup, for the ``with`` block.

    With ``kernel.sched_autogroup_enabled`` (the default on most distributions) the CPU is
    shared fairly between sessions first and niceness only orders the processes within
    one, so other sessions' work (other test runs, builds) takes its share from the
    scenario whatever the niceness of its processes. The scenario's processes (the
    collector, the burner, the ranks its forkserver forks) are this one's descendants in
    its session: raising the session's own weight is what keeps their share steady.
    Where there are no autogroups the per-process niceness does it.
    """
    path = "/proc/self/autogroup"
    before: str | None = None
    if nice:
        try:
            with open(path) as f:
                current = autogroup_nice(f.read())
            if current is not None:
                with open(path, "w") as f:
                    f.write(str(nice))
                before = current
        except OSError:
            before = None  # no autogroup file, or not allowed: per-process niceness only
    try:
        yield
    finally:
        if before is not None:
            with open(path, "w") as f:
                f.write(before)


def _renice(pid: int, nice: int) -> None:
    """Every thread of a running process to niceness ``nice`` (Linux sets it per thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.setpriority(os.PRIO_PROCESS, int(tid), nice)


# -- network namespaces -----------------------------------------------------------------
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _tc(ns: str, dev: str, shape: Sequence[str]) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *shape], check=True)


@contextlib.contextmanager
def namespaces(
    n: int, *, slow_rank: int | None = None, rate: str | None = None
) -> Iterator[tuple[str, list[str]]]:
    """A bridge namespace and ``n`` rank namespaces joined by veth pairs; the veth of
    ``slow_rank`` (if any) is shaped by ``tbf`` at ``rate`` in both directions. Yields
    (bridge ns, rank nss)."""
    tag = f"sw{os.getpid() % 100000}"
    br = f"{tag}br"
    ranks = [f"{tag}r{i}" for i in range(n)]
    made: list[str] = []
    try:
        for ns in (br, *ranks):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "addr", "add", f"{BRIDGE_IP}/24", "dev", "br0")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, ns in enumerate(ranks):
            # Created inside the bridge namespace, one end moved into the rank's.
            _ip("-n", br, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", br, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", br, "link", "set", f"v{i}", "up")
            _ip("-n", ns, "addr", "add", f"{NET}.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        if slow_rank is not None and rate is not None:
            shape = ["root", "tbf", "rate", rate, "burst", "32kb", "latency", "100ms"]
            _tc(ranks[slow_rank], "eth0", shape)
            _tc(br, f"v{slow_rank}", shape)
        yield br, ranks
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# -- one scenario -----------------------------------------------------------------------
def _start_ranks(
    s: RealScenario,
    run: str,
    work: str,
    *,
    url: str,
    steps: int,
    fault_from: int,
    profile_every: int,
    netns: Sequence[str] | None,
    record: str | None = None,
) -> list[launch.RankProcess]:
    """The ranks, forked from the preloaded server (:func:`launch.forked`: the seconds
    each would spend importing torch and ``torch._dynamo`` are spent once)."""
    master = f"{NET}.1" if netns else "127.0.0.1"
    port = launch.free_port() if not netns else 29500
    procs: list[launch.RankProcess] = []
    for r in range(RANKS):
        env = {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(RANKS),
            "LOCAL_WORLD_SIZE": str(RANKS),
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "STEPWATCH_URL": url,
            **MALLOC_ENV,
        }
        if netns:
            env["GLOO_SOCKET_IFNAME"] = "eth0"
            # A namespace each: a rank is a host of its own (the relay's abstract socket is
            # per namespace), so it has no one to batch with.
            env["STEPWATCH_HOST_BATCH"] = "0"
        argv = ["--run", run, "--steps", str(steps), "--fault", s.fault]
        argv += ["--fault-ranks", ",".join(map(str, s.fault_ranks))]
        argv += ["--fault-from", str(fault_from), "--size", str(s.size), "--comm-mb", str(s.comm_mb)]
        argv += ["--burners", str(s.burners), "--burner-nice", str(s.contention_nice)]
        argv += ["--profile-every", str(profile_every), "--out", os.path.join(work, "rank{rank}.json")]
        argv += ["--bucket-cap-mb", str(s.bucket_cap_mb), "--warmup-steps", str(s.warmup_steps)]
        if s.hosts:
            argv += ["--host", s.hosts[r]]
        if record:
            argv += ["--record", os.path.join(record, "rank{rank}.json")]
        log = os.path.join(work, f"rank{r}.log")
        ns = netns[r] if netns else None
        procs.append(launch.forked(RANK_MODULE, argv, env=env, log_path=log, nice=s.nice, netns=ns))
    return procs


def _stop_all(procs: Sequence[launch.RankProcess]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _score(
    s: RealScenario, events: list[dict[str, Any]], window_steps: int, fault_from: int
) -> tuple[bool, bool, int | None]:
    fault_window = (fault_from - 1) // window_steps
    if s.expect_key is not None and s.expect_key.startswith("regression:"):
        return _score_regression(s, events, fault_window)
    # Consequences of the fault, not false flags: the job slows (a regression).
    related = ("regression:",)
    flagged = right = False
    delay: int | None = None
    for e in events:
        key = e["key"]
        names_fault = bool(set(e["ranks"]) & set(s.expect_ranks)) or any(
            h in (s.hosts or ()) and s.hosts and s.hosts.index(h) in s.expect_ranks for h in e["hosts"]
        )
        if s.expect_key is not None and names_fault and not key.startswith(related):
            flagged = True
            # A hang is right when its diagnosis names the faulty ranks as never entered.
            if key == s.expect_key and (s.fault != "hang" or _never_entered(e) == list(s.expect_ranks)):
                right = True
                opened = e["evidence"].get("opened_window")
                if opened is not None:
                    delay = int(opened) - fault_window
        elif not (s.expect_key is not None and key.startswith(related)):
            e["_false"] = True
    return flagged, right, delay


def _never_entered(event: dict[str, Any]) -> list[int] | None:
    """The ranks a hang event's diagnosis says never entered the stuck collective."""
    stuck = (event.get("evidence") or {}).get("collective")
    return None if stuck is None else list(stuck.get("never_entered", ()))


def _score_regression(
    s: RealScenario, events: list[dict[str, Any]], fault_window: int
) -> tuple[bool, bool, int | None]:
    """A job-wide fault: flagged when a regression opened, right when it is the expected
    metric's and its attribution names the expected part; any other flag is false."""
    flagged = right = False
    delay: int | None = None
    for e in events:
        if e["kind"] != "regression":
            e["_false"] = True
            continue
        flagged = True
        moved = {k[len("delta_") :]: v for k, v in e["evidence"].items() if k.startswith("delta_")}
        top = max(moved, key=lambda c: moved[c]) if moved else None
        if e["key"] == s.expect_key and top == s.expect_component:
            right = True
            opened = e["evidence"].get("opened_window")
            if opened is not None:
                delay = int(opened) - fault_window
    return flagged, right, delay


def run_scenario(
    s: RealScenario,
    *,
    steps: int = 144,
    fault_from: int = 48,
    profile_every: int = 0,
    timeout_s: float = 240.0,
    burn: bool = True,
    record: str | None = None,
    during: Callable[[str, str], None] | None = None,
) -> RealOutcome:
    """Run one scenario end to end and score it (see the module docstring); with
    ``record``, every rank also writes the payloads it sent into that folder; ``during``
    is called on a thread of its own with the collector's URL and the run's name once the
    ranks started (what a person does to a running job: steer it, read it)."""
    if s.in_namespaces and not os.environ.get("STEPWATCH_REAL_INSIDE"):
        return _run_in_namespaces(
            s,
            steps=steps,
            fault_from=fault_from,
            profile_every=profile_every,
            burn=burn,
            record=record,
            timeout_s=timeout_s,
        )
    with Stillness() as still:
        o = _run_here(
            s,
            steps=steps,
            fault_from=fault_from,
            profile_every=profile_every,
            timeout_s=timeout_s,
            burn=burn,
            record=record,
            during=during,
        )
    return replace(o, paused_s=still.longest_s, paused_at=still.at)


def _run_here(
    s: RealScenario,
    *,
    steps: int,
    fault_from: int,
    profile_every: int,
    timeout_s: float,
    burn: bool,
    record: str | None,
    during: Callable[[str, str], None] | None = None,
) -> RealOutcome:
    """:func:`run_scenario` in this network namespace."""
    t0 = time.monotonic()
    steps = s.steps or steps
    fault_from = s.fault_from or fault_from
    netns = json.loads(os.environ.get("STEPWATCH_REAL_NETNS", "null"))
    run = "real-" + _slug(s.name)
    diagnosed = [0.0]
    first_diagnosed: list[bool | None] = [None]
    with tempfile.TemporaryDirectory(prefix="stepwatch-real-", dir=_scratch()) as work:
        env = {**COLLECTOR_ENV, **dict(s.env)}
        if netns:
            env["STEPWATCH_HOST"] = "0.0.0.0"
        burner: contextlib.AbstractContextManager[list[int]] = (
            cpu_burner(nice=s.nice + s.burner_nice) if burn else contextlib.nullcontext([])
        )
        db = f"sqlite:///{os.path.join(work, 'real.db')}"
        log = os.path.join(work, "collector.log")
        collector = launch.collector(db, log_path=log, env={**env, **MALLOC_ENV})
        with _session_niceness(s.nice), collector as col, burner:
            if s.nice:
                _renice(col.process.pid, s.nice)
            url = col.url.replace("127.0.0.1", BRIDGE_IP) if netns else col.url
            procs = _start_ranks(
                s,
                run,
                work,
                url=url,
                steps=steps,
                fault_from=fault_from,
                profile_every=profile_every,
                netns=netns,
                record=record,
            )
            side = threading.Thread(target=during, args=(col.url, run), daemon=True) if during else None
            if side is not None:
                side.start()
            try:
                events, ov = _wait(
                    s,
                    procs,
                    col.url,
                    run,
                    work,
                    steps=steps,
                    deadline=t0 + timeout_s,
                    diagnosed_at=diagnosed,
                    first_seen_diagnosed=first_diagnosed,
                )
            finally:
                _stop_all(procs)
            if side is not None:
                side.join(timeout_s)
            captures = _captures(col.url, run)
            step_ends = _step_ends(work)
            onset = _onset(work, s, 2 if s.fault == "link" else fault_from)
    ws = int(ov.get("window_steps") or 1)
    # A slowed link is shaped from the start: its onset is the first step.
    onset_step = 1 if s.fault == "link" else fault_from
    flagged, right, delay = _score(s, events, ws, onset_step)
    st = ((ov.get("step_time_s") or {}).get("mean")) or 0.0
    secs = None
    note = ""
    if right and s.fault == "hang":
        # From the moment the peers entered the collective the faulty rank never entered
        # to the first poll that read the diagnosis (the ranks never finish: no onset file).
        ev = next(e for e in events if e["key"] == s.expect_key and _never_entered(e))
        stuck = ev["evidence"]["collective"]
        if stuck.get("since") is not None and diagnosed[0]:
            secs = diagnosed[0] - float(stuck["since"])
        note = f"threshold {ev['evidence'].get('threshold_s', 0.0):.1f} s: {ev['message']}"
    elif right and onset is not None:
        opened = [float(e["opened_at"]) for e in events if e["key"] == s.expect_key]
        secs = min(opened) - onset if opened else None
    analysed = int((ov.get("analysis") or {}).get("analysed_through_step") or 0)
    return RealOutcome(
        s.name,
        flagged,
        right,
        delay,
        secs,
        events,
        ws,
        float(st),
        time.monotonic() - t0,
        note=note,
        analysed_through_step=analysed,
        first_hang_diagnosed=first_diagnosed[0],
        captures=captures,
        step_ends=step_ends,
    )


def _scratch() -> str | None:
    """Where a run keeps its files (the collector's database, the logs, the ranks' step
    ends): memory (``/dev/shm``) where there is one, else the default temporary folder.
    The collector commits every batch with an fsync before it answers, and this machine's
    disk is slow to answer them: on 2026-12-04, sampling every 50 ms the kernel stacks of
    the threads in D state over about one run, 342 of 445 samples were collectors'
    SQLite fsyncs (``folio_wait_writeback``, ``blkdev_issue_flush``). In one run of 8
    (with the database on disk and the collector not yet given :data:`MALLOC_ENV`) the last
    window never reached the analysis: the ranks had finished, the harness waited its
    whole timeout; the run's folder, and the collector's log with it, was gone, so
    which of the two stalls it was is not known. None in the 4 runs since both. The
    harness tests the detectors, not the disk (durability has tests of its own)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _step_ends(work: str) -> list[float]:
    """Per step, the latest of the ranks' own step ends (as far as every rank got)."""
    per_rank = []
    for r in range(RANKS):
        try:
            with open(os.path.join(work, f"rank{r}.json")) as f:
                per_rank.append([float(x) for x in json.load(f)["step_ends"]])
        except (OSError, ValueError, KeyError):
            return []
    return [max(ends) for ends in zip(*per_rank, strict=False)]


def _captures(url: str, run: str) -> list[dict[str, Any]]:
    """The run's captures (asked for by its flags or by ``during``), newest first."""
    try:
        r = httpx.get(f"{url}/api/v1/runs/{run}/captures", timeout=10.0)
        got: list[dict[str, Any]] = r.json() if r.status_code == 200 else []
        return got
    except (httpx.HTTPError, ValueError):
        return []


def _onset(work: str, s: RealScenario, fault_from: int) -> float | None:
    """Wall time at which the first faulty step began, from a rank's own step ends."""
    for r in range(RANKS):
        try:
            with open(os.path.join(work, f"rank{r}.json")) as f:
                ends = json.load(f)["step_ends"]
        except (OSError, ValueError, KeyError):
            continue
        if len(ends) >= fault_from - 1:
            return float(ends[fault_from - 2])
    return None


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def _wait(
    s: RealScenario,
    procs: Sequence[launch.RankProcess],
    url: str,
    run: str,
    work: str,
    *,
    steps: int,
    deadline: float,
    diagnosed_at: list[float],
    first_seen_diagnosed: list[bool | None],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Poll until the ranks finished and the analysis passed the last step (a hang: until
    a hang event names the ranks that never entered the stuck collective, the wall time
    of that poll going to ``diagnosed_at``, and whether the first hang event seen was
    already diagnosed to ``first_seen_diagnosed``); returns the events and the overview."""
    events: list[dict[str, Any]] = []
    ov: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=10.0) as c:
        while time.monotonic() < deadline:
            if s.fault != "hang":
                launch.poll_all(procs, work)
            got: list[dict[str, Any]] = []
            try:
                r = c.get(f"/api/v1/runs/{run}")
                if r.status_code == 200:
                    got = c.get(f"/api/v1/runs/{run}/events").raise_for_status().json()
            except httpx.TransportError:  # a collector slow to answer on a loaded machine: poll again
                time.sleep(0.5)
                continue
            if r.status_code == 200:
                ov, events = r.json(), got
                # A hang: until an event names who never entered the stuck collective
                # (noting whether the first hang event seen already did).
                hangs = [e for e in events if e["kind"] == "hang"]
                if s.fault == "hang" and hangs and first_seen_diagnosed[0] is None:
                    first_seen_diagnosed[0] = any(_never_entered(e) for e in hangs)
                if s.fault == "hang" and any(_never_entered(e) for e in hangs):
                    diagnosed_at[0] = time.time()
                    break
                done = all(p.poll() is not None for p in procs)
                if done and (ov.get("analysis") or {}).get("analysed_through_step", 0) >= steps:
                    break
            time.sleep(0.5)
    return events, ov


def _run_in_namespaces(
    s: RealScenario,
    *,
    steps: int,
    fault_from: int,
    profile_every: int,
    burn: bool,
    record: str | None,
    timeout_s: float,
) -> RealOutcome:
    """Re-run this scenario inside the bridge namespace, ranks in their own namespaces."""
    slow = s.fault_ranks[0] if s.link_rate is not None and s.fault_ranks else None
    shaped = namespaces(RANKS, slow_rank=slow, rate=s.link_rate)
    with shaped as (br, ranks), tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        env = {**os.environ, "STEPWATCH_REAL_INSIDE": "1", "STEPWATCH_REAL_NETNS": json.dumps(ranks)}
        cmd = ["ip", "netns", "exec", br, sys.executable, "-m", "stepwatch_server.evaluation.real"]
        cmd += ["--scenario", s.name, "--steps", str(steps), "--fault-from", str(fault_from)]
        cmd += ["--profile-every", str(profile_every), "--json", out.name, "--runs", "1"]
        cmd += ["--timeout", str(timeout_s)]
        if not burn:
            cmd.append("--no-burn")
        if record:
            cmd += ["--record", os.path.dirname(record)]
        # The inner run keeps its own deadline; this one stops a stuck one, with its
        # collector, ranks and burner (its own process group), before the namespaces go.
        inner = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            rc = inner.wait(timeout=timeout_s + 60)
        finally:
            if inner.poll() is None:
                os.killpg(inner.pid, signal.SIGKILL)
                inner.wait()
        if rc != 0:
            raise subprocess.CalledProcessError(rc, cmd)
        (result,) = json.load(out)
        return RealOutcome(**result)


# -- the table --------------------------------------------------------------------------
def render(outcomes: Sequence[RealOutcome]) -> str:
    by: dict[str, list[RealOutcome]] = {}
    for o in outcomes:
        by.setdefault(o.scenario, []).append(o)
    lines = [
        f"{'scenario':<26} {'runs':>4} {'flagged':>8} {'right':>6} {'windows to flag':>16} "
        f"{'s to flag':>10} {'false':>6} "
        f"{'step s':>7} {'win':>4}  flags seen"
    ]
    for name, rows in by.items():
        n = len(rows)
        delays = [o.windows_to_flag for o in rows if o.windows_to_flag is not None]
        delay = (
            "-"
            if not delays
            else f"{min(delays)}-{max(delays)}"
            if min(delays) != max(delays)
            else str(delays[0])
        )
        clean = name == "clean"
        secs = [o.seconds_to_flag for o in rows if o.seconds_to_flag is not None]
        sec = "-" if not secs else f"{min(secs):.0f}-{max(secs):.0f}"
        keys = sorted({e["key"] for o in rows for e in o.events})
        lines.append(
            f"{name:<26} {n:>4} {'-' if clean else f'{sum(o.flagged for o in rows)}/{n}':>8} "
            f"{'-' if clean else f'{sum(o.right for o in rows)}/{n}':>6} {delay:>16} {sec:>10} "
            f"{sum(o.false_flags for o in rows):>6} {sum(o.step_time_s for o in rows) / n:>7.3f} "
            f"{rows[0].window_steps:>4}  {', '.join(keys) or '-'}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", action="append", help="scenario name (default: all); repeatable")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--steps", type=int, default=144)
    p.add_argument("--fault-from", type=int, default=48)
    p.add_argument("--profile-every", type=int, default=0)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per scenario run")
    p.add_argument("--no-burn", action="store_true", help="no CPU burner")
    p.add_argument("--json", default=None, help="write the outcomes here as JSON")
    p.add_argument(
        "--record", default=None, help="folder: every rank's payloads, per scenario (and per run with --runs)"
    )
    p.add_argument("--link-rate", default=None, help="tbf rate of the slowed link (e.g. 50mbit)")
    args = p.parse_args(argv)
    chosen = [s for s in SCENARIOS if not args.scenario or s.name in args.scenario]
    if args.link_rate:
        chosen = [replace(s, link_rate=args.link_rate) if s.link_rate else s for s in chosen]
    outcomes = []
    for s in chosen:
        for i in range(args.runs):
            rec = None
            if args.record:  # one folder per run: a miss among hits can be replayed
                rec = os.path.join(args.record, _slug(s.name), *([f"run{i + 1}"] if args.runs > 1 else []))
                os.makedirs(rec, exist_ok=True)
            o = run_scenario(
                s,
                steps=args.steps,
                fault_from=args.fault_from,
                profile_every=args.profile_every,
                burn=not args.no_burn,
                record=rec,
                timeout_s=args.timeout,
            )
            outcomes.append(o)
            if not args.json:
                print(
                    f"# {o.scenario}: flagged={o.flagged} right={o.right} windows={o.windows_to_flag} "
                    f"({o.seconds:.0f} s) {[e['key'] for e in o.events]}"
                    + (
                        f" s_to_flag={o.seconds_to_flag:.1f} {o.note}"
                        if o.seconds_to_flag is not None
                        else ""
                    )
                    + (f" (the machine stood still for {o.paused_s:.0f} s)" if o.paused_s >= 1 else ""),
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(o) for o in outcomes], f)
    else:
        print(render(outcomes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["SCENARIOS", "RealOutcome", "RealScenario", "main", "run_scenario"]
