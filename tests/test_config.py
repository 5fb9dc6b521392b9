"""The Hydra layer: configs mirror their targets, groups compose, receiver configs travel as plain data."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pickle
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize, initialize_config_module
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

import weightsync as ws
from tests._workers import connect_pair
from weightsync import config as wc
from weightsync.app.job import resolve_schemes
from weightsync.config.export import group_yaml

ROOT = Path(__file__).resolve().parent.parent
ALL_CONFIGS = {
    **{f"scheme/{k}": v for k, v in wc.SCHEMES.items()},
    **{f"transport/{k}": v for k, v in wc.TRANSPORTS.items()},
}


def _target(cfg_cls):
    module, _, attr = cfg_cls._target_.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


AVAILABLE = {k: v for k, v in ALL_CONFIGS.items() if _target(v) is not None}
PLANNED = {k: v for k, v in ALL_CONFIGS.items() if _target(v) is None}


def test_every_config_has_its_runtime():
    assert PLANNED == {}, f"configs whose target does not exist: {sorted(PLANNED)}"


def _fields(cfg_cls, leave=("_target_", "_partial_")):
    return {f.name: f.default for f in dataclasses.fields(cfg_cls) if f.name not in leave}


@pytest.mark.parametrize("name", sorted(wc.SCHEMES))
def test_a_scheme_config_and_its_transport_config_mirror_the_constructor(name):
    """Each option once: the scheme's own in its config, its transport's settings in the transport's config;
    together they are the constructor's arguments, with the same defaults."""
    cfg_cls = wc.SCHEMES[name]
    params = {p.name: p.default for p in inspect.signature(_target(cfg_cls)).parameters.values()}
    fields = _fields(cfg_cls, leave=("_target_", "transport"))
    transport = {f.name: f for f in dataclasses.fields(cfg_cls)}.get("transport")
    if transport is not None:
        fields.update(_fields(transport.default_factory))
    fields["transport"] = None
    assert set(fields) == set(params), f"{name}: config {sorted(fields)} vs constructor {sorted(params)}"
    for key, default in params.items():
        assert fields[key] == default, f"{name}.{key}: config default {fields[key]!r} vs {default!r}"


@pytest.mark.parametrize("name", sorted(wc.TRANSPORTS))
def test_a_transport_config_holds_its_settings(name):
    cfg_cls = wc.TRANSPORTS[name]
    settings = {o.name: o.default for o in _target(cfg_cls).OPTIONS}
    assert _fields(cfg_cls) == settings


def test_the_strategy_config_mirrors_its_constructor():
    params = {p.name: p.default for p in inspect.signature(ws.WeightStrategy).parameters.values()}
    assert _fields(wc.WeightStrategyConfig) == params


def test_a_target_missing_from_weightsync_fails_clearly_instead_of_silently():
    target = "weightsync.schemes.teleport.TeleportWeightSyncScheme"
    cfg = {"_target_": wc.receiver.RECEIVER_TARGET, "scheme": {"_target_": target}, "model_id": "policy"}
    cfg.update(worker_idx=0, connection={})
    with pytest.raises(ws.ConfigurationError, match="not a scheme of this version of weightsync"):
        wc.from_config(OmegaConf.create(cfg))
    with pytest.raises(ws.ConfigurationError, match="is not available in this version"):
        wc.receiver.check_available(target)  # the trainer's own config, in the main job
    with pytest.raises(HydraException, match="Error locating target"):
        instantiate(OmegaConf.create({"_target_": target}))


def test_group_yaml_matches_the_dataclasses():
    for rel, text in group_yaml().items():
        assert (ROOT / "conf" / rel).read_text() == text, (
            f"conf/{rel} is stale: python -m weightsync.config.export conf"
        )


@pytest.mark.parametrize("option", sorted(wc.SCHEMES))
def test_every_scheme_option_composes_from_the_config_store(option):
    with initialize(version_base="1.3"):
        cfg = compose(overrides=[f"+weightsync/scheme={option}", "weightsync.scheme.timeout=7.5"])
    node = cfg.weightsync.scheme
    assert node._target_ == wc.SCHEMES[option]._target_ and node.timeout == 7.5
    if f"scheme/{option}" in AVAILABLE:
        scheme = instantiate(node)
        assert isinstance(scheme, ws.WeightSyncScheme) and scheme.timeout == 7.5


