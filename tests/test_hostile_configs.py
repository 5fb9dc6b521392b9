"""Hostile receiver configs: each is refused before anything in it is called.

A receiver config may come from a file another host wrote. Every attack here carries a payload that
leaves a marker file if any part of it runs (``builtins.open(marker, "w")``, ``os.system("touch ...")``,
a pickle whose ``__reduce__`` does the same, an interpolation resolver that touches it). Each case must be
refused with :class:`~weightsync.ConfigurationError` naming the place, the marker must not appear, and
nothing may reach Hydra's ``instantiate``, ``os.system``, a subprocess or an import outside weightsync.
A control test shows the payloads are live: handed to Hydra's own ``instantiate``, they do leave their
marker.
"""

from __future__ import annotations

import ast
import copy
import importlib
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path

import hydra.utils
import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from torch import nn

import weightsync as ws
from tests._as_stranger import STRANGER_UID, needs_stranger, run_stranger
from weightsync import config as wc
from weightsync.config.plain import MAX_CONFIG_BYTES
from weightsync.config.receiver import RECEIVER_TARGET

ROOT = Path(__file__).resolve().parent.parent
#: Modules the payloads below name: importing one while building a receiver is already a step too far.
_PAYLOAD_MODULES = {"builtins", "os", "posix", "subprocess", "torch", "hydra", "omegaconf", "pickle", "mypkgx"}


class _Touch:
    """Pickled, it runs ``os.system("touch <path>")`` when loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import posix  # os.system itself, by the name a pickle records (the tripwires replace os.system)

        return (posix.system, (f"touch {self.path}",))


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a hostile config ran code: its marker file exists"


@pytest.fixture
def tripwires(monkeypatch):
    """Record (and refuse) every way a config could run code: Hydra's instantiate, os.system, subprocesses,
    imports of modules outside weightsync."""
    calls: list[str] = []
    real_import = importlib.import_module

    def refuse(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} was called while building a receiver")

        return call

    def import_module(name, package=None):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("weightsync") and name.split(".")[0] in _PAYLOAD_MODULES:
            calls.append(f"import {name}")  # weightsync itself importing what a payload names
        return real_import(name, package)

    monkeypatch.setattr(hydra.utils, "instantiate", refuse("hydra.utils.instantiate"))
    monkeypatch.setattr("hydra._internal.instantiate._instantiate2.instantiate", refuse("hydra instantiate"))
    monkeypatch.setattr(os, "system", refuse("os.system"))
    monkeypatch.setattr("subprocess.Popen.__init__", refuse("subprocess.Popen"))
    monkeypatch.setattr(importlib, "import_module", import_module)
    yield calls
    assert calls == [], f"a hostile config reached {calls}"


@pytest.fixture
def legit():
    """A live multiprocess sender for 2 workers, and worker 0's receiver config."""
    sender = ws.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=20)
    sender.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=2)
    yield sender, sender.receiver_config(0)
    sender.shutdown()


def _open(marker) -> dict:
    return {"_target_": "builtins.open", "file": str(marker), "mode": "w"}


def _system(marker) -> dict:
    return {"_target_": "os.system", "command": f"touch {marker}"}


def _pickle_load(marker, tmp_path) -> dict:
    blob = tmp_path / "payload.pt"
    torch.save(_Touch(str(marker)), blob)  # its pickle runs `touch marker` when loaded
    return {"_target_": "torch.load", "f": str(blob), "weights_only": False}


def _nested_from_config(payload: dict) -> dict:
    """The attack from the issue: a nested call to from_config itself, widening its own allowlist."""
    return {"_target_": "weightsync.config.from_config", "cfg": yaml.safe_dump(payload), "allow": [""]}


def _with(cfg: dict, path: str, value) -> dict:
    """A copy of ``cfg`` with ``value`` (itself not copied) at dotted ``path`` (a new key where none is)."""
    out = copy.deepcopy(cfg)
    keys = path.split(".")
    node = out
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return out


def _without(cfg: dict, path: str) -> dict:
    out = copy.deepcopy(cfg)
    keys = path.split(".")
    node = out
    for key in keys[:-1]:
        node = node[key]
    del node[keys[-1]]
    return out


# Each case: (id, build(cfg, marker, tmp_path) -> the hostile input, what the error must name).
CODE_CASES = [
    (
        "the issue's attack: nested from_config with allow=['']",
        lambda c, m, t: _nested_from_config(_open(m)),
        r"refuses _target_ 'weightsync.config.from_config' at <root>",
    ),
    (
        "the issue's attack, loading a pickle",
        lambda c, m, t: _nested_from_config(_pickle_load(m, t)),
        r"refuses _target_ 'weightsync.config.from_config' at <root>",
    ),
    (
        "nested from_config in place of the scheme",
        lambda c, m, t: _with(c, "scheme", _nested_from_config(_open(m))),
        r"weightsync.config.from_config' at scheme._target_",
    ),
    ("torch.load of a pickle at the root", lambda c, m, t: _pickle_load(m, t), r"refuses _target_ 'torch.load'"),
    ("torch.load in place of the scheme", lambda c, m, t: _with(c, "scheme", _pickle_load(m, t)), r"'torch.load'"),
    ("builtins.open as the scheme", lambda c, m, t: _with(c, "scheme", _open(m)), r"'builtins.open' at scheme"),
    ("os.system as the scheme", lambda c, m, t: _with(c, "scheme", _system(m)), r"'os.system' at scheme"),
    ("os.system at the root", lambda c, m, t: {**_system(m)}, r"'os.system' at <root>"),
    (
        "make_receiver nested in the scheme",
        lambda c, m, t: _with(c, "scheme", {**c, "scheme": _open(m)}),
        r"make_receiver' at scheme._target_",
    ),
    (
        "hydra.utils.instantiate as the scheme",
        lambda c, m, t: _with(c, "scheme", {"_target_": "hydra.utils.instantiate", "config": _open(m)}),
        r"'hydra.utils.instantiate' at scheme",
    ),
    (
        "a weightsync callable that is not a scheme (the main job)",
        lambda c, m, t: _with(c, "scheme", {"_target_": "weightsync.app.job.run_job", "cfg": {}}),
        r"not a scheme of this version",
    ),
    (
        "a weightsync class that is not a scheme (ModuleActor)",
        lambda c, m, t: _with(c, "scheme", {"_target_": "weightsync.ModuleActor", "module": _open(m)}),
        r"not a scheme of this version",
    ),
    ("_partial_ at the root", lambda c, m, t: {**c, "_partial_": True}, r"key '_partial_' at <root> is not a plain"),
    (
        "_args_ on a scheme swapped for open",
        lambda c, m, t: _with(c, "scheme", {"_target_": "builtins.open", "_args_": [str(m), "w"]}),
        r"key '_args_' at scheme is not a plain name",
    ),
    (
        "_args_ on a real scheme",
        lambda c, m, t: _with(c, "scheme._args_", [_open(m)]),
        r"key '_args_' at scheme is not a plain name",
    ),
    ("_partial_ in the scheme", lambda c, m, t: _with(c, "scheme._partial_", True), r"'_partial_' at scheme"),
    ("_recursive_ at the root", lambda c, m, t: {**c, "_recursive_": False}, r"'_recursive_' at <root>"),
    ("_convert_ in the scheme", lambda c, m, t: _with(c, "scheme._convert_", "all"), r"'_convert_' at scheme"),
    ("a target in an option's value", lambda c, m, t: _with(c, "scheme.timeout", _open(m)), r"scheme.timeout"),
    ("a target in a list value", lambda c, m, t: _with(c, "scheme.strategy", [_open(m)]), r"scheme.strategy"),
    ("a target in the connection", lambda c, m, t: _with(c, "connection.address", _open(m)), r"connection.address"),
    ("a target as the worker index", lambda c, m, t: _with(c, "worker_idx", _system(m)), r"worker_idx"),
    ("an extra connection field", lambda c, m, t: _with(c, "connection.hook", _open(m)), r"unknown fields \['hook'\]"),
    (
        "a scheme option the scheme does not have",
        lambda c, m, t: _with(c, "scheme.on_apply", _system(m)),
        r"scheme has unknown fields \['on_apply'\]",
    ),
    (
        "a prefix look-alike of an allowed package",
        lambda c, m, t: _with(c, "scheme", {"_target_": "mypkgx.Scheme"}),
        r"refuses _target_ 'mypkgx.Scheme'",
    ),
]


