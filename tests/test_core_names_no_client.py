"""The core names no client: what TorchRL's collectors (and the inference engines to come) need of a scheme is
asked through a driver (weightsync/core/drivers.py), and their knowledge lives in weightsync/integrations/. A
driver of a program no integration knows is asked the same way."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import weightsync as ws
from weightsync import registry
from weightsync.core.drivers import Drive, Driver

CORE = Path(ws.__file__).parent / "core"
CLIENT_NAMES = re.compile(r"torchrl|collector", re.IGNORECASE)


def test_the_core_names_no_client_in_code_comments_or_docstrings():
    found = [
        f"{path.relative_to(CORE.parent)}:{number}: {line.strip()}"
        for path in sorted(CORE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if CLIENT_NAMES.search(line)
    ]
    assert not found, "the core names a client (its knowledge belongs in weightsync/integrations/):\n" + "\n".join(
        found
    )


def test_the_core_imports_no_integration_and_a_context_loads_no_client_library():
    """The core finds integrations through the registry, on the first scheme given a context; recognizing a
    context imports no client library."""
    probe = """
import sys, json, torch
import weightsync
scheme = weightsync.MultiProcessWeightSyncScheme()
before = sorted(m for m in sys.modules if m.startswith("weightsync.integrations"))
class Holder:
    policy = torch.nn.Linear(2, 2)
    num_workers = 1
scheme.init_on_sender("policy", context=Holder())
after = sorted(m for m in sys.modules if m.startswith("weightsync.integrations"))
scheme.shutdown()
print(json.dumps([before, after, "torchrl" in sys.modules]))
"""
    import json

    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    before, after, torchrl_loaded = json.loads(out.stdout.splitlines()[-1])
    assert before == []
    assert "weightsync.integrations.torchrl" in after
    assert not torchrl_loaded


class Program:
    """A program that drives schemes itself, and none of the integrations' (it counts its workers from 1)."""

    def __init__(self) -> None:
        self.policy = torch.nn.Linear(2, 2)


@pytest.fixture
def program_driver():
    class ProgramDriver(Driver, name="test-program"):
        sender_extras = ("pool",)

        def drives(self, context):
            return isinstance(context, Program)

        def num_workers(self, context):
            return 2

        def terms(self, context):
            return Drive(self.name, index_base=1)

    yield ProgramDriver
    registry._drivers.pop("test-program", None)


def test_a_driver_answers_for_its_program_and_its_terms_reach_the_workers(program_driver):
    program = Program()
    scheme = ws.MultiProcessWeightSyncScheme(timeout=5)
    scheme.init_on_sender("policy", context=program, pool=object())  # the program's own argument is taken
    try:
        assert scheme.model is program.policy and scheme.num_workers == 2
        worker = pickle.loads(pickle.dumps(scheme))
        worker.init_on_receiver(model=torch.nn.Linear(2, 2), worker_idx=2)  # the program's second worker
        assert worker.worker_idx == 1 and not worker._applies_itself
        worker.shutdown()
    finally:
        scheme.shutdown()


def test_a_driver_must_say_which_contexts_it_drives():
    with pytest.raises(TypeError, match="must say which contexts it drives"):

        class Mute(Driver, name="test-mute"):
            pass

    assert "test-mute" not in registry.drivers()


@pytest.fixture
def passing_on_driver():
    class PassingOn(Driver, name="test-passing-on"):
        failing: int | None = None  # the version whose passing-on fails

        def drives(self, context):
            return isinstance(context, Program)

        def num_workers(self, context):
            return 1

        def terms(self, context):
            return Drive(self.name, applies_itself=True)

        def applied(self, scheme):
            if scheme.version == self.failing:
                raise RuntimeError("the program's own workers did not take it")

    yield PassingOn
    registry._drivers.pop("test-passing-on", None)


def test_a_program_that_fails_to_pass_an_applied_update_on_is_named_for_that_and_the_version_is_held(
    passing_on_driver,
):
    """A driver's ``applied()`` runs before the ack, to pass the update on (TorchRL's collectors in a Ray actor);
    its failure came back as the worker's failure to apply, while the worker held the version."""
    program = Program()
    scheme = ws.MultiProcessWeightSyncScheme(timeout=10)
    scheme.init_on_sender("policy", context=program)
    worker = pickle.loads(pickle.dumps(scheme))
    held = torch.nn.Linear(2, 2)
    worker.init_on_receiver(model=held, worker_idx=0)
    try:
        joining = threading.Thread(target=worker.connect)
        joining.start()
        scheme.connect()
        joining.join(30)
        registry.drivers()["test-passing-on"].failing = 1
        with torch.no_grad():
            program.policy.weight.add_(1.0)
        with pytest.raises(ws.ReceiverError) as raised:
            scheme.send()
        assert raised.value.remote_type == "PassOnError" and raised.value.detail.startswith(
            "receiver: version 1 was applied here, then passing it on failed: RuntimeError: the program's own"
        )
        assert scheme.acked_versions == {0: 1} and torch.equal(held.weight, program.policy.weight)
    finally:
        worker.shutdown()
        scheme.shutdown()
