"""The command line rejects out-of-range values as usage errors (exit code 2, the flag and the
bound named) before any model is prepared; nothing is silently clamped into range."""

from __future__ import annotations

import pytest

from engine.config import build_engine_config
from engine.entrypoints.cli import build_parser, main
from engine.entrypoints.engine_args import engine_kwargs

# (flags, the text argparse must print): every numeric engine option, and serve's own.
BAD_VALUES = [
    (["-tp", "0"], "argument --tensor-parallel-size/-tp: must be >= 1, got 0"),
    (["--tensor-parallel-size", "-2"], "must be >= 1, got -2"),
    (["--max-model-len", "0"], "argument --max-model-len: must be >= 1, got 0"),
    (["--block-size", "0"], "argument --block-size: must be >= 1, got 0"),
    (["--num-kv-blocks", "0"], "argument --num-kv-blocks: must be >= 1, got 0"),
    (["--kv-cache-memory-gb", "0"], "argument --kv-cache-memory-gb: must be > 0, got 0"),
    (["--kv-cache-memory-gb", "nan"], "must be a finite number > 0, got nan"),
    (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens: must be >= 1"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
    (["--long-prefill-token-threshold", "-1"], "must be >= 0, got -1"),
    (["--watermark", "1"], "argument --watermark: must be in [0, 1), got 1"),
    (["--watermark", "-0.1"], "argument --watermark: must be in [0, 1), got -0.1"),
    (["--aging-bound-ms", "-1"], "argument --aging-bound-ms: must be >= 0, got -1"),
    (["--collective-timeout-s", "0"], "argument --collective-timeout-s: must be > 0, got 0"),
    (["--slo-preempt-margin", "0.5"], "argument --slo-preempt-margin: must be >= 1, got 0.5"),
    (["--stubborn-fraction", "1.5"], "argument --stubborn-fraction: must be in [0, 1], got 1.5"),
    (["--slo-preempt-min-tokens", "-1"], "argument --slo-preempt-min-tokens: must be >= 0, got -1"),
    (["--monitor-interval-ms", "0"], "argument --monitor-interval-ms: must be > 0, got 0"),
    (["--predictor-error-quantile", "0"], "must be in (0, 1], got 0"),
    (["--predictor-error-quantile", "1.01"], "must be in (0, 1], got 1.01"),
    (["--block-size", "abc"], "argument --block-size: expected an integer, got 'abc'"),
    (["--block-size", "1.5"], "argument --block-size: expected an integer, got '1.5'"),
    (["--watermark", "inf"], "must be a finite number in [0, 1), got inf"),
]

SERVE_BAD_VALUES = [
    (["--port", "0"], "argument --port: must be in [1, 65535], got 0"),
    (["--port", "65536"], "argument --port: must be in [1, 65535], got 65536"),
    (["--default-ttft-slo-ms", "-1"], "argument --default-ttft-slo-ms: must be >= 0, got -1"),
    (["--min-ttft-slo-ms", "-5"], "argument --min-ttft-slo-ms: must be >= 0, got -5"),
    (["--default-tpot-slo-ms", "0"], "argument --default-tpot-slo-ms: must be > 0, got 0"),
    (["--max-request-body-bytes", "0"], "argument --max-request-body-bytes: must be >= 1"),
]

GENERATE_BAD_VALUES = [
    (["--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
    (["--temperature", "-0.5"], "argument --temperature: must be >= 0, got -0.5"),
    (["--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
]


@pytest.mark.parametrize("flags,message", BAD_VALUES + SERVE_BAD_VALUES,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_serve_rejects_out_of_range_values(flags, message, capsys) -> None:
    # No model folder exists at that path: an error from anything past the parser would differ.
    assert main(["serve", "--model", "/nonexistent", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", BAD_VALUES + GENERATE_BAD_VALUES,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_generate_rejects_out_of_range_values(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "hi", "--model", "/nonexistent", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags", [
    ["-tp", "1"], ["--watermark", "0"], ["--stubborn-fraction", "0"], ["--stubborn-fraction", "1"],
    ["--predictor-error-quantile", "1"], ["--slo-preempt-margin", "1"], ["--aging-bound-ms", "0"],
    ["--long-prefill-token-threshold", "0"], ["--kv-cache-memory-gb", "0.25"],
])
def test_values_on_the_bounds_are_accepted(flags) -> None:
    args = build_parser().parse_args(["generate", "hi", *flags])
    kwargs = engine_kwargs(args)
    build_engine_config("unused", **{k: v for k, v in kwargs.items() if k != "model"})


# Renamed to one word per mechanism: the old flags still parse, with a warning.
DEPRECATED_FLAGS = [
    (["--mid-forward-preemption", "off"], ["--slo-preemption", "off"], "slo_preemption"),
    (["--preempt-policy", "aggressive"], ["--slo-preempt-policy", "aggressive"],
     "slo_preempt_policy"),
    (["--preempt-margin", "1.5"], ["--slo-preempt-margin", "1.5"], "slo_preempt_margin"),
    (["--preempt-min-tokens", "7"], ["--slo-preempt-min-tokens", "7"], "slo_preempt_min_tokens"),
]


@pytest.mark.parametrize("old,new,key", DEPRECATED_FLAGS, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else None)
def test_deprecated_flags_still_work_and_warn(old, new, key, caplog) -> None:
    with caplog.at_level("WARNING"):
        got = engine_kwargs(build_parser().parse_args(["generate", "hi", *old]))
    assert got[key] == engine_kwargs(build_parser().parse_args(["generate", "hi", *new]))[key]
    assert f"{old[0]} is deprecated" in caplog.text and new[0] in caplog.text
    default = engine_kwargs(build_parser().parse_args(["generate", "hi"]))[key]
    assert got[key] != default  # probe: the flag really moved the value
    # The old flag keeps checking its value as the new one does.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", old[0], "bogus"])


def test_deprecated_engine_kwargs_are_renamed() -> None:
    from engine.entrypoints.deprecated_args import rename_deprecated_kwargs
    assert rename_deprecated_kwargs({"preempt_min_tokens": 3, "seed": 1}) == \
        {"slo_preempt_min_tokens": 3, "seed": 1}
    with pytest.raises(TypeError):
        rename_deprecated_kwargs({"preempt_policy": "aggressive",
                                  "slo_preempt_policy": "conservative"})


def test_tensor_parallel_size_defaults_to_one() -> None:
    assert engine_kwargs(build_parser().parse_args(["generate", "hi"]))["tensor_parallel_size"] == 1
    args = build_parser().parse_args(["generate", "hi", "-tp", "3"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 3


@pytest.mark.parametrize("flags,expected", [
    ([], "auto"), (["--fused-ops"], "on"), (["--fused-ops", "off"], "off"),
    (["--fused-ops", "on"], "on"), (["--fused-ops", "auto"], "auto"),
    # The bare flag, as before it took a value, followed by another option.
    (["--fused-ops", "--seed", "3"], "on"),
])
def test_fused_ops_is_tri_state_and_the_bare_flag_means_on(flags, expected) -> None:
    args = build_parser().parse_args(["generate", "hi", *flags])
    assert engine_kwargs(args)["fused_ops"] == expected


def test_a_bad_fused_ops_value_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "hi", "--fused-ops", "yes"])
    assert exc.value.code == 2
    assert "argument --fused-ops: invalid choice: 'yes'" in capsys.readouterr().err


def test_a_default_below_the_floor_is_still_an_error(capsys) -> None:
    assert main(["serve", "--model", "/nonexistent", "--default-ttft-slo-ms", "50",
                 "--min-ttft-slo-ms", "100"]) == 2
    assert "is below --min-ttft-slo-ms" in capsys.readouterr().err


# ---- serve's model: positional or --model ----------------------------------------------------

@pytest.fixture
def served(monkeypatch):
    """Runs `sloserve serve ...` up to the point where the server would start, and returns what
    it would have been started with: (EngineConfig, ServerSettings)."""
    import engine.serving.api_server as api_server

    started: list = []
    monkeypatch.setattr(api_server, "run_server",
                        lambda config, settings, *rest: started.append((config, settings)))

    def serve(*argv: str):
        code = main(["serve", *argv])
        assert code == 0 and len(started) == 1, code
        return started.pop()

    return serve


def test_serve_takes_the_model_as_a_positional_argument(tiny_model, served) -> None:
    model = tiny_model("llama")
    for argv in ([model], ["--model", model], [model, "--model", model]):
        config, settings = served(*argv)
        assert config.model.model == model and settings.served_model_name == model


def test_serve_refuses_two_different_models(tiny_model, capsys) -> None:
    assert main(["serve", tiny_model("llama"), "--model", "/other/model"]) == 2
    err = capsys.readouterr().err
    assert "the model is given twice" in err and "'/other/model' as --model" in err


def test_a_positional_model_that_is_no_model_folder_is_named(capsys) -> None:
    assert main(["serve", "/nonexistent/model"]) == 2
    assert "'/nonexistent/model' is not a local Hugging Face model folder" in \
        capsys.readouterr().err


# ---- the API key: flag, file or environment --------------------------------------------------

@pytest.fixture
def no_key_env(monkeypatch):
    for name in ("SLOSERVE_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_api_key_from_a_file_the_environment_or_the_flag(tiny_model, served, no_key_env,
                                                          tmp_path) -> None:
    model = tiny_model("llama")
    assert served(model)[1].api_key is None
    key_file = tmp_path / "key"
    key_file.write_text("  s3cret-from-file \nsecond line is ignored\n")
    assert served(model, "--api-key-file", str(key_file))[1].api_key == "s3cret-from-file"
    no_key_env.setenv("VLLM_API_KEY", "from-vllm-env")
    assert served(model)[1].api_key == "from-vllm-env"
    no_key_env.setenv("SLOSERVE_API_KEY", "from-sloserve-env")
    assert served(model)[1].api_key == "from-sloserve-env"
    # Either flag wins over the environment.
    assert served(model, "--api-key-file", str(key_file))[1].api_key == "s3cret-from-file"
    assert served(model, "--api-key", "from-flag")[1].api_key == "from-flag"


@pytest.mark.parametrize("content,message", [
    (None, "--api-key-file '{path}': cannot read it"),
    ("", "--api-key-file '{path}': its first line is empty"),
    ("\nkey-on-the-second-line\n", "its first line is empty"),
])
def test_a_missing_or_empty_key_file_is_an_error(tiny_model, no_key_env, tmp_path, capsys,
                                                 content, message) -> None:
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    assert main(["serve", tiny_model("llama"), "--api-key-file", str(path)]) == 2
    assert message.format(path=path) in capsys.readouterr().err


def test_api_key_and_api_key_file_together_are_an_error(no_key_env, capsys) -> None:
    assert main(["serve", "/nonexistent", "--api-key", "k", "--api-key-file", "/k"]) == 2
    assert "argument --api-key-file: not allowed with argument --api-key" in \
        capsys.readouterr().err


def test_api_key_help_warns_that_ps_shows_it(capsys) -> None:
    assert main(["serve", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "see it in `ps`" in help_text and "--api-key-file PATH" in help_text