def _interpolation_cases():
    return [
        ("oc.env in the model id", "model_id", "${oc.env:HOME}"),
        ("a custom resolver that runs code", "connection.address", "${weightsync_test_touch:}"),
        ("oc.decode of a nested target", "scheme.strategy", "${oc.decode:'{_target_: os.system}'}"),
        ("oc.create", "scheme.timeout", "${oc.create:{a: 1}}"),
        ("a node interpolation", "scheme.timeout", "${scheme.connect_timeout}"),
    ]


@pytest.mark.parametrize("case", CODE_CASES, ids=[c[0] for c in CODE_CASES])
@pytest.mark.parametrize("form", ["dict", "yaml", "dictconfig"])
def test_configs_that_would_run_code_are_refused_before_anything_is_called(
    case, form, legit, marker, tripwires, tmp_path
):
    _, cfg = legit
    _, build, where = case
    hostile = build(cfg, marker, tmp_path)
    given = {"dict": hostile, "yaml": yaml.safe_dump(hostile), "dictconfig": OmegaConf.create(hostile)}[form]
    with pytest.raises(ws.ConfigurationError, match=where):
        wc.from_config(given, allow=("mypkg",))


@pytest.mark.parametrize("case", _interpolation_cases(), ids=[c[0] for c in _interpolation_cases()])
@pytest.mark.parametrize("form", ["yaml", "dictconfig", "dict"])
def test_interpolations_are_refused_never_resolved(case, form, legit, marker, tripwires):
    _, cfg = legit
    _, path, value = case
    OmegaConf.register_new_resolver("weightsync_test_touch", lambda: marker.touch() or "@x", replace=True)
    hostile = _with(cfg, path, value)
    given = {"dict": hostile, "yaml": yaml.safe_dump(hostile), "dictconfig": OmegaConf.create(hostile)}[form]
    with pytest.raises(ws.ConfigurationError, match=rf"{path.replace('.', '[.]')} holds an interpolation"):
        wc.from_config(given)


def test_make_receiver_checks_its_fields_too(legit, tripwires):
    """Reached through hydra.utils.instantiate (configs you wrote), it still checks what it is given."""
    _, cfg = legit
    with pytest.raises(ws.ConfigurationError, match="connection.address holds an interpolation"):
        wc.make_receiver(ws.MultiProcessWeightSyncScheme(), "policy", 0, {**cfg["connection"], "address": "${x}"})
    with pytest.raises(ws.ConfigurationError, match="worker_idx must be an integer"):
        wc.make_receiver(ws.MultiProcessWeightSyncScheme(), "policy", -1, cfg["connection"])
    with pytest.raises(ws.ConfigurationError, match="must build a WeightSyncScheme"):
        wc.make_receiver(open, "policy", 0, cfg["connection"])
    scheme = wc.make_receiver(ws.MultiProcessWeightSyncScheme(), "policy", 1, cfg["connection"])
    assert scheme.worker_idx == 1 and scheme.model_id == "policy"


YAML_CASES = [
    ("python/object/apply", "scheme: !!python/object/apply:os.system ['touch {m}']", "not plain YAML"),
    ("python/object/new", "scheme: !!python/object/new:builtins.open ['{m}', 'w']", "not plain YAML"),
    ("python/name", "scheme: !!python/name:os.system", "not plain YAML"),
    ("python/module", "scheme: !!python/module:os", "not plain YAML"),
    ("a custom tag", "scheme: !evil {{cmd: 'touch {m}'}}", "not plain YAML"),
    ("binary", "model_id: !!binary aGVsbG8=", "holds a bytes"),
    ("set", "model_id: !!set {{a, b}}", "holds a set"),
    ("timestamp", "model_id: 2001-12-14t21:59:43.10-05:00", "holds a datetime"),
    ("billion laughs", "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n", "aliases"),
    ("a merge key", "base: {{worker_idx: 1}}\n<<: {{worker_idx: 1}}\n", "merge keys"),
    ("duplicate keys", "worker_idx: 0\nworker_idx: 1\n", "duplicate key 'worker_idx'"),
    ("a non-string key", "1: x\n", "keys must be strings"),
    ("deep nesting", "a: " + "[" * 5000 + "]" * 5000, "deeper than"),
    ("a sequence at the root", "- _target_: os.system\n", "is a mapping, got list"),
    ("a scalar at the root", "os.system", "is a mapping, got str"),
    ("broken YAML", "a: [unclosed", "not plain YAML"),
]


@pytest.mark.parametrize("case", YAML_CASES, ids=[c[0] for c in YAML_CASES])
def test_yaml_beyond_plain_data_is_refused(case, marker, tripwires):
    _, text, why = case
    with pytest.raises(ws.ConfigurationError, match=why):
        wc.from_config(text.format(m=marker))


def _rpc_config(**connection) -> dict:
    conn = {"token": "0" * 16, "master_addr": "127.0.0.1", "master_port": 29999, "world_size": 2, "counter": 0}
    conn.update(connection)
    return {
        "_target_": RECEIVER_TARGET,
        "scheme": {"_target_": "weightsync.schemes.rpc.RPCWeightSyncScheme", "allow_store_peers_to_run_code": True},
        "model_id": "policy",
        "worker_idx": 0,
        "connection": conn,
    }


