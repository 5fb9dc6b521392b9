"""Constructor signatures that tools see: every option of every registered scheme and transport's settings is a
typed parameter of its ``__init__``, and the typed line in the class body agrees with the option's declaration."""

from __future__ import annotations

import inspect
from typing import Optional, Union, get_args, get_origin

import pytest

import weightsync as ws
from weightsync import registry
from weightsync.options import Declared
from weightsync.tensors.strategy import WeightStrategy

CLASSES = {
    **{name: ws.get_backend(name) for name in registry.schemes()},
    **{f"transport:{name}": cls for name, cls in registry.transports().items()},
}


def _declared(cls: type) -> dict[str, object]:
    """The typed lines of ``cls`` and its bases (a subclass's win), evaluated."""
    out: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if issubclass(klass, Declared) and klass is not Declared:
            out.update(inspect.get_annotations(klass, eval_str=True))
    return out


def _same(declared: object, option: object) -> bool:
    if get_origin(declared) in (Union, type(int | None)) or get_origin(option) is Union:
        return set(get_args(declared)) == set(get_args(option))
    return declared == option


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_the_constructor_lists_every_option_with_its_type_and_default(name):
    cls = CLASSES[name]
    params = inspect.signature(cls.__init__).parameters
    assert list(params)[0] == "self"
    options = {o.name: o for o in cls.OPTIONS}
    assert set(options) <= set(params), f"{name}: missing {sorted(set(options) - set(params))}"
    assert set(params) - set(options) <= {"self", "transport"}
    for key, option in options.items():
        assert params[key].default == option.default and params[key].annotation == option.annotation, key
    assert inspect.signature(cls).parameters.keys() == params.keys() - {"self"}


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_option_has_one_typed_line_that_agrees_with_its_declaration(name):
    cls = CLASSES[name]
    declared = _declared(cls)
    for option in cls.OPTIONS:
        assert option.name in declared, f"{name}.{option.name} has no typed line in its class body"
        expected = Optional[WeightStrategy | str] if option.name == "strategy" else option.annotation  # noqa: UP045
        if option.name == "strategy":
            assert set(get_args(declared["strategy"])) == {str, WeightStrategy}
            continue
        assert _same(declared[option.name], expected), f"{name}.{option.name}: {declared[option.name]} vs {expected}"


def test_the_first_four_options_are_positional_the_others_keyword_only():
    params = list(inspect.signature(ws.DistributedWeightSyncScheme).parameters.values())
    assert [p.name for p in params[:4]] == ["strategy", "sync", "timeout", "connect_timeout"]
    assert {p.kind for p in params[:4]} == {inspect.Parameter.POSITIONAL_OR_KEYWORD}
    assert {p.kind for p in params[4:]} == {inspect.Parameter.KEYWORD_ONLY}
    scheme = ws.MultiProcessWeightSyncScheme("state_dict", False, 5.0, 9.0, max_slots=3)
    assert (scheme.strategy.extract_as, scheme.sync, scheme.timeout, scheme.connect_timeout) == (
        "state_dict",
        False,
        5.0,
        9.0,
    )
    assert scheme.settings == ws.MPSettings(max_slots=3) and scheme.max_slots == 3
    with pytest.raises(TypeError):
        ws.MultiProcessWeightSyncScheme("state_dict", False, 5.0, 9.0, "raise")


def test_an_option_refused_is_named_and_settings_are_immutable():
    with pytest.raises(ws.ConfigurationError, match="bucket_mb"):
        ws.DistributedWeightSyncScheme(bucket_mb=-1)
    settings = ws.DistributedSettings(bucket_mb=4)
    with pytest.raises(AttributeError, match="immutable"):
        settings.bucket_mb = 8  # type: ignore[misc]
    assert settings.replace(bucket_mb=8).bucket_mb == 8 and settings.bucket_bytes == 4_000_000
    scheme = ws.DistributedWeightSyncScheme(transport=settings, bucket_mb=4.0)  # the same value twice is one value
    assert scheme.settings == settings and scheme.transport_name == "distributed"
    with pytest.raises(ws.ConfigurationError, match="given twice"):
        ws.DistributedWeightSyncScheme(transport=settings, bucket_mb=2)


@pytest.mark.parametrize("name", sorted(n for n, cls in CLASSES.items() if "track_writes" in cls.option_names()))
def test_an_option_that_does_nothing_without_another_is_warned_about_not_refused(name, caplog):
    # track_writes without delta did nothing, silently; refused, it would end a sweep's runs that turn delta off.
    cls = CLASSES[name]
    with caplog.at_level("WARNING", logger="weightsync.options"):
        scheme = cls(track_writes=True)
    assert scheme.track_writes and "track_writes=True does nothing while delta is off" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="weightsync.options"):
        cls(track_writes=True, delta="auto"), cls(delta=True)
    assert not caplog.records


def test_a_constructor_written_in_the_class_body_is_kept():
    class Wrapped(ws.MultiProcessWeightSyncScheme):
        def __init__(self, label: str, **kwargs) -> None:
            self.label = label
            super().__init__(**kwargs)

    scheme = Wrapped("mine", timeout=7.0)
    assert scheme.label == "mine" and scheme.timeout == 7.0
    assert list(inspect.signature(Wrapped).parameters) == ["label", "kwargs"]
