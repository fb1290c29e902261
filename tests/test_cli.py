"""The command line: help for every option, engine flags generated from the table of engine options
(config/options.py) and listed in README, --version, generate with engine options printing each
prompt and completion apart, and a table of bad invocations that each exit 2 with one line."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest
import torch

import replayserve
from replayserve.cli import SERVER_EXTRA_INSTALL, build_parser, engine_options, main
from replayserve.config import ENGINE_OPTIONS, EngineOption

README = Path(__file__).parents[1] / "README.md"


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_every_option_has_help() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"{name} {action.option_strings or action.dest} has no help"


CLI_OPTIONS = [o for o in ENGINE_OPTIONS.values() if not o.llm_only]


def _sub_parser(name: str) -> argparse.ArgumentParser:
    return next(a for a in build_parser()._actions if a.dest == "command").choices[name]


@pytest.mark.parametrize("command", ["demo", "generate", "serve"])
def test_help_gives_every_engine_flag_its_options_help(command: str) -> None:
    text = " ".join(_sub_parser(command).format_help().split())
    for option in CLI_OPTIONS:
        assert f"{option.cli_flag} " in text and " ".join(option.help.split()) in text, option.name
    assert "--warmup" not in text


def test_engine_flags_default_to_the_options_defaults() -> None:
    assert engine_options(build_parser().parse_args(["serve"])) == {o.name: o.default for o in CLI_OPTIONS}


def _flag_value(option: EngineOption) -> tuple[list[str], object]:
    """The flag's words setting `option` to a value other than its default, and that value."""
    if option.type is bool:
        return [option.cli_flag], True
    if option.choices:
        return [option.cli_flag, option.choices[-1]], option.choices[-1]
    if option.name == "speculative":
        return [option.cli_flag, '{"method": "ngram", "num_speculative_tokens": 2}'], {
            "method": "ngram", "num_speculative_tokens": 2}
    value = 0.5 if option.type is float else 3
    return [option.cli_flag, str(value)], value


@pytest.mark.parametrize("option", CLI_OPTIONS, ids=lambda o: o.name)
def test_each_engine_flag_sets_its_option(option: EngineOption) -> None:
    words, value = _flag_value(option)
    assert value != option.default
    options = engine_options(build_parser().parse_args(["generate", "--prompt", "x", *words]))
    assert options == {**{o.name: o.default for o in CLI_OPTIONS}, option.name: value}


def test_readme_lists_every_engine_flag() -> None:
    text = README.read_text()
    start = text.index(":", text.index("Engine options (`--help` explains each):"))
    listed = text[start:text.index(".", start)]  # the list is one sentence
    assert re.findall(r"`(--[a-z-]+)", listed) == [o.cli_flag for o in CLI_OPTIONS]


def test_version(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(["--version"], capsys)
    assert code == 0 and out.strip() == f"replayserve {replayserve.__version__}"


def test_generate_prints_prompts_and_completions_apart(tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = _run(["generate", "--model", str(tiny_model_dir), "--prompt", "Hello", "--prompt", "def f(",
                           "--max-tokens", "4", "--n", "2", "--temperature", "1.0", "--seed", "0",
                           "--ssm-backend", "replay", "--enable-prefix-caching", "--dtype", "float64",
                           "--device", "cpu", "--speculative", '{"method": "ngram", "num_speculative_tokens": 2}'],
                          capsys)
    assert code == 0, err
    assert out.count("=== prompt") == 2 and out.count("--- completion") == 4
    assert "=== prompt 1 ===\ndef f(\n" in out and "(finish: length)" in out


def test_generate_prints_logprobs_and_prompt_logprobs(tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from replayserve import LLM, SamplingParams

    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "The quick brown fox", "--max-tokens", "3",
            "--logprobs", "2", "--prompt-logprobs", "1", "--dtype", "float64", "--device", "cpu"]
    code, out, err = _run(argv, capsys)
    assert code == 0, err
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu")
    want = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=3, logprobs=2,
                                                              prompt_logprobs=1), use_tqdm=False)[0]
    head, completion = out.split("--- completion 0")
    prompt_lines = head.split("prompt logprobs:\n")[1].splitlines()
    assert len(prompt_lines) == len(want.prompt_token_ids) and prompt_lines[0].endswith(" -")
    second = want.prompt_logprobs[1][want.prompt_token_ids[1]]
    assert prompt_lines[1].startswith(f"  1: {second.decoded_token!r} {second.logprob:.4f} (rank {second.rank})")
    token_lines = completion.split("logprobs:\n")[1].splitlines()
    first = want.outputs[0].logprobs[0][want.outputs[0].token_ids[0]]
    assert len(token_lines) == 3 and token_lines[0].startswith(f"  0: {first.decoded_token!r} {first.logprob:.4f} "
                                                               "(rank 1); top: ")


def test_demo_prints_python_and_a_table_of_drafts(capsys: pytest.CaptureFixture) -> None:
    code, out, err = _run(["demo", "--max-tokens", "8", "--repeats", "1", "--device", "cpu"], capsys)
    assert code == 0, err
    assert "def fibonacci(n):" in out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| none", "| n-gram", "| MTP"]
    assert "| 1.00x | - |" in rows[1] and all("%" in r for r in rows[2:])  # acceptance of the drafting rows


def test_generate_defaults_to_the_builtin_model(capsys: pytest.CaptureFixture) -> None:
    code, out, err = _run(["generate", "--prompt", "import os", "--max-tokens", "4", "--device", "cpu"], capsys)
    assert code == 0 and out.startswith("=== prompt 0 ===\nimport os\n"), err