TAMPERED = [
    ("key file: /etc/passwd", "connection.authkey_file", "/etc/passwd", "connection.authkey_file must be"),
    ("key file: a dot-dot escape", "connection.authkey_file", "{keydir}/../../etc/shadow", "authkey_file must be"),
    ("key file: an ssh key", "connection.authkey_file", os.path.expanduser("~/.ssh/id_rsa"), "authkey_file"),
    ("key file: another address's", "connection.authkey_file", "{keydir}/weightsync-1-00.1.key", "authkey_file"),
    ("key file: relative", "connection.authkey_file", "weightsync-0/x.key", "authkey_file must be"),
    ("address: a socket file", "connection.address", "/var/run/docker.sock", "abstract socket address"),
    ("address: a path in the abstract name", "connection.address", "@../../x", "abstract socket address"),
    ("timeout: negative", "scheme.timeout", -1, r"timeout must be a positive number of seconds"),
    ("timeout: infinite", "scheme.timeout", float("inf"), "timeout must be a positive number of seconds, finite"),
    ("timeout: NaN", "scheme.timeout", float("nan"), "timeout must be a positive number of seconds, finite"),
    (
        "timeout: a year",
        "scheme.timeout",
        3.2e7,
        r"timeout must be a positive number of seconds, finite and at most 3600,",
    ),
    ("timeout: a string", "scheme.timeout", "60", "scheme.timeout must be a positive number of seconds"),
    ("timeout: a bool", "scheme.timeout", True, "scheme.timeout must be a positive number of seconds"),
    ("sync: a string", "scheme.sync", "yes", "scheme.sync must be true or false"),
    ("max_slots: 1e100", "scheme.max_slots", 1e100, "scheme.max_slots must be a positive int or None"),
    ("max_slots: 10**30", "scheme.max_slots", 10**30, "scheme.max_slots holds an integer of 100 bits"),
    ("strategy: unknown", "scheme.strategy", "pickle", "scheme.strategy must be 'tensordict' or 'state_dict'"),
    ("on_failure: unknown", "scheme.on_failure", "exec", "on_failure must be 'raise' or 'drop'"),
    ("worker_idx: negative", "worker_idx", -1, r"worker_idx must be an integer in \[0"),
    ("worker_idx: huge", "worker_idx", 10**30, "worker_idx holds an integer of 100 bits"),
    ("worker_idx: a bool", "worker_idx", True, "worker_idx must be an integer"),
    ("model_id: a newline", "model_id", "policy\nevil", "model_id must be a model name or path"),
    ("model_id: a space", "model_id", "rm -rf", "model_id must be a model name or path"),
    ("scheme: another engine's", "scheme._target_", "weightsync.DistributedWeightSyncScheme", "unknown fields"),
    ("root target: swapped", "_target_", "weightsync.config.receiver.from_config", "refuses _target_"),
]


@pytest.mark.parametrize("case", TAMPERED, ids=[c[0] for c in TAMPERED])
def test_tampered_fields_of_a_legitimate_config_are_refused(case, legit, marker, tripwires):
    _, cfg = legit
    _, path, value, why = case
    if isinstance(value, str):
        value = value.format(keydir=os.path.dirname(cfg["connection"]["authkey_file"]))
    with pytest.raises(ws.ConfigurationError, match=why):
        wc.from_config(_with(cfg, path, value))


@pytest.mark.parametrize("missing", ["scheme", "connection", "model_id", "worker_idx", "connection.authkey_file"])
def test_a_config_missing_a_field_is_refused(missing, legit, tripwires):
    with pytest.raises(ws.ConfigurationError, match="lacks fields"):
        wc.from_config(_without(legit[1], missing))


def test_pickling_engines_are_built_only_with_the_callers_opt_in(tripwires):
    # The config asks for the opt-in; only the caller can give it, by its name (allow_pickle is not it).
    with pytest.raises(ws.ConfigurationError, match="unpickles and runs what the RPC world at 10.9.9.9:29999 sends"):
        wc.from_config(_rpc_config(master_addr="10.9.9.9"))
    with pytest.raises(ws.ConfigurationError, match=r"from_config\(cfg, allow_store_peers_to_run_code=True\)"):
        wc.from_config(_rpc_config(), allow_pickle=True)  # on loopback too: any local user can serve a store there
    receiver = wc.from_config(_rpc_config(), allow_store_peers_to_run_code=True)
    assert receiver.allow_store_peers_to_run_code is True and receiver.worker_idx == 0
    # And the caller's word is the receiver's, whatever the config says.
    cfg = _with(_rpc_config(), "scheme.allow_store_peers_to_run_code", False)
    assert wc.from_config(cfg, allow_store_peers_to_run_code=True).allow_store_peers_to_run_code is True
    with pytest.raises(ws.ConfigurationError, match="unknown fields"):
        wc.from_config(_with(_rpc_config(), "scheme.allow_pickle", True), allow_store_peers_to_run_code=True)
    # A worker with an RPC agent of its own joins no world the config names: nothing to opt into.
    external = {**_rpc_config(), "connection": {"external": True}}
    assert wc.from_config(external).receiver_unpickles({"external": True}) is None
    named = {**_rpc_config(), "connection": {"external": True, "sender": "0123456789abcdef"}}  # (its sender's id)
    assert wc.from_config(named).receiver_unpickles(named["connection"]) is None
    for bad in (
        {"external": 1},
        {"external": True, "master_addr": "x"},
        {"token": "zz" * 8},
        {"external": True, "sender": "not an id"},
        {"external": True, "sender": 7},
    ):
        with pytest.raises(ws.ConfigurationError, match="connection"):
            wc.from_config({**_rpc_config(), "connection": bad}, allow_store_peers_to_run_code=True)


def test_a_distributed_config_names_a_run_key_file_and_carries_no_key(tripwires):
    key_file = f"/run/user/0/weightsync-{os.getuid()}/weightsync-12-{'ab' * 12}.4026531836.key"
    cfg = {
        "_target_": RECEIVER_TARGET,
        "scheme": {"_target_": "weightsync.DistributedWeightSyncScheme"},
        "model_id": "policy",
        "worker_idx": 0,
        "connection": {"master_addr": "127.0.0.1", "master_port": 29500, "world_size": 3, "authkey_file": key_file},
    }
    assert wc.from_config(cfg).model_id == "policy"  # nothing is read before init_on_receiver
    local_key = f"/run/user/0/weightsync-{os.getuid()}/weightsync-12-{'ab' * 8}.4026531836.key"
    for bad in ("/etc/shadow", local_key, "relative/weightsync-12-x.key", key_file + "/../x"):
        with pytest.raises(ws.ConfigurationError, match="connection.authkey_file must be the path"):
            wc.from_config(_with(cfg, "connection.authkey_file", bad))
    with pytest.raises(ws.ConfigurationError, match="authkey"):  # the key itself never travels in a config
        wc.from_config(_with(cfg, "connection.authkey", "ab" * 32))
    with pytest.raises(ws.ConfigurationError, match="master_port must be an integer in"):
        wc.from_config(_with(cfg, "connection.master_port", 70000))
    with pytest.raises(ws.ConfigurationError, match="master_addr must be a host name"):
        wc.from_config(_with(cfg, "connection.master_addr", "host; touch x"))


