"""A trainer and its workers on two hosts: network namespaces this test makes, joined by a switch of its own
(tests/_hosts.py), each with its own address; real TCP between them. The workers are built from the YAML
receiver configs the trainer wrote, and nothing else (examples/two_hosts/)."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests._hosts import Host, hosts

pytestmark = pytest.mark.timeout(240)
WORKERS = 2
RPC_OPT_IN = "weightsync.scheme.allow_store_peers_to_run_code=true"


def start_trainer(host: Host, out: Path, *overrides: str):
    """The example trainer on ``host``; returns it once it has written every worker's YAML."""
    trainer = host.spawn(["python", "examples/two_hosts/trainer.py", f"out={out}", f"hydra.run.dir={out}", *overrides])
    deadline = time.monotonic() + 90
    while not all((out / f"worker{i}.yaml").exists() for i in range(WORKERS)):
        if trainer.poll() is not None:
            pytest.fail(f"the trainer exited before writing its receiver configs:\n{trainer.stderr.read()}")
        if time.monotonic() > deadline:
            pytest.fail("the trainer wrote no receiver configs within 90 s")
        time.sleep(0.1)
    return trainer


def start_workers(host: Host, out: Path, *flags: str, which=range(WORKERS)):
    return [host.spawn(["python", "examples/two_hosts/worker.py", str(out / f"worker{i}.yaml"), *flags]) for i in which]


def versions(text: str, pattern: str) -> dict[int, str]:
    return {int(v): digest for v, digest in re.findall(pattern, text)}


