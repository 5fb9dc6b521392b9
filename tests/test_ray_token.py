"""Ray's token (whoever holds it runs code in the cluster, the trainer's actors included) is kept readable by its
owner alone: Ray writes ``~/.ray/auth_token`` with the process's umask, 0644 under the usual 022, and another user
of the host who could enter the home directory read it and took over the trainer's actors (a security review,
as uid 65534)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import weightsync as ws
from tests._as_stranger import run_stranger, stranger_unavailable
from weightsync.transports.ray.auth_token import keep_token_private, token_path
from weightsync.transports.ray.cluster import LOCAL, bootstrap_address


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A home of this test's, no token in it, Ray's token settings unset."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_clusters_token_is_made_private_before_ray_would_make_it_open_to_all(home):
    keep_token_private(new_cluster=False)  # joining a cluster: Ray makes none, nor does weightsync
    assert not (home / ".ray").exists()
    keep_token_private(new_cluster=True)
    token = home / ".ray" / "auth_token"
    assert _mode(token) == 0o600 and _mode(token.parent) == 0o700
    made = token.read_text()
    assert len(made) == 64 and int(made, 16) >= 0
    keep_token_private(new_cluster=True)  # one there is kept
    assert token.read_text() == made


def test_a_token_open_to_others_is_made_private_and_said_and_one_not_read_from_a_file_is_left_alone(
    home, monkeypatch, caplog
):
    token = home / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("a" * 64)
    token.chmod(0o644)  # (as Ray writes it under umask 022)
    with caplog.at_level(logging.WARNING, logger="weightsync.ray"):
        keep_token_private(new_cluster=False)
    assert _mode(token) == 0o600 and token.read_text() == "a" * 64
    assert "readable by other users (mode 644): made private" in caplog.text
    elsewhere = home / "token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(elsewhere))
    keep_token_private(new_cluster=True)  # (a path given: Ray makes none there, nor does weightsync)
    assert token_path() == elsewhere and not elsewhere.exists()
    elsewhere.write_text("b" * 64)
    elsewhere.chmod(0o640)
    keep_token_private(new_cluster=False)
    assert _mode(elsewhere) == 0o600
    for name, value in (("RAY_AUTH_TOKEN", "c" * 64), ("RAY_AUTH_MODE", "disabled")):
        monkeypatch.setenv(name, value)
        elsewhere.chmod(0o644)
        assert token_path() is None
        keep_token_private(new_cluster=True)
        assert _mode(elsewhere) == 0o644
        monkeypatch.delenv(name)


def test_a_token_open_to_others_that_cannot_be_made_private_is_refused_by_name(home, monkeypatch):
    token = home / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("a" * 64)
    token.chmod(0o604)

    def refused(path, mode):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "chmod", refused)  # (another user's file)
    with pytest.raises(ws.ConfigurationError, match=r"auth_token.*readable by other users \(mode 604\)"):
        keep_token_private(new_cluster=False)


def test_a_scheme_joins_the_cluster_it_is_given_or_starts_one_never_one_another_user_named(tmp_path, monkeypatch):
    """Ray's own default (no address) joins the cluster named in ``ray_current_cluster`` in Ray's temp dir, which
    every user of the host can write (``/tmp/ray`` is open to all), and ``"auto"`` falls back to any cluster
    running on the host: another user had the trainer join theirs, whose workers then ran code in it (a security
    review, as uid 65534). No address now starts a new local cluster, whatever that file says; ``"auto"`` takes
    the file only where this user wrote it."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert bootstrap_address(None, str(tmp_path)) == bootstrap_address("", str(tmp_path)) == LOCAL
    assert bootstrap_address("127.0.0.1:6379") == "127.0.0.1:6379"
    assert bootstrap_address("ray://10.0.0.1:10001") == "ray://10.0.0.1:10001"
    with pytest.raises(ws.ConfigurationError, match="address='auto' found no cluster started by `ray start`"):
        bootstrap_address("auto", str(tmp_path))
    planted = tmp_path / "ray_current_cluster"
    planted.write_text("127.0.0.1:6379\n")  # (what `ray start --head` leaves)
    assert bootstrap_address(None, str(tmp_path)) == LOCAL  # (not the cluster the file names)
    assert bootstrap_address("auto", str(tmp_path)) == "127.0.0.1:6379"  # (this user's own)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6380")  # (as Ray reads "auto": the environment's first)
    assert bootstrap_address("auto", str(tmp_path)) == "127.0.0.1:6380"
    monkeypatch.delenv("RAY_ADDRESS")
    planted.chmod(0o666)  # (this user's, but any user may have rewritten it)
    with pytest.raises(ws.ConfigurationError, match=r"mode 666\)"):
        bootstrap_address("auto", str(tmp_path))
    planted.chmod(0o644)
    if os.getuid() != 0:
        pytest.skip("giving the file to another user needs root")
    os.chown(planted, 65534, 65534)
    with pytest.raises(ws.ConfigurationError, match=r"would join the cluster named in .*which user 65534 wrote"):
        bootstrap_address("auto", str(tmp_path))