OVERSIZED = [
    ("text over the limit", lambda c: "model_id: " + "a" * MAX_CONFIG_BYTES, "over 65536 bytes"),
    ("a long model id", lambda c: _with(c, "model_id", "p" * 10_000), "holds a string of 10000 characters"),
    ("a long option", lambda c: _with(c, "scheme.on_failure", "r" * 2000), "scheme.on_failure must be"),
    ("many keys", lambda c: {**c, **{f"k{i}": i for i in range(600)}}, "more than 512 values"),
    ("a long list", lambda c: _with(c, "scheme.strategy", list(range(600))), "more than 512 values"),
    ("deep dicts", lambda c: _with(c, "connection.address", _deep(50)), "deeper than 8 levels"),
    ("a long key", lambda c: _with(c, "scheme." + "k" * 100, 1), "is not a plain name"),
]


def _deep(n: int) -> dict:
    node: dict = {}
    for _ in range(n):
        node = {"a": node}
    return node


@pytest.mark.parametrize("case", OVERSIZED, ids=[c[0] for c in OVERSIZED])
def test_oversized_values_are_refused(case, legit, tripwires):
    _, build, why = case
    with pytest.raises(ws.ConfigurationError, match=why):
        wc.from_config(build(legit[1]))


class _EvilStr(str):
    def startswith(self, *args):  # a string whose methods would lie to a check
        return True

    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


@pytest.mark.parametrize(
    "value, why",
    [
        (_EvilStr("os.system"), "holds a _EvilStr"),
        (_Touch("/nonexistent/marker"), "holds a _Touch"),
        (b"bytes", "holds a bytes"),
        ({1, 2}, "holds a set"),
        ((1, 2), "holds a tuple"),
    ],
    ids=["a str subclass", "an object with __reduce__", "bytes", "a set", "a tuple"],
)
def test_objects_that_are_not_plain_data_are_refused(value, why, legit, tripwires):
    with pytest.raises(ws.ConfigurationError, match=why):
        wc.from_config(_with(legit[1], "scheme._target_", value))
    with pytest.raises(ws.ConfigurationError, match="is a dict, a DictConfig, YAML text or a pathlib.Path"):
        wc.from_config([legit[1]])


def test_a_symlink_or_fifo_in_place_of_the_key_file_is_not_read(legit, tmp_path, tripwires):
    sender, cfg = legit
    key_file = cfg["connection"]["authkey_file"]
    decoy = tmp_path / "decoy"
    decoy.write_text("ab" * 32)
    decoy.chmod(0o600)
    real = Path(key_file).read_text()
    os.unlink(key_file)
    try:
        os.symlink(decoy, key_file)
        receiver = wc.from_config(cfg)  # the path has the right shape: it is read at init, and refused there
        with pytest.raises(ws.ConfigurationError, match="cannot be opened as a plain file"):
            receiver.init_on_receiver(model=nn.Linear(2, 2))
        os.unlink(key_file)
        os.mkfifo(key_file, 0o600)
        receiver = wc.from_config(cfg)
        with pytest.raises(ws.ConfigurationError, match="is not a plain file"):
            receiver.init_on_receiver(model=nn.Linear(2, 2))  # returns at once: O_NONBLOCK, never blocks
        os.unlink(key_file)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, real.encode())
        os.close(fd)
        os.chmod(key_file, 0o644)
        with pytest.raises(ws.ConfigurationError, match="readable by other users"):
            wc.from_config(cfg).init_on_receiver(model=nn.Linear(2, 2))
        os.chmod(key_file, 0o600)
        Path(key_file).write_text("not a key")
        with pytest.raises(ws.ConfigurationError, match="does not hold a weightsync auth key"):
            wc.from_config(cfg).init_on_receiver(model=nn.Linear(2, 2))
    finally:
        if os.path.lexists(key_file):
            os.unlink(key_file)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, real.encode())
        os.close(fd)


def test_another_workers_index_is_refused_by_the_worker_and_by_the_sender(legit, tripwires):
    sender, cfg0 = legit
    cfg1 = sender.receiver_config(1)
    models = [nn.Linear(2, 2), nn.Linear(2, 2)]
    receivers = [wc.from_config(c) for c in (cfg0, cfg1)]
    for receiver, model in zip(receivers, models):
        receiver.init_on_receiver(model=model)
    threads = [threading.Thread(target=r.connect) for r in receivers]
    for t in threads:
        t.start()
    sender.connect()
    for t in threads:
        t.join(20)
    try:
        # A worker that knows it is worker 0 refuses a config made for worker 1, before it connects.
        with pytest.raises(ws.ConfigurationError, match="made for worker 1 .*, not worker 0"):
            wc.from_config(cfg1).init_on_receiver(model=nn.Linear(2, 2), worker_idx=0)
        # A config for worker 0 tampered to say worker 1, while worker 1 is live: the sender turns it away.
        intruder = wc.from_config(_with(cfg0, "worker_idx", 1))
        intruder.init_on_receiver(model=nn.Linear(2, 2))
        with pytest.raises(ws.ConfigurationError, match="worker 1 is already connected"):
            intruder.connect()
        intruder.shutdown()
        # The real worker 1 is still served.
        for p in sender.model.parameters():
            p.data.add_(1.0)
        done = threading.Thread(target=sender.send)
        done.start()
        deadline = time.monotonic() + 20
        while min(r.version for r in receivers) < 1 and time.monotonic() < deadline:
            for receiver in receivers:
                receiver.receive(timeout=0.05)
        done.join(20)
        assert receivers[1].version == 1 and (models[1].weight == sender.model.weight).all()
    finally:
        for receiver in receivers:
            receiver.shutdown()


@pytest.mark.parametrize(
    "prefix, why",
    [
        ("", "must name a package or module"),
        (".", "must name a package or module"),
        ("builtins", "too broad"),
        ("os.path", "too broad"),
        ("torch", "too broad"),
        ("weightsync", "too broad"),
        ("hydra.utils", "too broad"),
        ("my pkg", "dotted module path"),
        (None, "must name a package"),
    ],
)
def test_empty_or_over_broad_prefixes_are_refused(prefix, why, legit, marker, tripwires):
    with pytest.raises(ws.ConfigurationError, match=why):
        wc.allow_targets(prefix)
    with pytest.raises(ws.ConfigurationError, match=why):
        wc.from_config(legit[1], allow=(prefix,))
    assert wc.allowed_targets() == []