def test_serve_defaults_to_the_builtin_model(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("fastapi", reason="the server extra (CI installs it with the test extra)")
    import replayserve.server

    seen = {}
    monkeypatch.setattr(replayserve.server, "create_app",
                        lambda core, name, waiting, **_: seen.update(core=core, name=name))
    monkeypatch.setattr(replayserve.server, "serve", lambda app, *args: True)
    code, _, err = _run(["serve", "--device", "cpu"], capsys)
    assert code == 0, err
    assert seen["name"] == "replayserve/tiny-code" and seen["core"].config.model.num_nextn_predict_layers == 1


def test_make_tiny_refuses_a_non_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    code, _, err = _run(["make-tiny", str(tmp_path)], capsys)
    assert code == 2 and "--force" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "keep.txt").read_text() == "mine" and not (tmp_path / "config.json").exists()
    assert _run(["make-tiny", str(tmp_path), "--force"], capsys)[0] == 0
    assert (tmp_path / "config.json").is_file()


def test_quantize_writes_an_fp8_checkpoint_of_the_builtin_model_once(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    code, out, err = _run(["quantize", "replayserve/tiny-code", str(tmp_path / "fp8")], capsys)
    assert code == 0, err
    assert out.startswith(f"wrote {tmp_path / 'fp8'}: FP8 weights") and "lm_head" in out
    assert (tmp_path / "fp8" / "hf_quant_config.json").is_file()
    code, _, err = _run(["quantize", "replayserve/tiny-code", str(tmp_path / "fp8")], capsys)
    assert code == 2 and "not empty" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("argv", "message"), [
    ([], "required"),
    (["serve-everything"], "invalid choice"),
    (["demo", "--num-drafts", "0"], "--num-drafts"),
    (["demo", "--repeats", "0"], "--repeats"),
    (["generate", "--model", "/no/such/dir", "--prompt", "x"], "does not exist"),
    (["generate", "--model", "{readme}", "--prompt", "x"], "is a file, not a model directory"),
    (["generate", "--prompt", "x", "--frobnicate"], "unrecognized arguments: --frobnicate (see replayserve "
                                                    "generate --help)"),
    (["serve", "--frobnicate"], "(see replayserve serve --help)"),
    (["generate", "--model", "{model}", "--prompt", "x", "--dtype", "int8"], "invalid choice"),
    (["generate", "--model", "{model}", "--prompt", "x", "--speculative", "{oops"], "not valid JSON"),
    (["generate", "--model", "{model}", "--prompt", "x", "--speculative", "[3]"],
     "--speculative must be a JSON object"),
    (["generate", "--model", "{model}", "--prompt", "x", "--speculative", '{"method": "eagle", '
      '"num_speculative_tokens": 2}'], "method"),
    (["generate", "--model", "{model}", "--prompt", "x", "--async-scheduling", "--device", "cpu", "--speculative",
      '{"method": "ngram", "num_speculative_tokens": 2}'], "async_scheduling"),
    (["generate", "--model", "{model}", "--prompt", "x", "--tensor-parallel-size", "3", "--device", "cpu"],
     "tensor_parallel_size"),
    (["generate", "--model", "{model}", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["generate", "--model", "{model}", "--prompt", "x", "--max-tokens", "many"], "invalid int"),
    (["generate", "--model", "{model}", "--prompt", "x", "--block-size", "0", "--device", "cpu"], "block_size"),
    (["generate", "--model", "{model}", "--prompt", "x", "--gpu-memory-utilization", "1.5", "--device", "cpu"],
     "gpu_memory_utilization"),
    (["generate", "--model", "{model}", "--prompt", "x", "--prompt-logprobs", "-1", "--device", "cpu"],
     "prompt_logprobs"),
])
def test_bad_invocations_exit_2_with_one_line(tiny_model_dir: Path, capsys: pytest.CaptureFixture, argv: list[str],
                                              message: str) -> None:
    code, out, err = _run([a.replace("{model}", str(tiny_model_dir)).replace("{readme}", str(README)) for a in argv],
                          capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_the_server_extra_hint_gives_readmes_install_command(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    """Without fastapi, `serve` says how to install the extra, in the words of README's Serving section."""
    serving = README.read_text().split("## Serving")[1].split("\n## ")[0]
    assert SERVER_EXTRA_INSTALL in serving
    for name in [m for m in sys.modules if m == "replayserve.server" or m.startswith("replayserve.server.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)  # an import of it fails as if it were not installed
    code, _, err = _run(["serve", "--device", "cpu"], capsys)
    assert code == 2 and "fastapi is missing" in err and SERVER_EXTRA_INSTALL in err


def test_ctrl_c_ends_with_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    import replayserve.builtin.tiny

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(replayserve.builtin.tiny, "make_tiny", interrupted)
    code, _, err = _run(["make-tiny", str(tmp_path / "new")], capsys)
    assert code == 130 and err.strip() == "replayserve: interrupted"


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_make_tiny_mtp_writes_a_checkpoint_with_its_mtp_layer(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                              family: str) -> None:
    from replayserve.config import ModelConfig
    from replayserve.models.loader import load_model

    assert _run(["make-tiny", str(tmp_path / "m"), "--family", family, "--mtp"], capsys)[0] == 0
    assert ModelConfig.from_dir(tmp_path / "m").num_nextn_predict_layers == 1
    assert hasattr(load_model(tmp_path / "m", torch.float32, torch.device("cpu")), "mtp")
    code, _, err = _run(["make-tiny", str(tmp_path / "g"), "--family", "granite", "--mtp"], capsys)
    assert code == 2 and "--mtp" in err and "granite" in err