@pytest.mark.parametrize(
    "group, option",
    [("transport", t) for t in sorted(wc.TRANSPORTS)] + [("strategy", s) for s in sorted(wc.STRATEGIES)],
)
def test_every_transport_and_strategy_option_composes(group, option):
    with initialize(version_base="1.3"):
        cfg = compose(overrides=[f"+weightsync/{group}={option}"])
    node = cfg.weightsync[group]
    if group == "strategy":
        assert instantiate(node) == ws.WeightStrategy(option)
    else:  # a transport's settings, which its engine takes whole
        built = instantiate(node)
        assert node._target_ == wc.TRANSPORTS[option]._target_ and type(built) is _target(wc.TRANSPORTS[option])
        assert built.option_values() == _fields(wc.TRANSPORTS[option])


@pytest.mark.parametrize(
    "overrides, transport, settings",
    [
        ([], ws.MPTransport, {"max_slots": None}),
        (["weightsync/scheme/transport=shared_mem"], ws.SharedMemTransport, {"max_slots": None}),
        (["weightsync.scheme.transport.max_slots=3"], ws.MPTransport, {"max_slots": 3}),
    ],
)
def test_a_scheme_composes_its_transport_and_the_command_line_swaps_or_tunes_it(overrides, transport, settings):
    with initialize(version_base="1.3"):
        cfg = compose(overrides=["+weightsync/scheme=multiprocess", *overrides])
    scheme = instantiate(cfg.weightsync.scheme)
    assert isinstance(scheme, ws.MultiProcessWeightSyncScheme) and scheme.transport_class is transport
    assert scheme.max_slots == settings["max_slots"]
    with pytest.raises(HydraException):  # a transport of another engine is not this scheme's
        with initialize(version_base="1.3"):
            bad = compose(overrides=["+weightsync/scheme=multiprocess", "weightsync/scheme/transport=rpc"])
        instantiate(bad.weightsync.scheme)


def test_the_vllm_option_serves_engines_over_the_scheme_the_command_line_composes_into_it():
    """``weightsync/scheme=vllm`` is TorchRL's ``VLLMWeightSyncScheme``; its ``scheme`` is one of weightsync's scheme
    group (``shared_mem`` by default), swapped and tuned from the command line. No vLLM is needed to build it (only
    to run engines)."""
    from weightsync.integrations.vllm import VLLMWeightSyncScheme

    extra: list[str] = []
    with initialize(version_base="1.3"):
        default = compose(overrides=[*extra, "+weightsync/scheme=vllm"])
        tuned = compose(
            overrides=[
                *extra,
                "+weightsync/scheme=vllm",
                "weightsync/scheme@weightsync.scheme.scheme=multiprocess",
                "weightsync.scheme.scheme.timeout=7.5",
                "weightsync/scheme/transport@weightsync.scheme.scheme.transport=shared_mem",
                "weightsync.scheme.pause_mode=abort",
                "weightsync.scheme.load_ahead=true",
            ]
        )
    built = instantiate(default.weightsync.scheme)
    assert isinstance(built, VLLMWeightSyncScheme) and built.pause_mode == "keep" and built.load_ahead is False
    assert isinstance(built.scheme, ws.SharedMemWeightSyncScheme)
    built = instantiate(tuned.weightsync.scheme)
    assert isinstance(built.scheme, ws.MultiProcessWeightSyncScheme) and built.pause_mode == "abort"
    assert built.load_ahead is True
    assert built.scheme.timeout == 7.5 and built.scheme.transport_class is ws.SharedMemTransport
    with initialize(version_base="1.3"):
        bad = compose(overrides=[*extra, "+weightsync/scheme=vllm", "weightsync.scheme.pause_mode=later"])
    with pytest.raises(HydraException, match="pause_mode must be one of"):
        instantiate(bad.weightsync.scheme)


def test_torchrl_s_group_has_the_vllm_scheme_too():
    with initialize(version_base="1.3"):
        cfg = compose(overrides=["+weight_sync_scheme@sync=weightsync_vllm"])
    assert cfg.sync._target_ == "weightsync.integrations.vllm.VLLMWeightSyncScheme"
    assert cfg.sync.scheme._target_ == "weightsync.SharedMemWeightSyncScheme"


def test_top_level_from_config_is_the_hydra_layer_one():
    assert ws.from_config is wc.from_config


def test_groups_resolve_through_a_pkg_search_path_without_the_config_store():
    with initialize(version_base="1.3"):
        cfg = compose(overrides=["hydra.searchpath=[pkg://weightsync.conf]", "+weightsync/strategy=state_dict"])
    assert instantiate(cfg.weightsync.strategy) == ws.WeightStrategy("state_dict")