def test_an_allowed_prefix_admits_only_scheme_classes_with_their_plain_options(legit, marker, monkeypatch, tmp_path):
    package = tmp_path / "mypkg_ws"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import weightsync as ws\n"
        "from weightsync import checks\n"
        "from weightsync.options import Option\n"
        "class MyScheme(ws.MultiProcessWeightSyncScheme):\n"
        "    COLOUR = Option('colour', 'red', str, 'A colour.', checks.text())\n"
        "    OPTIONS = (*ws.MultiProcessWeightSyncScheme.OPTIONS, COLOUR)\n"
        "def not_a_scheme(**kwargs):\n"
        "    raise AssertionError('called')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _with(legit[1], "scheme", {"_target_": "mypkg_ws.MyScheme", "colour": "blue"})
    with pytest.raises(ws.ConfigurationError, match="refuses _target_ 'mypkg_ws.MyScheme'"):
        wc.from_config(cfg)  # not allowed yet
    scheme = wc.from_config(cfg, allow=("mypkg_ws.",))
    assert type(scheme).__name__ == "MyScheme" and scheme.colour == "blue" and scheme.worker_idx == 0
    with pytest.raises(ws.ConfigurationError, match="not a weightsync scheme"):
        wc.from_config(_with(cfg, "scheme", {"_target_": "mypkg_ws.not_a_scheme"}), allow=("mypkg_ws",))
    with pytest.raises(ws.ConfigurationError, match=r"scheme.colour must be a plain value"):
        wc.from_config(_with(cfg, "scheme.colour", _open(marker)), allow=("mypkg_ws",))
    with pytest.raises(ws.ConfigurationError, match=r"unknown fields \['kwargs'\]"):
        wc.from_config(_with(cfg, "scheme.kwargs", {}), allow=("mypkg_ws",))
    wc.allow_targets("mypkg_ws")
    try:
        assert wc.allowed_targets() == ["mypkg_ws"] and wc.from_config(cfg).colour == "blue"
    finally:
        wc.receiver._ALLOWED.clear()


@pytest.mark.parametrize("make", ["open", "pickle"])
def test_control_the_payloads_are_live(make, marker, tmp_path):
    """The same payloads, handed to Hydra's instantiate (which runs whatever a config names, bar its own
    blocklist of os.system and the like), do leave their marker: the refusals above are not refusals of
    harmless configs."""
    payload = {"open": _open(marker), "pickle": _pickle_load(marker, tmp_path)}[make]
    result = hydra.utils.instantiate(payload)
    if hasattr(result, "close"):
        result.close()
    assert marker.exists()
    marker.unlink()


# ------------------------------------------------------------------- fuzzer
_POISON = st.sampled_from(
    [
        {"_target_": "builtins.open", "file": "{m}", "mode": "w"},
        {"_target_": "os.system", "command": "touch {m}"},
        {"_target_": "weightsync.config.from_config", "cfg": "_target_: os.system\ncommand: touch {m}", "allow": [""]},
        {"_target_": "builtins.open", "_args_": ["{m}", "w"]},
        {"_target_": "builtins.exec", "_partial_": True, "source": "open('{m}', 'w')"},
        "${weightsync_test_touch:}",
        "${oc.env:HOME}",
        "${oc.decode:'{{_target_: os.system, command: touch {m}}}'}",
    ]
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
_VALUES = st.recursive(
    st.one_of(_SCALARS, _POISON),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["_target_", "_args_", "a", "cfg"]), inner)
    ),
    max_leaves=8,
)
_PATHS = st.sampled_from(
    [
        "_target_",
        "scheme",
        "scheme._target_",
        "scheme.timeout",
        "scheme.strategy",
        "scheme._partial_",
        "scheme._args_",
        "model_id",
        "worker_idx",
        "connection",
        "connection.address",
        "connection.authkey_file",
        "_partial_",
        "_recursive_",
        "cfg",
        "allow",
    ]
)


def _fill(value, marker: str):
    if isinstance(value, str):
        return value.replace("{m}", marker)
    if isinstance(value, dict):
        return {k: _fill(v, marker) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, marker) for v in value]
    return value


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(st.tuples(_PATHS, _VALUES), min_size=1, max_size=4), form=st.sampled_from(["dict", "yaml"]))
def test_fuzzed_config_trees_are_refused_or_built_plainly(mutations, form, legit, marker, tripwires):
    """Random mutations of a legitimate config (poison targets, interpolations, Hydra's special keys, odd
    values at every place): ``from_config`` either refuses with ConfigurationError or builds a scheme from
    plain values, and no payload ever runs."""
    OmegaConf.register_new_resolver("weightsync_test_touch", lambda: marker.touch() or "x", replace=True)
    cfg = copy.deepcopy(legit[1])
    for path, value in mutations:
        parent = cfg
        keys = path.split(".")
        for key in keys[:-1]:
            if not isinstance(parent.get(key), dict):
                parent[key] = {}
            parent = parent[key]
        parent[keys[-1]] = _fill(value, str(marker))
    if form == "yaml":
        try:
            given_cfg = yaml.safe_dump(cfg)
        except (yaml.YAMLError, ValueError):
            return
    else:
        given_cfg = cfg
    try:
        scheme = wc.from_config(given_cfg)
    except ws.ConfigurationError:
        pass
    else:
        assert isinstance(scheme, ws.WeightSyncScheme)
        assert type(scheme.timeout) is float and type(scheme.model_id) is str and type(scheme.worker_idx) is int
    assert not marker.exists()


# ------------------------------------------------------------- the library
#: Calls that turn bytes into objects (or run text as code), and the only places the library may make them.
_UNSAFE_CALLS = {
    "torch.load": set(),
    "pickle.load": set(),
    "pickle.loads": set(),
    "cloudpickle.loads": set(),
    "marshal.loads": set(),
    "yaml.unsafe_load": set(),
    "yaml.full_load": set(),
    "yaml.load": {"weightsync/config/plain.py"},  # with the strict safe loader, checked below
    "eval": set(),
    "exec": set(),
    "__import__": set(),
    "instantiate": {"weightsync/app/job.py"},  # the trainer's own Hydra config, never a receiver config
    # Targets are looked up where the allowlist applies; the rest import weightsync's own modules by names
    # written in weightsync's own tables (lazy loading), never by a name from outside.
    "importlib.import_module": {
        "weightsync/registry.py",
        "weightsync/config/receiver.py",
        "weightsync/_lazy.py",
    },
}