def test_a_scheme_that_starts_a_local_cluster_starts_it_on_a_private_token_ray_then_uses(home):
    script = textwrap.dedent(
        """
        import contextlib, os, pathlib, socket, stat
        import ray
        import weightsync as ws
        from tests._netns import loopback_only_network

        with loopback_only_network():
            # Another user's cluster, named where Ray's own default looks: the scheme starts its own
            stranger = socket.create_server(("127.0.0.1", 0))
            stranger.setblocking(False)
            named = pathlib.Path(os.environ["RAY_TMPDIR"]) / "ray"
            named.mkdir(mode=0o777)
            (named / "ray_current_cluster").write_text(f"127.0.0.1:{stranger.getsockname()[1]}")
            assert ws.RayWeightSyncScheme().join_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
            try:
                token = pathlib.Path.home() / ".ray" / "auth_token"
                assert ray.get(ray.remote(lambda: 1).remote(), timeout=60) == 1  # (the cluster admits its driver)
                with contextlib.suppress(BlockingIOError):
                    stranger.accept()
                    raise AssertionError("the scheme reached the cluster another user named")
                print(ray._private.worker._global_node.get_session_dir_path())
                print(oct(stat.S_IMODE(token.stat().st_mode)), len(token.read_text()))
            finally:
                ray.shutdown()
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["RAY_TMPDIR"] = short_tmp = tempfile.mkdtemp(prefix="wsrt", dir="/tmp")  # (short: Ray's sockets live in it)
    os.chmod(short_tmp, 0o1777)  # (as /tmp is: every user may enter, and make files of their own)
    try:
        ran = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            cwd=Path(__file__).parents[1],
        )
        if "needs root" in ran.stderr:
            pytest.skip("a private network namespace needs root here")
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert ran.stdout.split()[-2:] == ["0o600", "64"]
        # Ray makes its temp dir, and each session's sockets dir, writable by every user: another user could make
        # and replace files there. The cluster's files are in a directory only this user may enter.
        session = Path(ran.stdout.split()[-3])
        assert Path(short_tmp) / "ray" not in session.parents and (session / "sockets").is_dir(), session
        if stranger_unavailable() is None:
            planted = session / "sockets" / "planted"
            tried = run_stranger(["-c", f"open({str(planted)!r}, 'w')"], timeout=60)
            assert tried.returncode != 0 and "PermissionError" in tried.stdout, tried.stdout[-2000:]
            assert not planted.exists()
    finally:
        shutil.rmtree(short_tmp, ignore_errors=True)


def test_a_new_clusters_files_go_where_only_this_user_may_enter_and_its_paths_fit_rays_sockets(monkeypatch):
    """Ray opens its temp dir to every user (0777, no sticky bit); the directory above it is this user's alone.
    Ray refuses a socket path over 107 bytes ("AF_UNIX path length cannot exceed"): a base too long for one is
    left for /tmp."""
    from weightsync.transports.ray import cluster

    made, long_base = [], tempfile.mkdtemp(prefix="ws-long-" + "x" * 30, dir="/tmp")  # (45 bytes: this test's)
    try:
        for base in ("/tmp", long_base):
            monkeypatch.setenv("RAY_TMPDIR", base)
            made.append(Path(cluster.private_temp_dir()))
        for path in made:
            assert path.name == "ray" and not path.exists() and path.parent.parent == Path("/tmp")
            assert _mode(path.parent) == 0o700 and path.parent.stat().st_uid == os.getuid()
            socket = f"{path}/session_2026-12-07_11-11-07_275980_4194304/sockets/plasma_store"
            assert len(socket) <= 107, socket
    finally:
        for path in made:
            path.parent.rmdir()
        os.rmdir(long_base)


def test_tpu_logs_in_the_shared_temp_dir_are_not_linked_into_a_new_clusters_logs(tmp_path, monkeypatch):
    """Ray links a new cluster's logs to /tmp/tpu_logs where TPU_LOG_DIR names no directory, and its log monitor
    sends every line of the files there to the driver: any user may make that directory. Unless it is this
    user's, TPU_LOG_DIR names an empty directory beside the cluster's while it starts."""
    from weightsync.transports.ray import cluster

    shared = tmp_path / "tpu_logs"
    monkeypatch.setattr(cluster, "_SHARED_TPU_LOGS", str(shared))
    monkeypatch.delenv("TPU_LOG_DIR", raising=False)
    files = str(tmp_path / "ws-ray-1" / "ray")
    for made_by_another in (False, True):  # absent (another user may make it), then another user's
        if made_by_another:
            shared.mkdir(mode=0o777)
            shared.chmod(0o777)
        with cluster.own_tpu_logs(files):
            named = Path(os.environ["TPU_LOG_DIR"])
            assert named == tmp_path / "ws-ray-1" / "tpu_logs" and named.is_dir() and not list(named.iterdir())
            assert _mode(named) == 0o700
        assert "TPU_LOG_DIR" not in os.environ
    shared.chmod(0o755)  # this user's, not open to others: Ray's own way
    with cluster.own_tpu_logs(files):
        assert "TPU_LOG_DIR" not in os.environ
    monkeypatch.setenv("TPU_LOG_DIR", str(tmp_path))  # the user's own choice
    with cluster.own_tpu_logs(files):
        assert os.environ["TPU_LOG_DIR"] == str(tmp_path)