_YAML_ONLY = """
import sys

from hydra import compose, initialize
from hydra.utils import instantiate

search = "hydra.searchpath=[pkg://weightsync.conf]"
with initialize(version_base="1.3"):
    if sys.argv[1] == "both":
        import weightsync.config  # noqa: F401 - registers the ConfigStore entries of the same names
    try:
        cfg = compose(overrides=[search, "+weightsync/scheme=multiprocess", "weightsync/scheme/transport=shared_mem",
                                 "weightsync.scheme.timeout=5"])
        scheme = instantiate(cfg.weightsync.scheme)
        print(type(scheme).__name__, type(scheme.settings).__name__, scheme.timeout)
        cfg = compose(overrides=[search, "+weightsync/scheme=multiprocess", "weightsync.scheme.sync=maybe"])
        instantiate(cfg.weightsync.scheme)
    except Exception as exc:
        print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize("registered", ["yaml", "both"])
def test_the_scheme_groups_compose_from_the_packaged_yaml_alone_and_not_with_the_config_store_too(registered):
    """The groups as YAML on a ``pkg://weightsync.conf`` search path compose (a scheme, its transport chosen, an
    option set), and a wrong value is refused by the scheme as it is built: Hydra checks no types there. With the
    ConfigStore registered too, Hydra 1.3 refuses the scheme groups, as docs/hydra.md says (it said a warning)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", _YAML_ONLY, registered], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    ).stdout
    if registered == "yaml":
        assert out.splitlines()[0] == "MultiProcessWeightSyncScheme SharedMemSettings 5.0", out
        assert "sync must be true or false, got 'maybe'" in out, out
    else:
        assert "ConfigCompositionException" in out and "no longer supported" in out, out


def _main(overrides):
    import weightsync.app.main  # noqa: F401 - registers the job schema and the `scheme` group

    with initialize_config_module(version_base="1.3", config_module="weightsync.conf"):
        return compose(config_name="config", overrides=overrides)


def test_main_config_overrides():
    cfg = _main([])
    assert cfg.num_workers == 2 and set(cfg.models) == {"policy", "value"}
    assert {m: c._target_ for m, c in resolve_schemes(cfg).items()} == {
        "policy": "weightsync.MultiProcessWeightSyncScheme",
        "value": "weightsync.MultiProcessWeightSyncScheme",
    }

    cfg = _main(["scheme=shared_mem", "scheme.sync=false", "scheme.per_worker_weights=true"])
    for node in resolve_schemes(cfg).values():
        assert node._target_ == "weightsync.SharedMemWeightSyncScheme" and node.sync is False
        assert node.per_worker_weights is True  # a subclass's own field survives the slot

    cfg = _main(["schemes.policy=shared_mem", "schemes.value=no_sync", "num_workers=4"])
    resolved = resolve_schemes(cfg)
    assert resolved["policy"]._target_.endswith("SharedMemWeightSyncScheme")
    assert resolved["value"]._target_.endswith("NoWeightSyncScheme") and cfg.num_workers == 4

    with pytest.raises(ws.ConfigurationError, match="schemes.value='pigeon': unknown scheme"):
        resolve_schemes(_main(["schemes.value=pigeon"]))


def test_a_model_is_added_from_the_command_line_with_the_defaults_of_the_fields_it_leaves_out():
    """``'+models.critic={...}'`` failed in omegaconf ("dict is not a subclass of ModelSpec"), as did
    ``+models.critic.size_mb=1``: a model could only be added in a YAML file of one's own."""
    from weightsync.app.models import model_specs

    for added in (["+models.critic={size_mb:1,tensors:2}"], ["+models.critic.size_mb=1", "+models.critic.tensors=2"]):
        cfg = _main([*added, "+schemes.critic=shared_mem"])
        assert resolve_schemes(cfg)["critic"]._target_ == "weightsync.SharedMemWeightSyncScheme"
        assert model_specs(cfg.models)["critic"] == {"size_mb": 1.0, "tensors": 2}
    cfg = _main(["+models.critic.size_mb=1", "+schemes.critic=${scheme}"])
    assert model_specs(cfg.models)["critic"] == {"size_mb": 1.0, "tensors": 4}  # (ModelSpec's default)
    cfg = _main(["models.value.size_mb=${models.policy.size_mb}"])  # (a value that names another key)
    assert model_specs(cfg.models)["value"] == {"size_mb": 16.0, "tensors": 4}