def _call_name(node: ast.Call) -> str:
    func, parts = node.func, []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def test_the_library_deserialises_nothing_unsafely():
    """No pickle or torch.load anywhere in weightsync, YAML only through the strict loader, and config
    targets resolved only where the allowlist is applied."""
    found = []
    for path in sorted((ROOT / "weightsync").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = _call_name(node)
                short = name.rsplit(".", 1)[-1]
                for unsafe, allowed in _UNSAFE_CALLS.items():
                    if (name == unsafe or short == unsafe and "." not in unsafe) and rel not in allowed:
                        found.append(f"{rel}:{node.lineno} {name}")
                if name == "yaml.load":
                    loader = {k.arg: ast.unparse(k.value) for k in node.keywords}.get("Loader")
                    assert loader == "_StrictLoader", f"{rel}:{node.lineno} yaml.load with Loader={loader}"
    assert found == [], f"unsafe deserialisation or dynamic code in the library: {found}"


# ------------------------------------------- the documented road: a file, read strictly (issue 31, finding 5)
#: 360 bytes of YAML that OmegaConf.load (or yaml.safe_load) expands into 9^9 strings: over 60 s and 900 MB.
ALIAS_BOMB = "".join(
    f"{chr(97 + i)}: &{chr(97 + i)} [{', '.join([f'*{chr(96 + i)}' if i else 'lol'] * 9)}]\n" for i in range(9)
)


def test_an_alias_bomb_given_as_a_path_is_refused_at_once(tmp_path, tripwires):
    """``from_config(Path(file))``, the road docs/multinode.md and examples/two_hosts/worker.py take, reads the file
    itself with the strict loader: the bomb is refused at its first anchor, before anything expands."""
    assert len(ALIAS_BOMB) <= 400 and ALIAS_BOMB.count("*") == 8 * 9
    bomb = tmp_path / "worker0.yaml"
    bomb.write_text(ALIAS_BOMB)
    start = time.perf_counter()
    with pytest.raises(ws.ConfigurationError, match="anchors and aliases are not accepted"):
        ws.from_config(bomb)
    with pytest.raises(ws.ConfigurationError, match="anchors and aliases are not accepted"):
        wc.check_receiver_config(bomb)
    assert time.perf_counter() - start < 1.0


def test_a_config_file_is_read_bounded_and_plain(legit, tmp_path, tripwires):
    _, cfg = legit
    good = tmp_path / "worker0.yaml"
    good.write_text(yaml.safe_dump(cfg))
    assert ws.from_config(good).worker_idx == 0  # the legitimate file builds
    big = tmp_path / "big.yaml"
    big.write_text("model_id: " + "a" * (2 * MAX_CONFIG_BYTES))
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # nobody writes it: opening it must not block
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"model_id: \xff\xfe\n")
    for path, why in [
        (big, "is over 65536 bytes"),
        (fifo, "is not a plain file"),
        (tmp_path, "is not a plain file"),
        (tmp_path / "missing.yaml", "cannot read config file .*No such file"),
        (binary, "is not UTF-8 text"),
    ]:
        with pytest.raises(ws.ConfigurationError, match=why):
            ws.from_config(path)
    with pytest.raises(ws.ConfigurationError, match="to read a file, pass a pathlib.Path"):
        ws.from_config(str(good))  # a str is YAML text: a file's name is refused, with the way to read it


def test_docs_and_examples_never_load_yaml_with_omegaconf():
    """Configs from elsewhere go through weightsync's strict loader: no doc or example shows ``OmegaConf.load``
    (or ``yaml.load``/``safe_load``), which expand aliases before anything can refuse them."""
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").rglob("*.md")]
    code = [*(ROOT / "examples").rglob("*.py")]
    found = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for path in pages + code
        for line in path.read_text().splitlines()
        if re.search(r"OmegaConf\.load\(|yaml\.(safe_)?load\(", line)
    ]
    assert found == []


# ------------------------------------- every field of every scheme, hostile values (issue 31, finding 6)
_UID = os.getuid()
#: Every opt-in of the caller's, so that the schemes that need one get as far as they can.
_OPT_INS = {"allow_pickle": True, "allow_store_peers_to_run_code": True}
_LOCAL_CONNECTION = {
    "address": "@weightsync-12-0123456789abcdef",
    "authkey_file": f"/tmp/weightsync-{_UID}/weightsync-12-0123456789abcdef.4026531836.key",
}
_CONNECTIONS = {
    "MultiProcessWeightSyncScheme": _LOCAL_CONNECTION,
    "SharedMemWeightSyncScheme": _LOCAL_CONNECTION,
    "RPCWeightSyncScheme": {
        "token": "0" * 16,
        "master_addr": "127.0.0.1",
        "master_port": 29999,
        "world_size": 2,
        "counter": 0,
    },
    "DistributedWeightSyncScheme": {
        "master_addr": "node-3.cluster",
        "master_port": 29500,
        "world_size": 3,
        "authkey_file": f"/tmp/weightsync-{_UID}/weightsync-12-{'ab' * 12}.4026531836.key",
    },
}


def _scheme_configs() -> dict[str, dict]:
    """A legitimate receiver config of every built-in scheme, every option of the scheme given."""
    from weightsync.config.receiver import scheme_class
    from weightsync.registry import get_backend, schemes

    out = {}
    for backend in schemes():
        module, name = get_backend(backend).__module__, get_backend(backend).__name__
        cls = scheme_class(f"{module}.{name}", [])
        out[name] = {
            "_target_": RECEIVER_TARGET,
            "scheme": {"_target_": f"{module}.{name}", **cls().option_values()},
            "model_id": "policy",
            "worker_idx": 0,
            "connection": dict(_CONNECTIONS.get(name, {})),
        }
    return out


SCHEME_CONFIGS = _scheme_configs()
#: Values of the wrong type, too large, negative, non-finite, too long, or names a resolver would choke on.
HOSTILE_VALUES = [
    None,
    True,
    -1,
    0,
    2**31,
    2**63,
    2**64,
    10**5000,
    -(10**5000),
    3601,
    1e308,
    -1e308,
    5e-324,
    float("inf"),
    float("-inf"),
    float("nan"),
    "",
    "60",
    "a" * 64,
    "a." * 200,
    "x" * 5000,
    "é" * 70,
    "\x00",
    "${oc.env:HOME}",
    [1, 2],
    {"a": 1},
    {"_target_": "os.system"},
]


def _fields(cfg: dict) -> list[str]:
    return [
        "model_id",
        "worker_idx",
        "connection",
        "scheme",
        *(f"scheme.{k}" for k in cfg["scheme"]),
        "scheme.transport",
        *(f"connection.{k}" for k in cfg["connection"]),
    ]