def finish(proc, timeout=120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.mark.parametrize(
    "engine, trainer_args, worker_flags",
    [
        ("distributed", ["weightsync.scheme.master_addr=198.18.0.1"], []),
        (
            "rpc",
            [
                "weightsync/scheme=rpc",
                "weightsync.scheme.master_addr=198.18.0.1",
                RPC_OPT_IN,
            ],
            ["--allow-store-peers-to-run-code"],
        ),
    ],
)
def test_workers_on_another_host_hold_every_version_from_yaml_alone(tmp_path, engine, trainer_args, worker_flags):
    """rpc needs its opt-in (allow_store_peers_to_run_code) on both sides: a trainer without it is refused, and so is a
    worker whose own code does not opt in (the config's field is never taken for it). And rpc has no run key: a
    stranger on host C with worker 0's YAML reads the world's keys in the store, but cannot join the world once
    it formed (its membership is fixed), and the real workers go on receiving."""
    with hosts(3) as (a, b, c):
        if engine == "rpc":
            refused = a.run(
                ["python", "examples/two_hosts/trainer.py", f"out={tmp_path}", f"hydra.run.dir={tmp_path}",
                 *[arg for arg in trainer_args if arg != RPC_OPT_IN]],
                timeout=120,
            )  # fmt: skip
            assert refused.returncode != 0 and "allow_store_peers_to_run_code" in refused.stderr, refused.stderr[-2000:]
        linger = 8 if engine == "rpc" else 2  # the stranger's time to try its luck
        trainer = start_trainer(a, tmp_path, "weightsync.scheme.master_port=29611", f"linger={linger}", *trainer_args)
        if engine == "rpc":
            worker = b.run(["python", "examples/two_hosts/worker.py", str(tmp_path / "worker0.yaml")], timeout=60)
            refused = "allow_store_peers_to_run_code=True" in worker.stderr
            assert worker.returncode != 0 and refused, worker.stderr[-2000:]
        workers = start_workers(b, tmp_path, *worker_flags)
        lines = []
        while not lines or not lines[-1].startswith("sent version 5 "):  # then it lingers 2 s: look at the sockets
            line = trainer.stdout.readline()
            assert line, f"the trainer stopped early:\n{trainer.stderr.read()}"
            lines.append(line)
        listening = {"A": a.listening(), "B": b.listening()}
        if engine == "rpc":
            stranger = finish(c.spawn(["python", "-m", "tests._stranger", "rpc", str(tmp_path / "worker0.yaml")]))
            assert "store reached" in stranger[1] and "worker 0 joined: True" in stranger[1], stranger
            assert "not joined: ConfigurationError" in stranger[1] and "already joined" in stranger[1], stranger
        code, out, err = finish(trainer)
        assert code == 0, err
        sent = versions("".join(lines) + out, r"sent version (\d+) (\w+)")
        assert sorted(sent) == list(range(6))
        for i, worker in enumerate(workers):
            code, out, err = finish(worker)
            assert code == 0, err
            assert versions(out, rf"worker {i} version (\d+) (\w+)") == sent
        # What listens where: on host A only the address the user chose, never a wildcard; on host B only its own
        # address (gloo's and TensorPipe's endpoints; see docs/multinode.md, "What is exposed").
        for addr, _port, _program in listening["A"]:
            assert addr == "198.18.0.1", listening
        for addr, _port, _program in listening["B"]:
            assert addr in ("198.18.0.2",), listening
        assert any(port == 29611 for _a, port, _p in listening["A"]), listening


def test_a_local_scheme_refuses_a_worker_on_another_host_at_once(tmp_path):
    with hosts(2) as (a, b):
        for scheme in ("multiprocess", "shared_mem"):
            out = tmp_path / scheme
            # A connect timeout longer than the worker is given: a worker that waited for a sender it can never
            # reach would be ended by run()'s timeout, not refused.
            start_trainer(a, out, f"weightsync/scheme={scheme}", "weightsync.scheme.connect_timeout=300")
            worker = b.run(["python", "examples/two_hosts/worker.py", str(out / "worker0.yaml")], timeout=60)
            assert worker.returncode != 0
            assert "another host or in another network namespace" in worker.stderr, (scheme, worker.stderr)
            assert "distributed, rpc or ray" in worker.stderr


def test_rpc_a_cable_pulled_mid_send_is_a_named_error_and_the_cut_off_workers_exit_cleanly(tmp_path):
    """rpc, 16 MB a version: the worker host's cable is pulled while the trainer sends, and stays out. The send
    ends after the scheme's ``timeout`` with its error naming each worker whose ack did not come, and the trainer
    exits; each worker holds the last version it acknowledged, whole, and, its trainer out of reach for good (no
    reset ever comes), exits cleanly within four timeouts. (``distributed``: the same pull, with rejoin, in the next
    test.)"""
    timeout = 5
    with hosts(2) as (a, b):
        trainer = start_trainer(
            a, tmp_path, "weightsync/scheme=rpc", RPC_OPT_IN,
            "weightsync.scheme.master_addr=198.18.0.1", f"weightsync.scheme.timeout={timeout}", "versions=100000",
            "hidden=2048",
        )  # fmt: skip
        workers = start_workers(b, tmp_path, "--hidden", "2048", "--allow-store-peers-to-run-code")
        lines = [trainer.stdout.readline() for _ in range(5)]  # connected, versions 1 and 2 sent and acknowledged
        b.link(False)
        code, out, err = finish(trainer)
        gone = time.monotonic()
        results = [finish(w, timeout=4 * timeout + 40) for w in workers]
        assert time.monotonic() - gone < 4 * timeout + 15
    assert code != 0
    failed = re.search(r"send of version (\d+) failed after ([\d.]+) s: (.*)", out)
    assert failed, out + err
    # The error names each worker whose ack did not come: both (a SendFailedError), or the one alone whose ack was
    # still out when the cable went (the other had acked the version just before).
    named = [i for i in range(2) if f"worker {i}" in failed[3]]
    assert named and ("SendFailedError" in failed[3]) == (len(named) == 2), failed[3]
    assert 0.9 * timeout <= float(failed[2]) < timeout + 3, failed[0]
    log = "".join(lines) + out
    acked = versions(log, r"sent version (\d+) (\w+)")
    tried = {**acked, **versions(log, r"sending version (\d+) (\w+)")}
    assert int(failed[1]) == max(acked) + 1
    for i, (code, out, err) in enumerate(results):
        assert code == 0 and f"worker {i} done" in err and "went away" in err, err[-2000:]
        held = versions(out, rf"worker {i} version (\d+) (\w+)")
        assert all(held[v] == tried[v] for v in held), (held, tried)  # every version it held, whole
        # The last acked, or the failed one if only its ack was lost; a worker not named acked the failed one.
        assert max(held) in ((max(acked), max(acked) + 1) if i in named else (max(acked) + 1,)), (i, held, failed[3])


class Lines:
    """What a process prints, line by line as it comes (a thread reads it): waited for with a bound. A wait that
    fails shows what ``others()`` (the workers) wrote to stderr, ended first: it says why they did not do it."""

    def __init__(self, proc, others=lambda: ()) -> None:
        self.proc, self.seen, self._new, self._others = proc, [], queue.Queue(), others
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.seen.append(line)
            self._new.put(line)

    def wait_for(self, text: str, timeout: float) -> str:
        """The first line holding ``text`` printed since the last call (or since :meth:`skip`)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(queue.Empty):
                if text in (line := self._new.get(timeout=min(left, 1.0))):
                    return line
            if self.proc.poll() is not None and self._new.empty():
                pytest.fail(f"it exited before printing {text!r}:\n{self.proc.stderr.read()[-3000:]}")
        pytest.fail(f"no {text!r} within {timeout} s; last lines: {self.seen[-5:]}{self._said_by_others()}")

    def _said_by_others(self) -> str:
        said = []
        for proc in self._others():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
                said.append(f"\n--- {' '.join(proc.args[-2:])} (exit {proc.wait(10)}):\n{proc.stderr.read()[-1500:]}")
        return "".join(said)

    def skip(self) -> None:
        """Forget the lines printed so far: the next wait is for what comes after."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._new.get_nowait()


def test_distributed_across_a_stranger_a_pulled_cable_a_killed_worker_and_a_vanished_trainer_host(tmp_path):
    """distributed, ``on_failure=drop``, three hosts: the trainer on A, its workers on B, and on C a stranger.

    1. The stranger knows the trainer's address and store port and holds worker 0's YAML, not the run key file it
       names. It reaches the store (torch's TCP store has no authentication) but a prefix it guesses holds
       nothing; posing as worker 0 with a key of its own it finds no run; with the run's prefix (the YAML names
       it: the test derives it from the key) it is refused when it claims worker 0, and the real workers go on
       receiving.
    2. The worker host's cable is pulled: the trainer drops both workers after its ``timeout`` and goes on;
       plugged back, the same worker processes connect again by themselves and hold the newest version.
    3. A worker killed and started again from its YAML rejoins too.
    4. The trainer's host vanishes (cable out, processes gone, no reset sent): the workers exit cleanly within
       four timeouts.
    """
    from omegaconf import OmegaConf

    from weightsync.transports.distributed.auth import run_prefix

    timeout = 3
    with hosts(3) as (a, b, c):
        trainer = start_trainer(
            a,
            tmp_path,
            "weightsync.scheme.master_addr=198.18.0.1",
            "weightsync.scheme.on_failure=drop",
            f"weightsync.scheme.timeout={timeout}",
            "versions=100000",
            "every=0.3",
        )
        workers = start_workers(b, tmp_path)
        sent = Lines(trainer, lambda: workers)
        sent.wait_for("held by [0, 1]", 60)

        config = OmegaConf.load(tmp_path / "worker0.yaml").connection
        port = str(config.master_port)
        reach = c.run(["python", "-m", "tests._stranger", "store", a.addr, port], timeout=60)
        assert "store reached" in reach.stdout and "holds the layout: False" in reach.stdout, reach
        posing = c.run(["python", "-m", "tests._stranger", "worker", str(tmp_path / "worker0.yaml")], timeout=60)
        assert "not joined after" in posing.stdout, posing
        prefix = run_prefix("policy", bytes.fromhex(Path(config.authkey_file).read_text()))
        claim = c.run(["python", "-m", "tests._stranger", "rejoin", a.addr, port, prefix], timeout=60)
        assert "did not prove it holds the run key" in claim.stdout, claim
        sent.skip()
        sent.wait_for("held by [0, 1]", 30)  # the real workers still hold every version

        b.link(False)
        pulled = time.monotonic()
        sent.skip()
        sent.wait_for("held by []", 30)
        dropped_after = time.monotonic() - pulled
        assert timeout * 0.9 <= dropped_after < timeout + 3, dropped_after
        b.link(True)
        sent.skip()
        sent.wait_for("held by [0, 1]", 60)  # the same processes, connected again
        assert all(w.poll() is None for w in workers)

        os.killpg(workers[0].pid, signal.SIGKILL)
        sent.skip()
        sent.wait_for("held by [1]", 30)
        workers[0] = start_workers(b, tmp_path, which=[0])[0]
        sent.wait_for("held by [0, 1]", 60)

        results = vanish(a, trainer, workers, timeout)
    exited_cleanly_holding_whole_versions(sent, results)


def test_distributed_workers_on_their_lines_exit_cleanly_when_the_trainers_host_vanishes(tmp_path):
    """Workers of the run's group wait for the next version on their lines (one TCP connection each). The trainer's
    host vanishes (cable out, processes gone, no reset sent): each worker's line, and its store, fail within
    four timeouts of silence, and it exits cleanly holding whole versions. (The previous test's vanishing host
    leaves workers that rejoined, which have no line.)"""
    timeout = 3
    with hosts(2) as (a, b):
        trainer = start_trainer(
            a, tmp_path, "weightsync.scheme.master_addr=198.18.0.1", f"weightsync.scheme.timeout={timeout}",
            "versions=100000", "every=0.3",
        )  # fmt: skip
        workers = start_workers(b, tmp_path)
        sent = Lines(trainer, lambda: workers)
        sent.wait_for("held by [0, 1]", 60)
        results = vanish(a, trainer, workers, timeout)
    exited_cleanly_holding_whole_versions(sent, results)


_ECHO = """
import socket, sys
srv = socket.create_server(("198.18.0.1", 29517))
print("listening", flush=True)
conn, _ = srv.accept()
while data := conn.recv(64):
    conn.sendall(data)
"""
_BOUNDED = """
import socket, sys, time
from weightsync.transports.network import bound_silence
sock = socket.create_connection(("198.18.0.1", 29517), timeout=10)
assert bound_silence(sock, float(sys.argv[1]))
sock.sendall(b"w")
assert sock.recv(1) == b"w"
print("connected", flush=True)
sys.stdin.readline()
start = time.monotonic()
sock.settimeout(60)
try:
    sock.sendall(b"x")  # (busy: unacknowledged for as long as the outage lasts; idle: sent after it)
    print("echoed" if sock.recv(1) == b"x" else "ended", f"after {time.monotonic() - start:.1f} s", flush=True)
except OSError as exc:
    print("failed", f"after {time.monotonic() - start:.1f} s:", exc, flush=True)
"""


@pytest.mark.skipif(
    tuple(int(part) for part in re.findall(r"\d+", os.uname().release)[:2]) < (6, 15),
    reason="the retries' interval is bounded from Linux 6.15 on (TCP_RTO_MAX_MS)",
)
@pytest.mark.parametrize("connection", ["busy", "idle"])
def test_a_connection_whose_silence_is_bounded_outlives_an_outage_of_two_thirds_of_the_bound(connection):
    """The store's and the line's connections end after ``4 x timeout`` of silence (``bound_silence``), and a link
    down for less heals unseen. Here the switch loses every packet of host B for 8 s, the bound 12 s (``timeout``
    3 s), and the connection lives. Busy: a byte sent as the outage begins, whose echo comes back. TCP sends it
    again after waits that double (0.2 s, 0.4 s, ... by 6.2 s, the next try at 12.6 s): the next try fell past
    the bound, and the kernel ended the connection though the link was back. Idle: 3.5 s after it last heard
    from its peer, whose echo then comes. The kernel counts the silence from that, and probed only after 4 s,
    2 s apart: the connection ended at 12 s (a worker of a trainer cut off for 8 s took that for its sender gone,
    in 4 of 4 runs of a review)."""
    with hosts(2) as (a, b):
        server = Lines(a.spawn(["python", "-c", _ECHO]))
        server.wait_for("listening", 60)
        client = b.spawn(["python", "-c", _BOUNDED, "12"], stdin=subprocess.PIPE)
        said = Lines(client)
        said.wait_for("connected", 60)
        if connection == "idle":
            time.sleep(3.5)  # (the connection idle that long before the outage)
        b.lose(True)
        if connection == "busy":
            client.stdin.write("\n")
            client.stdin.flush()
        time.sleep(8)  # (the outage itself)
        b.lose(False)
        if connection == "idle":
            time.sleep(4)  # (past the bound, counted from what the client last heard)
            client.stdin.write("\n")
            client.stdin.flush()
        result = said.wait_for("after", 30)
    assert result.startswith("echoed"), result


def vanish(host: Host, trainer, workers: list, timeout: float) -> list[tuple[int, str, str]]:
    """The trainer's host vanishes: no packet from it again, not even a reset. Each worker's ``finish``; each
    said it was done within four timeouts (and a margin), and then exited, within four timeouts and 30 s (a Python
    process that imported torch takes seconds of its own to end on a loaded host: 1.8 s on an idle one)."""
    host.link(False)
    os.killpg(trainer.pid, signal.SIGKILL)
    gone = time.monotonic()
    done: dict[int, float] = {}
    said: dict[tuple[int, str], list[str]] = {(i, pipe): [] for i in range(len(workers)) for pipe in ("out", "err")}

    def read(i: int, pipe: str) -> None:  # (both pipes, as communicate() does: a full pipe would stall the worker)
        for line in getattr(workers[i], f"std{pipe}"):
            said[i, pipe].append(line)
            if pipe == "err" and f"worker {i} done" in line:
                done.setdefault(i, time.monotonic() - gone)

    readers = [threading.Thread(target=read, args=key, daemon=True) for key in said]
    for r in readers:
        r.start()
    for w in workers:
        w.wait(4 * timeout + 30)
    for r in readers:
        r.join(10)
    results = [(w.returncode, "".join(said[i, "out"]), "".join(said[i, "err"])) for i, w in enumerate(workers)]
    assert len(done) == len(workers) and max(done.values()) < 4 * timeout + 10, (done, results)
    trainer.wait(10)
    return results


def exited_cleanly_holding_whole_versions(sent: Lines, results: list[tuple[int, str, str]]) -> None:
    """Each worker's ``finish``: it exited (0) once its trainer's store went away, and every version it held is
    the one the trainer sent under that number."""
    digests = versions("".join(sent.seen), r"sen(?:t|ding) version (\d+) (\w+)")
    for i, (code, out, err) in enumerate(results):
        assert code == 0, err[-2000:]
        assert f"worker {i} done" in err and "store went away" in err, out + err[-3000:]
        held = versions(out, rf"worker {i} version (\d+) (\w+)")
        assert held and all(digests[v] == held[v] for v in held), (held, digests)  # each one whole, as named


def test_the_shaped_link_benchmark_runs(tmp_path):
    import sys

    from tests._hosts import ROOT, _can_make_hosts

    if reason := _can_make_hosts():  # no root, or no iproute2
        pytest.skip(reason)
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_two_hosts.py",
            "--mb",
            "1",
            "--rounds",
            "1",
            "--rates",
            "1e9",
            "--engines",
            "distributed",
            "--wire-dtypes",
            "float32",
        ],  # fmt: skip
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("| link |")[-1]
    assert table.count("| 1 Gbit/s | distributed | float32 |") == 1, out.stdout