@pytest.mark.parametrize("override", ["scheme=pigeon", "num_workers=many", "scheme.timeout=soon", "scheme.colour=red"])
def test_bad_overrides_fail_in_hydra(override):
    with pytest.raises(HydraException):
        _main([override])


def test_a_config_composed_from_the_groups_pickles():
    """A composed scheme's node was of a class made at run time (``types.MultiProcessSchemeConfig``): a config
    holding it could not be handed to a spawned process (a Hydra user's audit)."""
    with initialize(version_base="1.3"):
        composed = {name: compose(overrides=[f"+weightsync/scheme={name}"]) for name in [*wc.SCHEMES, "vllm"]}
    for name, cfg in composed.items():
        assert pickle.loads(pickle.dumps(cfg)) == cfg, name


@pytest.mark.parametrize(
    "override, named",
    [
        ("worker_timeout=-1", "worker_timeout must be a positive number of seconds"),
        ("worker_timeout=1e12", "worker_timeout must be"),
        ("models.policy.size_mb=nan", r"models.policy.size_mb must be in \(0, 1e\+06\], got nan"),
        ("models.value.size_mb=inf", "models.value.size_mb must be"),
        ("seed=99999999999999999999", r"seed must be in \[0, 2\*\*63\)"),
        ("changed=0", r"changed \(the fraction of values a round changes\) must be in \(0, 1\], got 0.0"),
        ("changed=nan", r"changed .* must be in \(0, 1\], got nan"),
        # Each names the override the user typed (it named schemes.policy, and a transport by its class), and the
        # opt-in that applies to it (scheme.allow_... for a model whose scheme was picked by name, which cannot work).
        ("scheme.timeout=-1", "^scheme: timeout must be a positive number of seconds"),
        ("models.policy.size_mb=0.01 models.policy.tensors=20000", "cannot be split into 20000 tensors"),
        ("models.policy.size_mb=abc", "^models.policy.size_mb: Value 'abc' of type 'str' could not be converted"),
        ("models.policy=???", "^models.policy: Missing mandatory value"),
        ("schemes.policy=${schemes.value} scheme.timeout=-1", "^scheme: timeout must be"),  # (it follows scheme)
        ("+models.critic={sizemb:1} +schemes.critic=shared_mem", "^models.critic has no field 'sizemb'; a model"),
        ("scheme=shared_mem scheme.transport.max_slots=1", "^scheme.transport: max_slots must be an int"),
        ("scheme/transport=distributed", r"^scheme: .* over the transports \['mp', 'shared_mem'\], got 'distributed'"),
        ("scheme=rpc", "^scheme: the rpc scheme .* give scheme.allow_store_peers_to_run_code=true only if"),
        (
            "schemes.value=rpc",
            "^schemes.value: the rpc scheme .* give 'schemes.value={_target_:weightsync.RPCWeightSyncScheme,"
            "allow_store_peers_to_run_code:true}' only if .* or use schemes.value=distributed$",
        ),
        (
            "schemes.value={_target_:weightsync.RPCWeightSyncScheme}",
            r"^schemes.value: the rpc scheme .* give \+\+schemes.value.allow_store_peers_to_run_code=true only if",
        ),
        (
            "schemes.value={_target_:weightsync.MultiProcessWeightSyncScheme,timeout:-1}",
            "schemes.value: timeout must be a positive number of seconds",
        ),
        # (a traceback from the job, which took it for a scheme: a Hydra user's audit)
        (
            "schemes.value={_target_:weightsync.WeightStrategy}",
            "^schemes.value: weightsync.WeightStrategy builds a WeightStrategy, not a weight-sync scheme",
        ),
        # (named the model, not the override: the check is the engine's own, as the scheme starts)
        ("scheme=distributed scheme.transport.backend=nccl", "^scheme: backend='nccl' needs CUDA"),
    ],
)
def test_the_jobs_own_bad_values_fail_by_name_before_a_worker_starts(override, named, monkeypatch):
    # (each was a traceback, or a failure once workers ran: an overflow past the round, a -1 s wait for them)
    import weightsync.app.job as job

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker started")

    monkeypatch.setattr(job, "_Collector", no_workers)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (nccl's case, on a host with a GPU too)
    with pytest.raises(ws.ConfigurationError, match=named):
        job.run_job(_main(["rounds=1", "num_workers=1", *override.split()]))


def test_the_jobs_rounds_change_the_fraction_of_values_asked_and_leave_the_others_bits():
    """``changed=0.01``: a round changes about 1% of the values (a scheme with ``delta=auto`` then sends changes);
    before the option, every round changed every value, and no version of the main job went as changes."""
    from weightsync.app.job import _perturb

    model = nn.Linear(1000, 100)
    before = model.weight.detach().clone()
    _perturb(model, torch.Generator().manual_seed(0), 0.01)
    same = model.weight.detach().view(torch.int32) == before.view(torch.int32)
    assert 0.005 < 1 - same.float().mean().item() < 0.02
    _perturb(model, torch.Generator().manual_seed(0))
    assert not torch.equal(model.weight, before)


def test_receiver_config_is_plain_and_secret_free():
    scheme = ws.SharedMemWeightSyncScheme(timeout=5, per_worker_weights=True)
    with pytest.raises(ws.LifecycleError):
        scheme.receiver_config(0)
    scheme.init_on_sender(model_id="policy", model=nn.Linear(3, 3), num_workers=2)
    cfg = scheme.receiver_config(1)
    text = yaml.safe_dump(cfg)  # plain data: the strictest YAML dumper accepts it
    assert yaml.safe_load(text) == cfg
    authkey = pickle.loads(pickle.dumps(scheme))._handoff["authkey"]  # what a pickled scheme carries
    assert authkey not in text and "authkey:" not in text
    key_file = cfg["connection"]["authkey_file"]
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert cfg["scheme"]["per_worker_weights"] is True and cfg["worker_idx"] == 1
    with pytest.raises(ws.ConfigurationError, match="out of range"):
        scheme.receiver_config(2)
    scheme.shutdown()
    assert not os.path.exists(key_file), "the key file outlived the sender"


def test_receiver_config_round_trip_in_the_same_process():
    scheme = ws.MultiProcessWeightSyncScheme(timeout=10)
    model = nn.Linear(3, 3)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    receiver = wc.from_config(OmegaConf.to_yaml(OmegaConf.create(scheme.receiver_config(0))))
    replica = nn.Linear(3, 3)
    receiver.init_on_receiver(model=replica)
    connect_pair(scheme, receiver)
    assert receiver.model_id == "policy" and receiver.worker_idx == 0 and receiver.version == 0
    assert (replica.weight == model.weight).all()
    receiver.shutdown()
    scheme.shutdown()


WORKER_BY_HAND = """
import sys, hashlib, torch, weightsync.config as wc
from pathlib import Path
from torch import nn
scheme = wc.from_config(Path(sys.argv[1]))  # the documented road: weightsync reads the file, strictly
model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
scheme.init_on_receiver(model=model)
scheme.connect()
while scheme.version < 1:
    scheme.receive(timeout=30)
print(scheme.version, float(sum(p.double().sum() for p in model.parameters())), flush=True)
scheme.shutdown()
"""


def test_receiver_config_through_yaml_into_a_process_started_by_hand(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    scheme = ws.SharedMemWeightSyncScheme(timeout=30, connect_timeout=60)
    scheme.init_on_sender(model_id="policy", model=model, num_workers=1)
    cfg_file = tmp_path / "receiver.yaml"
    cfg_file.write_text(OmegaConf.to_yaml(OmegaConf.create(scheme.receiver_config(0))))
    script = tmp_path / "worker.py"
    script.write_text(WORKER_BY_HAND)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(  # the checkout under test, not whichever weightsync is installed
        [sys.executable, str(script), str(cfg_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        scheme.connect()
        for p in model.parameters():
            p.data.add_(1.0)
        scheme.send()
        out, err = proc.communicate(timeout=60)
    finally:
        scheme.shutdown()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    version, total = out.split()
    assert int(version) == 1
    assert float(total) == pytest.approx(float(sum(p.double().sum() for p in model.parameters())), rel=1e-12)


def test_a_scheme_given_its_transports_config_uninstantiated_says_so():
    """``instantiate(cfg, _recursive_=False)`` hands the transport's config over as it is: the scheme said the
    transport, its own, was not one it runs over (a Hydra user's audit)."""
    with pytest.raises(ws.ConfigurationError, match=r"given its transport's config uninstantiated .*_recursive_=False"):
        ws.MultiProcessWeightSyncScheme(transport={"_target_": "weightsync.MPSettings", "max_slots": None})
    with pytest.raises(ws.ConfigurationError, match=r"runs over the transports \['mp', 'shared_mem'\]"):
        ws.MultiProcessWeightSyncScheme(transport={"_target_": "weightsync.RaySettings"})