@pytest.mark.parametrize("name", sorted(SCHEME_CONFIGS))
def test_every_field_of_every_scheme_refuses_hostile_values_with_a_configuration_error(name, tripwires):
    """Each field of each scheme's receiver config, given each hostile value (as a dict): ``from_config`` either
    refuses with ConfigurationError or builds from plain values; no other exception, whatever the value."""
    cfg = SCHEME_CONFIGS[name]
    assert wc.from_config(cfg, **_OPT_INS).model_id == "policy"  # the base itself is legitimate
    escaped = []
    for field in _fields(cfg):
        for value in HOSTILE_VALUES:
            try:
                scheme = wc.from_config(_with(cfg, field, value), **_OPT_INS)
            except ws.ConfigurationError as exc:
                assert len(str(exc)) < 2000, f"{field}={value!r:.40}: a message of {len(str(exc))} characters"
            except Exception as exc:  # noqa: BLE001 - what this test looks for
                escaped.append(f"{field}={value!r:.40}: {type(exc).__name__}: {exc}"[:300])
            else:
                assert 0 < scheme.timeout <= 3600 and 0 < scheme.connect_timeout <= 3600
    assert escaped == []


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), form=st.sampled_from(["dict", "yaml", "dictconfig"]))
def test_fuzzed_fields_of_every_scheme_end_in_a_configuration_error_or_a_plain_scheme(data, form, tripwires):
    name = data.draw(st.sampled_from(sorted(SCHEME_CONFIGS)))
    cfg = copy.deepcopy(SCHEME_CONFIGS[name])
    fields = _fields(cfg)
    for _ in range(data.draw(st.integers(1, 3))):
        field = data.draw(st.sampled_from(fields))
        parent = field.rpartition(".")[0]
        if parent and not isinstance(cfg.get(parent), dict):  # an earlier draw replaced the mapping
            continue
        value = data.draw(
            st.one_of(
                st.sampled_from(HOSTILE_VALUES),
                st.integers(min_value=-(2**80), max_value=2**80),
                st.floats(),
                st.text(max_size=300),
                st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=3),
            )
        )
        cfg = _with(cfg, field, value)
    try:
        given_cfg = {"dict": cfg, "yaml": yaml.safe_dump, "dictconfig": OmegaConf.create}[form](cfg)
    except Exception:  # noqa: BLE001 - a value that YAML or OmegaConf cannot hold: nothing to hand over
        return
    try:
        scheme = wc.from_config(given_cfg, **_OPT_INS)
    except ws.ConfigurationError:
        return
    assert 0 < scheme.timeout <= 3600 and type(scheme.worker_idx) is int


def test_an_integer_of_over_4300_digits_is_refused_before_int_reads_it(legit, tripwires):
    _, cfg = legit
    text = yaml.safe_dump(cfg)
    for where, digits in [("worker_idx", "9" * 5000), ("scheme.timeout", "1" * 4301), ("extra", "0b" + "1" * 99)]:
        key = where.split(".")[-1]
        hostile = re.sub(rf"(?m)^(\s*){key}: .*$", rf"\g<1>{key}: {digits}", text) if key in text else text
        if key == "extra":
            hostile = text + f"extra: {digits}\n"
        with pytest.raises(ws.ConfigurationError, match=r"number in a config is written in \d+ characters"):
            wc.from_config(hostile)
    with pytest.raises(ws.ConfigurationError, match="number in a config"):  # sexagesimal: int() in a loop
        wc.from_config(text + "extra: " + "1:" * 3000 + "1\n")
    # In a dict or from a constructor's caller, the number is already an int: refused, and never printed.
    with pytest.raises(ws.ConfigurationError, match="worker_idx holds an integer of 16610 bits"):
        wc.from_config(_with(cfg, "worker_idx", 10**5000))
    with pytest.raises(ws.ConfigurationError, match="got an integer of 16610 bits"):
        ws.MultiProcessWeightSyncScheme(timeout=10**5000)


@pytest.mark.parametrize(
    "connection",
    [5, "ab", None, b"xy", [("address", "@x")], OmegaConf.create([1])],
    ids=["an int", "a str", "None", "bytes", "a list of pairs", "a ListConfig"],
)
def test_make_receiver_refuses_a_connection_that_is_not_a_mapping(connection, tripwires):
    with pytest.raises(ws.ConfigurationError, match="connection must be a mapping"):
        wc.make_receiver(ws.MultiProcessWeightSyncScheme(), "policy", 0, connection)


def test_make_receiver_takes_a_dictconfig_connection_as_data(legit, marker, tripwires):
    _, cfg = legit
    OmegaConf.register_new_resolver("weightsync_test_touch", lambda: marker.touch() or "@x", replace=True)
    hostile = OmegaConf.create({**cfg["connection"], "address": "${weightsync_test_touch:}"})
    with pytest.raises(ws.ConfigurationError, match="connection.address holds an interpolation"):
        wc.make_receiver(ws.MultiProcessWeightSyncScheme(), "policy", 0, hostile)
    scheme = wc.make_receiver(ws.MultiProcessWeightSyncScheme(), "policy", 0, OmegaConf.create(cfg["connection"]))
    assert scheme.worker_idx == 0


HOSTS_REFUSED = [
    "a" * 64,
    "x." * 127,
    "a..b",
    "-a.b",
    "a-.b",
    "host; touch x",
    "[::1]",
    "a b",
    ".",
    "é" * 64,
    "1::2::3",
]
HOSTS_TAKEN = ["10.0.0.1", "::1", "fe80::1%eth0", "node-3.cluster", "localhost", "a" * 63, "bücher.example", "n1."]


@pytest.mark.parametrize("host", HOSTS_REFUSED)
def test_host_names_the_resolver_would_choke_on_are_refused_at_config_time(host, monkeypatch, tripwires):
    """A 64-character label raised UnicodeError at connect: it is a ConfigurationError naming the field, from a
    receiver config, from a constructor, and from ``MASTER_ADDR``."""
    dist = SCHEME_CONFIGS["DistributedWeightSyncScheme"]
    with pytest.raises(ws.ConfigurationError, match="connection.master_addr must be a host name or IP address"):
        wc.from_config(_with(dist, "connection.master_addr", host))
    with pytest.raises(ws.ConfigurationError, match="^master_addr must be a host name"):
        ws.DistributedWeightSyncScheme(master_addr=host)
    from weightsync.transports.network import resolve_master

    monkeypatch.setenv("MASTER_ADDR", host)
    with pytest.raises(ws.ConfigurationError, match="environment variable MASTER_ADDR must be a host name"):
        resolve_master(None, None)


def test_the_sender_refuses_a_master_addr_from_the_environment_before_it_binds(monkeypatch, tripwires):
    monkeypatch.setenv("MASTER_ADDR", "a" * 64)
    sender = ws.DistributedWeightSyncScheme(timeout=5, connect_timeout=5)
    try:
        with pytest.raises(ws.ConfigurationError, match="MASTER_ADDR must be a host name"):
            sender.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    finally:
        sender.shutdown()


