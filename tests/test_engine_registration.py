"""What another package registers cannot stand in for weightsync's own, and one package's fault breaks no other
engine (docs/design.md, "Adding an engine"; found by an engine author's audit).

Each case runs in a fresh Python (this process's registry stays as it is), with small packages written here and
installed the way pip leaves them: the package beside a ``.dist-info`` naming its entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import weightsync as ws

WEIGHTSYNC_ROOT = Path(ws.__file__).resolve().parent.parent

PACKAGES = {
    # A variant of a built-in under the built-in's class name: weightsync.MultiProcessWeightSyncScheme, and so
    # every config and receiver config that names it, built this class instead (the audit's case).
    "wsclash": (
        "from weightsync.schemes import multiprocess\n\n"
        "class MultiProcessWeightSyncScheme(multiprocess.MultiProcessWeightSyncScheme, name='mp_clash'):\n"
        "    'A variant under the same name.'\n"
    ),
    # A class defined without name=: its entry point names it, as docs/design.md says (import weightsync.config
    # raised KeyError).
    "wsplain": (
        "from weightsync.schemes.multiprocess import MultiProcessWeightSyncScheme\n\n"
        "class PlainScheme(MultiProcessWeightSyncScheme):\n"
        "    'Registered by its entry point.'\n"
    ),
    # A package whose transport registers, then whose scheme fails (a built-in's name): nothing of it may stay.
    "wsloser": (
        "from weightsync.core.scheme import WeightSyncScheme\n"
        "from weightsync.core.settings import TransportSettings\n\n"
        "class LoserSettings(TransportSettings, name='loser'):\n"
        "    'Registers first.'\n\n"
        "class LoserScheme(WeightSyncScheme, name='shared_mem'):\n"
        "    'Then fails.'\n"
    ),
    # Classes whose configs' names are weightsync's own configs' (MP -> MPTransportConfig): the configs were
    # replaced, and the vllm group built this package's class (a review of the fix above).
    "wsconfig": (
        "from weightsync.core.scheme import WeightSyncScheme\n"
        "from weightsync.core.settings import TransportSettings\n\n"
        "class MP(TransportSettings, name='mp_again'):\n"
        "    'A transport whose config would be MPTransportConfig.'\n\n"
        "class Sneaky(WeightSyncScheme, name='sneaky', config='VLLMWeightSyncSchemeConfig'):\n"
        "    'A scheme whose config would be the one of the vllm group.'\n"
    ),
    # Imported by a user before anything asked the registry, taking a built-in's backend name.
    "wsearly": (
        "from weightsync.core.scheme import WeightSyncScheme\n\n"
        "class EarlyScheme(WeightSyncScheme, name='distributed'):\n"
        "    'Defined before the engines were loaded.'\n"
    ),
    # A module whose import shows: registered by "module:Class", it is imported only where it is asked for.
    "wsheavy": (
        "import sys\nfrom weightsync.schemes.no_sync import NoWeightSyncScheme\n\n"
        "class HeavyScheme(NoWeightSyncScheme):\n"
        "    'Lazy.'\n"
    ),
}
ENTRY_POINTS = {
    "wsclash": "mp_clash = wsclash",
    "wsplain": "plain = wsplain:PlainScheme",
    "wsloser": "loser = wsloser",
    "wsconfig": "sneaky = wsconfig",
}


def _site(root: Path, names: list[str]) -> Path:
    site = root / "site"
    site.mkdir()
    for name in names:
        (site / f"{name}.py").write_text(PACKAGES[name])
        if name in ENTRY_POINTS:
            info = site / f"{name}-0.1.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
            (info / "entry_points.txt").write_text(f"[weightsync.backends]\n{ENTRY_POINTS[name]}\n")
    return site


def _run(code: str, site: Path) -> dict:
    """Run ``code`` in a fresh Python with ``site`` on its path; it prints one JSON line last."""
    path = os.pathsep.join(map(str, (site, WEIGHTSYNC_ROOT)))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=site,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


def test_installed_packages_stand_in_for_no_builtin_and_a_broken_one_leaves_nothing(tmp_path):
    facts = _run(
        """
        import json, logging
        logging.basicConfig(level=logging.WARNING)
        import weightsync as ws
        from weightsync import registry
        ws.register_backend("gone", "no_such_engine_pkg.scheme:GoneScheme")  # (an engine not installed here)
        import hydra.utils, weightsync.config as wsc
        from weightsync.config.receiver import scheme_class
        from weightsync.schemes import multiprocess
        class MultiProcessWeightSyncScheme(multiprocess.MultiProcessWeightSyncScheme):
            "A variant under the built-in's name, registered by hand under another."
        ws.register_backend("twin", MultiProcessWeightSyncScheme)
        mp = wsc.SCHEMES["multiprocess"]()
        print(json.dumps({
            "backends": ws.available_backends(),
            "public": ws.MultiProcessWeightSyncScheme.__module__,
            "hydra": type(hydra.utils.instantiate(mp)).__module__,
            "target": scheme_class("weightsync.MultiProcessWeightSyncScheme", []).__module__,
            "plain": [wsc.SCHEMES["plain"]._target_, type(hydra.utils.instantiate(wsc.SCHEMES["plain"]())).__name__],
            "loser": ["loser" in registry.transports(), "LoserSettings" in registry.public_names()],
            "gone": "gone" in wsc.SCHEMES,
            "configs": [wsc.VLLMWeightSyncSchemeConfig._target_, wsc.MPTransportConfig._target_],
        }))
        """,
        _site(tmp_path, ["wsclash", "wsplain", "wsloser", "wsconfig"]),
    )
    assert facts["public"] == facts["hydra"] == facts["target"] == "weightsync.schemes.multiprocess", facts
    assert "weightsync.MultiProcessWeightSyncScheme is weightsync.schemes.multiprocess" in facts["stderr"]
    assert "mp_clash" not in facts["backends"] and {"plain", "twin", "gone"} <= set(facts["backends"])
    assert facts["plain"] == ["wsplain.PlainScheme", "PlainScheme"]
    assert facts["loser"] == [False, False], "the broken package's transport stayed registered"
    assert not facts["gone"] and "no config for backend 'gone'" in facts["stderr"]
    assert facts["configs"] == ["weightsync.integrations.vllm.VLLMWeightSyncScheme", "weightsync.MPSettings"]
    assert "config name 'MPTransportConfig' is taken" in facts["stderr"]


def test_a_class_defined_before_the_engines_load_meets_their_names(tmp_path):
    facts = _run(
        """
        import json, sys
        import weightsync as ws
        try:
            import wsearly
            early = None
        except ws.ConfigurationError as exc:
            early = str(exc)
        ws.register_backend("heavy", "wsheavy:HeavyScheme")
        from weightsync.config import from_config  # (the configs are made here: "heavy" among them)
        del sys.modules["wsheavy"]
        cfg = {"_target_": "weightsync.config.make_receiver", "model_id": "policy", "worker_idx": 0,
               "scheme": {"_target_": "weightsync.NoWeightSyncScheme"}, "connection": {}}
        from_config(cfg)
        print(json.dumps({
            "early": early,
            "backends": ws.available_backends(),
            "distributed": ws.get_backend("distributed").__module__,
            "heavy_imported": "wsheavy" in sys.modules,
        }))
        """,
        _site(tmp_path, ["wsearly", "wsheavy"]),
    )
    assert facts["early"] is not None and "backend 'distributed' is already registered" in facts["early"], facts
    assert facts["distributed"] == "weightsync.schemes.distributed"
    assert {"distributed", "multiprocess", "shared_mem", "rpc", "ray", "heavy"} <= set(facts["backends"])
    assert not facts["heavy_imported"], "checking a receiver config imported every registered engine"


def test_a_receiver_opt_in_from_config_cannot_take_is_refused_where_the_class_is_defined():
    with pytest.raises(ws.ConfigurationError, match="RECEIVER_OPT_IN is 'allow_unsafe_peer': from_config takes"):

        class Unsafe(ws.NoWeightSyncScheme):  # (no name=: nothing registers)
            RECEIVER_OPT_IN = "allow_unsafe_peer"
