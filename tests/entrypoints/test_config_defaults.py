"""Every engine setting has one default, its config dataclass field's (engine/config.py): the
command line (every subcommand that takes the engine's options), `build_engine_config` and
`LLM(...)` all build the same configuration when nothing is given, so no default can drift from
the others again. Configurations are compared; no model is loaded."""

from __future__ import annotations

import argparse
import inspect
import re

import pytest

from engine.config import EngineConfig, ModelConfig, build_engine_config
from engine.entrypoints.cli import build_parser
from engine.entrypoints.engine_args import add_engine_args, engine_kwargs

MODEL = "/no/model/needed"
# Each subcommand taking the engine's options, with the least it needs to parse.
SUBCOMMANDS = {"generate": ["generate", "hi"], "serve": ["serve"], "calibrate": ["calibrate"]}
# build_engine_config's settings the command line does not offer: torchrun sets it.
NOT_ON_THE_COMMAND_LINE = {"distributed_executor"}


def _cli_defaults(argv: list[str]) -> dict:
    kwargs = engine_kwargs(build_parser().parse_args(argv))
    assert kwargs.pop("model") is None  # None: the default model, resolved at startup
    return kwargs


def _signature_defaults() -> dict:
    parameters = inspect.signature(build_engine_config).parameters
    return {name: p.default for name, p in parameters.items() if name != "model"}


@pytest.mark.parametrize("subcommand", SUBCOMMANDS)
def test_every_cli_default_is_build_engine_configs(subcommand) -> None:
    cli = _cli_defaults(SUBCOMMANDS[subcommand])
    defaults = _signature_defaults()
    # Every setting reaches the command line, and the command line sets nothing else.
    assert set(cli) == set(defaults) - NOT_ON_THE_COMMAND_LINE
    # One by one, so that a drift names its setting.
    drifted = {name: (value, defaults[name]) for name, value in cli.items()
               if value != defaults[name] or type(value) is not type(defaults[name])}
    assert not drifted, f"CLI default != build_engine_config default: {drifted}"
    assert build_engine_config(MODEL, **cli) == build_engine_config(MODEL)


def test_build_engine_config_defaults_are_the_dataclasses() -> None:
    assert build_engine_config(MODEL) == EngineConfig(model=ModelConfig(model=MODEL))


def test_llm_builds_the_same_config(monkeypatch) -> None:
    import engine.entrypoints.llm as llm

    built: list[EngineConfig] = []

    class NoEngine:
        def __init__(self, config: EngineConfig) -> None:
            built.append(config)

    class NoInputs:
        tokenizer = None

        @classmethod
        def for_model(cls, model_config: ModelConfig) -> NoInputs:
            return cls()

    monkeypatch.setattr(llm, "EngineCore", NoEngine)
    monkeypatch.setattr(llm, "InputProcessor", NoInputs)
    llm.LLM(MODEL)
    llm.LLM(MODEL, **_cli_defaults(SUBCOMMANDS["generate"]))
    assert built == [build_engine_config(MODEL)] * 2


def test_help_prints_the_real_defaults(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    # A choice a help text marks "(default)" is the option's default.
    marked = {action.dest: word for action in parser._actions
              for word in re.findall(r"(\S+) \(default\)", action.help or "")}
    assert marked.keys() >= {"device", "fused_ops", "scheduling_policy"}
    for dest, word in marked.items():
        assert word == parser.get_default(dest), dest
    parser.print_help()
    text = " ".join(capsys.readouterr().out.split())
    config = build_engine_config(MODEL)
    assert f"Default {config.model.max_cudagraph_capture_size}" in text
    assert f"default {EngineConfig.tensor_parallel_size};" in text


def test_bench_engine_options_default_to_the_config() -> None:
    args = build_parser().parse_args(["bench", "run"])
    model = ModelConfig.__dataclass_fields__
    for name in ("dtype", "device", "load_format", "max_model_len"):
        assert getattr(args, name) == model[name].default, name
    assert args.num_kv_blocks == build_engine_config(MODEL).cache.num_blocks


def test_serve_shutdown_defaults_are_the_config() -> None:
    """--shutdown-mode and --shutdown-timeout default to ShutdownConfig's fields, which is
    what ServerSettings (the server's, and a fleet replica's) holds when given nothing."""
    from engine.config import ShutdownConfig
    from engine.serving.api_server import ServerSettings

    args = build_parser().parse_args(["serve"])
    cli = ShutdownConfig(mode=args.shutdown_mode, timeout_s=args.shutdown_timeout)
    assert cli == ShutdownConfig() == ServerSettings(served_model_name="m").shutdown
    assert type(args.shutdown_timeout) is float
    with pytest.raises(ValueError, match="abort or wait"):
        ShutdownConfig(mode="later")  # type: ignore[arg-type]