@settings(max_examples=300, deadline=None)
@given(
    host=st.one_of(
        st.sampled_from(HOSTS_REFUSED + HOSTS_TAKEN),
        st.text(alphabet=st.sampled_from("ab-_.:%é1[]"), max_size=80),
        st.lists(st.text(alphabet="abz09-", min_size=0, max_size=70), max_size=6).map(".".join),
        st.text(max_size=40),
    )
)
def test_a_host_name_that_passes_is_one_the_resolver_encodes(host):
    """What ``checks.host`` takes, the socket module encodes (IDNA) without error, within RFC 1035's lengths."""
    import ipaddress

    from weightsync import checks

    try:
        taken = checks.host(host, "master_addr")
    except ws.ConfigurationError:
        assume(host not in HOSTS_TAKEN)
        return
    assert host not in HOSTS_REFUSED
    try:
        ipaddress.ip_address(taken)
        return
    except ValueError:
        pass
    encoded = taken.rstrip(".").encode("idna")
    assert len(encoded) <= 253 and all(0 < len(label) <= 63 for label in encoded.split(b"."))


@pytest.mark.parametrize("field", ["timeout", "connect_timeout"])
def test_no_config_makes_a_worker_wait_more_than_an_hour(field, legit, tripwires):
    _, cfg = legit
    assert wc.from_config(_with(cfg, f"scheme.{field}", 3600)).__getattribute__(field) == 3600.0
    for value in (3600.5, 1e6, 2**40):
        with pytest.raises(ws.ConfigurationError, match=rf"scheme.{field} must be .* at most 3600"):
            wc.from_config(_with(cfg, f"scheme.{field}", value))
        with pytest.raises(ws.ConfigurationError, match=f"{field} must be .* at most 3600"):
            ws.MultiProcessWeightSyncScheme(**{field: value})


# ------------------------------------------------ key directories another user cannot take (finding 6)
@pytest.fixture
def shared_tmp(monkeypatch):
    """A private stand-in for /tmp (world-writable, sticky) that this test alone uses, as the temporary directory
    of this process, with ``XDG_RUNTIME_DIR`` unset: key files go under it."""
    base = tempfile.mkdtemp(prefix="weightsync-squat-", dir="/tmp")
    os.chmod(base, 0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", base)
    monkeypatch.setattr(tempfile, "tempdir", base)
    yield Path(base)
    shutil.rmtree(base)


@needs_stranger
@pytest.mark.parametrize("kind", ["dir", "file", "symlink"])
def test_a_key_directory_squatted_by_another_user_denies_nothing(kind, shared_tmp):
    """Another user who takes ``<tmp>/weightsync-<uid>`` first (an open directory, a file, or a link to a directory
    of ours) and plants a decoy shaped like the fallback: keys still go to a private directory of ours, which a
    receiver config names and a receiver reads; nothing lands where the stranger pointed."""
    from weightsync.transports import keyfiles

    ours = shared_tmp / "ours"  # a directory of this user's the link points to: no key may land in it
    ours.mkdir(mode=0o700)
    name = shared_tmp / f"weightsync-{os.getuid()}"
    attack = run_stranger(
        ["-m", "tests._attack_keydir", str(shared_tmp), str(os.getuid()), kind, str(ours)], timeout=60
    )
    assert attack.returncode == 0 and "planted" in attack.stdout, attack.stdout
    assert os.lstat(name).st_uid == STRANGER_UID

    directory = keyfiles.key_dir()
    assert Path(directory).parent.parent == shared_tmp and Path(directory).name == name.name
    for level in (Path(directory), Path(directory).parent):
        info = os.lstat(level)
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
    assert keyfiles.key_dir() == directory  # found again by the next run, not one more directory each time

    sender = ws.MultiProcessWeightSyncScheme(timeout=10, connect_timeout=20)
    sender.init_on_sender(model_id="policy", model=nn.Linear(2, 2), num_workers=1)
    try:
        cfg = sender.receiver_config(0)
        key_file = cfg["connection"]["authkey_file"]
        assert os.path.dirname(key_file) == directory
        assert wc.from_config(cfg).worker_idx == 0  # its path has the shape a receiver takes
        assert len(keyfiles.read_key_file(key_file)) == 2 * keyfiles.KEY_BYTES
    finally:
        sender.shutdown()
    assert not os.path.exists(key_file)
    assert list(ours.iterdir()) == [] and os.lstat(name).st_uid == STRANGER_UID  # the stranger's left alone


def test_a_key_directory_of_ours_with_open_mode_is_not_used(shared_tmp, tripwires):
    """A directory of our own that others may write (made by hand, say) is passed over like a stranger's."""
    from weightsync.transports import keyfiles

    name = shared_tmp / f"weightsync-{os.getuid()}"
    name.mkdir()
    name.chmod(0o777)
    directory = keyfiles.key_dir()
    assert Path(directory) != name and stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
    path = keyfiles.write_key_file("@weightsync-1-0123456789abcdef", b"\x01" * keyfiles.KEY_BYTES)
    assert os.path.dirname(path) == directory and list(name.iterdir()) == []
    keyfiles.remove_key_file(path)


@pytest.mark.parametrize("name", ["DistributedWeightSyncScheme", "RPCWeightSyncScheme"])
def test_a_config_at_the_edge_of_its_bounds_ends_in_a_weightsync_error_at_connect(name, shared_tmp, tripwires):
    """Values that pass every check of the config alone but fit no run (a worker index past the world, the largest
    world, the largest counter, a 63-character label no resolver knows) end in a weightsync error within
    connect_timeout, or at init_on_receiver."""
    from weightsync.transports import keyfiles

    cfg = _with(SCHEME_CONFIGS[name], "scheme.connect_timeout", 1.0)
    cfg = _with(cfg, "worker_idx", 2**31 - 1)
    cfg = _with(cfg, "connection.world_size", 2**16)
    cfg = _with(cfg, "connection.master_port", 1)  # nothing listens there
    key = None
    if "authkey_file" in cfg["connection"]:
        key = keyfiles.write_key_file(keyfiles.key_name(), os.urandom(keyfiles.KEY_BYTES))
        cfg = _with(cfg, "connection.authkey_file", key)
    if "counter" in cfg["connection"]:
        cfg = _with(cfg, "connection.counter", 2**31 - 1)
    try:
        for host in ("127.0.0.1", "a" * 63 + ".invalid"):
            scheme = wc.from_config(_with(cfg, "connection.master_addr", host), **_OPT_INS)
            start = time.monotonic()
            try:
                with pytest.raises(ws.WeightSyncError):  # (at once where the scheme knows the index is past the world)
                    scheme.init_on_receiver(model=nn.Linear(2, 2))
                    scheme.connect()
            finally:
                scheme.shutdown()
            assert time.monotonic() - start < 1.0 + 5.0
    finally:
        if key is not None:
            keyfiles.remove_key_file(key)