#: The processes of a Ray node (2.60): what may listen on a host of a Ray cluster.
RAY_PROGRAMS = ("gcs_server", "raylet", "ray::", "python")


def test_ray_actors_on_another_node_hold_every_version_and_ride_out_a_short_cable_pull():
    """A Ray head on host A, a worker node on host B (``ray start --address``), actors placed on B; Ray's token
    authentication on, the token shared by the nodes and the trainer as Ray asks. Then host B's cable is pulled
    for a send (it fails after the scheme's ``timeout``, naming both actors) and plugged back: the next send
    reaches the same actors. Then the actors' processes on B are killed: the next send names both, and two new
    actors started on B rejoin in their place with the current version. What listens: only Ray's processes, on
    every address (Ray 2.60 binds its gRPC servers to all of them: docs/multinode.md). A stranger on host C that
    reaches the head, with a wrong token or none, is refused by Ray's token authentication."""
    import secrets

    pytest.importorskip("ray")
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    common = ["--num-cpus", "1", "--disable-usage-stats", "--block"]
    with tempfile.TemporaryDirectory(prefix="wsray", dir="/tmp") as tmp, hosts(3) as (a, b, c):
        tmp_path = Path(tmp)  # short: Ray's socket paths live under it
        a.spawn(["ray", "start", "--head", "--node-ip-address", a.addr, "--port", "6379", "--include-dashboard",
                 "false", "--temp-dir", str(tmp_path / "a"), *common], env=env)  # fmt: skip
        b.spawn(["ray", "start", "--address", f"{a.addr}:6379", "--node-ip-address", b.addr, "--resources",
                 '{"hostB": 2}', "--temp-dir", str(tmp_path / "b"), *common], env=env)  # fmt: skip
        trainer = a.spawn(
            ["python", "-m", "tests._ray_two_hosts", f"{a.addr}:6379", "--faults"], env=env, stdin=subprocess.PIPE
        )
        said = Lines(trainer)
        said.wait_for("ready for: cable out", 180)
        listening = {"A": a.listening(), "B": b.listening()}
        # Meanwhile a stranger on host C reaches the head, with a wrong token and with none (Ray retries ~20 s).
        strangers = [
            c.spawn(["python", "-m", "tests._ray_stranger", f"{a.addr}:6379"], env=stranger_env)
            for stranger_env in ({**env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}, {"RAY_AUTH_MODE": "disabled"})
        ]
        b.link(False)
        trainer.stdin.write("\n")
        trainer.stdin.flush()
        failed = said.wait_for("cable out:", 60)
        said.wait_for("ready for: cable back", 60)
        b.link(True)
        trainer.stdin.write("\n")
        trainer.stdin.flush()
        back = said.wait_for("cable back:", 60)
        held = said.wait_for("cable back:", 60)
        said.wait_for("ready for: actors killed", 60)
        b.run(["pkill", "-9", "-f", "ray::Collector"])
        trainer.stdin.write("\n")
        trainer.stdin.flush()
        killed = said.wait_for("actors killed:", 60)
        rejoined = said.wait_for("new actors rejoined", 90)
        code = trainer.wait(60)
        strangers = [finish(stranger, timeout=90) for stranger in strangers]
    out = "".join(said.seen)
    assert code == 0, trainer.stderr.read()[-3000:]
    assert out.count("held by both: True") == 3, out
    assert "actors on ['198.18.0.2']" in out
    took = re.search(r"send failed after ([\d.]+) s: SendFailedError.*worker 0.*worker 1", failed)
    assert took and 4.5 <= float(took[1]) < 8, failed
    assert re.search(r"sent version 5 in", back), back
    assert "actors hold [5, 5], trainer 5" in held, held
    assert re.search(r"send failed: SendFailedError.*worker 0.*worker 1", killed), killed
    assert "rejoined at versions [6, 6]: hold the trainer's weights: True" in rejoined, rejoined
    assert any(port == 6379 for _addr, port, _p in listening["A"]), listening
    for _code, out, err in strangers:
        assert "refused after" in out and "InvalidAuthToken" in out + err and "joined" not in out, (out, err[-2000:])
    for host, found in listening.items():
        for _addr, _port, program in found:
            assert any(f'"{name}' in program for name in RAY_PROGRAMS), (host, program)
