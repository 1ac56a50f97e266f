"""`sloserve serve --config FILE.yaml` (vLLM's --config): flags read from YAML, flag names as
keys (dashes or underscores), switches as booleans, lists for several values; the command line
wins over the file; every bad file is exit code 2 with what is wrong named, before any model is
prepared."""

from __future__ import annotations

import pytest

from engine.entrypoints.cli import build_parser, main
from engine.entrypoints.config_file import expand_config


def _args(tmp_path, text: str, *cli: str):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    parser = build_parser()
    argv = expand_config(["serve", "--config", str(path), *cli], parser,
                         parser.config_commands)
    return parser.parse_args(argv)


def test_the_files_flags_are_read_and_the_command_line_wins(tmp_path):
    text = ("model: /models/tiny\n"
            "port: 9001\n"
            "max_num_seqs: 12\n"
            "max-model-len: 2048\n"
            "enforce-eager: true\n"
            "metrics-require-api-key: false\n"
            "served-model-name: [first, second]\n"
            "default-ttft-slo-ms: 250.5\n")
    args = _args(tmp_path, text)
    assert (args.model, args.port, args.max_num_seqs, args.max_model_len) == (
        "/models/tiny", 9001, 12, 2048)
    assert args.enforce_eager is True and args.metrics_require_api_key is False
    assert args.served_model_name == ["first", "second"]
    assert args.default_ttft_slo_ms == 250.5
    # Probe: the file changed what the defaults would be.
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.port, defaults.max_num_seqs) != (9001, 12)
    # The command line, before or after --config, wins.
    overridden = _args(tmp_path, text, "--port", "9100", "--served-model-name", "cli")
    assert overridden.port == 9100 and overridden.served_model_name == ["cli"]
    assert overridden.max_num_seqs == 12


@pytest.mark.parametrize("text, message", [
    ("max-num-seqz: 4\n", "'max-num-seqz' is not a flag of this command"),
    ("metrics-require-api-key: 1\n", "metrics-require-api-key is a switch: give true or false"),
    ("port: [1, 2]\n", "port takes one value, not a list"),
    ("port:\n", "port has no value"),
    ("- port\n- 9000\n", "must hold a mapping of flag names to values, not a list"),
    ("port: [\n", "is not YAML"),
    ("port: 0\n", "argument --port: must be in [1, 65535], got 0"),
])
def test_a_bad_file_is_a_usage_error_naming_it(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["serve", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_file_and_a_missing_path_are_named(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err
    assert main(["serve", "--config"]) == 2
    assert "--config needs a file" in capsys.readouterr().err


def test_an_empty_file_changes_nothing(tmp_path):
    assert _args(tmp_path, "").port == build_parser().parse_args(["serve"]).port
