"""The table of engine options is the one declaration: `LLM`'s signature and docstring and
`EngineConfig`'s fields follow it, and `resolve_options` turns LLM's user-facing values into the
config's (the command line's flags are tested in tests/test_cli.py)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import typing

import pytest

from replayserve import LLM
from replayserve.builtin.tiny import tiny_config
from replayserve.config import (
    DERIVED_FIELDS,
    ENGINE_OPTIONS,
    ConfigError,
    EngineConfig,
    SpeculativeConfig,
    resolve_options,
)

HYBRID = tiny_config()  # Mamba and attention layers
ATTENTION_ONLY = tiny_config("*-*-")
CONFIG_OPTIONS = [o for o in ENGINE_OPTIONS.values() if not o.llm_only]


def _words(text: str) -> str:
    return " ".join(text.split())


def test_llm_takes_exactly_the_engine_options_with_their_defaults_and_types() -> None:
    params = inspect.signature(LLM.__init__).parameters
    assert list(params)[:2] == ["self", "model"]
    assert {name: p.default for name, p in params.items() if name not in ("self", "model")} == {
        o.name: o.default for o in ENGINE_OPTIONS.values()}
    hints = typing.get_type_hints(LLM.__init__)
    assert {name: hints[name] for name in ENGINE_OPTIONS} == {o.name: o.type for o in ENGINE_OPTIONS.values()}


@pytest.mark.parametrize("name", list(ENGINE_OPTIONS))
def test_llm_docstring_gives_each_options_help(name: str) -> None:
    assert f"{name}: {_words(ENGINE_OPTIONS[name].help)}" in _words(LLM.__doc__ or "")


def test_every_engine_config_field_is_an_option_or_derived() -> None:
    fields = [f for f in dataclasses.fields(EngineConfig) if f.name not in DERIVED_FIELDS]
    assert [f.name for f in fields] == [o.name for o in CONFIG_OPTIONS]  # in the table's order
    assert set(DERIVED_FIELDS) <= {f.name for f in dataclasses.fields(EngineConfig)}
    assert {f.name: f.default for f in fields} == {o.name: o.field_default for o in CONFIG_OPTIONS}
    hints = typing.get_type_hints(EngineConfig)
    assert {f.name: hints[f.name] for f in fields} == {o.name: o.field_type for o in CONFIG_OPTIONS}


def test_options_not_given_take_their_defaults_resolved_for_the_cpu() -> None:
    resolved = resolve_options({}, HYBRID, cuda_available=False)
    assert resolved == {**{o.name: o.default for o in CONFIG_OPTIONS},
                        "dtype": "float32", "device": "cpu", "mamba_cache_mode": "none"}
    assert EngineConfig(model=HYBRID, **resolved).max_num_seqs == ENGINE_OPTIONS["max_num_seqs"].default


def test_options_not_resolved_pass_as_given() -> None:
    given = {"max_num_seqs": 3, "block_size": 8, "replay_window": 4, "cpu_threads": 2, "enforce_eager": True}
    resolved = resolve_options(given, HYBRID, cuda_available=False)
    assert {name: resolved[name] for name in given} == given


@pytest.mark.parametrize(("given", "cuda_available", "dtype", "device"), [
    ({}, True, "bfloat16", "cuda"),
    ({"device": "cpu"}, True, "float32", "cpu"),
    ({"device": "cuda:1"}, False, "bfloat16", "cuda:1"),
    ({"dtype": "float16"}, False, "float16", "cpu"),
    ({"dtype": "float64", "device": "cuda"}, True, "float64", "cuda"),
])
def test_auto_dtype_and_device_follow_the_machine(given: dict, cuda_available: bool, dtype: str, device: str) -> None:
    resolved = resolve_options(given, HYBRID, cuda_available)
    assert (resolved["dtype"], resolved["device"]) == (dtype, device)


@pytest.mark.parametrize(("given", "model", "mode"), [
    ({"enable_prefix_caching": True}, HYBRID, "align"),
    ({}, HYBRID, "none"),
    ({"enable_prefix_caching": True}, ATTENTION_ONLY, "none"),
    ({"enable_prefix_caching": True, "mamba_cache_mode": "all"}, HYBRID, "all"),
    ({"mamba_cache_mode": "all"}, HYBRID, "all"),  # EngineConfig names what is wrong with it
])
def test_mamba_cache_mode_follows_prefix_caching_and_the_model(given: dict, model: object, mode: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="replayserve.config.options"):
        assert resolve_options(given, model, cuda_available=False)["mamba_cache_mode"] == mode
    assert ("mamba_cache_mode='align'" in caplog.text) == ("mamba_cache_mode" not in given and mode == "align")


def test_speculative_becomes_a_speculative_config() -> None:
    resolved = resolve_options({"speculative": {"method": "ngram", "num_speculative_tokens": 2}}, HYBRID, False)
    assert resolved["speculative"] == SpeculativeConfig(method="ngram", num_speculative_tokens=2)


@pytest.mark.parametrize(("given", "message"), [
    ({"max_num_seq": 4}, r"unknown engine options \['max_num_seq'\]; known: \['async_scheduling'"),
    ({"speculative": "ngram"}, "engine option speculative: must be a dict of SpeculativeConfig's keys, got 'ngram'"),
    ({"speculative": {"method": "ngram"}}, "speculative needs 'method' and 'num_speculative_tokens'"),
])
def test_refused_options_are_named(given: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_options(given, HYBRID, cuda_available=False)


def test_llm_only_options_stay_out_of_the_config() -> None:
    assert "warmup" not in resolve_options({"warmup": False}, HYBRID, cuda_available=False)

