"""Bad input raises a clear error, and the engine keeps serving without leaking blocks or slots."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from replayserve import LLM, SamplingParams
from replayserve.config import ALLOW_LONG_MAX_MODEL_LEN, ConfigError
from replayserve.models.loader import CheckpointError
from replayserve.sampling_params import FLOAT32_MAX, FLOAT32_TINY
from tests.conftest import assert_pools_full

GOOD = {"prompt_token_ids": [5, 6, 7, 8]}
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32", max_num_seqs=4, max_model_len=64, block_size=8)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt_token_ids": []}, "empty"),
        ("", "empty"),
        ({"prompt_token_ids": list(range(3, 67))}, "max_model_len=64"),
        ({"prompt_token_ids": [5, -1]}, "ints in"),
        ({"prompt_token_ids": [5, 10**9]}, "ints in"),
        ({"prompt_token_ids": [5, 1.5]}, "ints in"),
        ({"tokens": [5]}, r"prompts\[1\] must be a string, \{'prompt': str\} or \{'prompt_token_ids'"),
        (42, r"prompts\[1\] must be a string.*got 42 \(int\)"),
        (None, r"prompts\[1\] must be a string.*got None"),
        (b"Hi", r"prompts\[1\] must be a string.*b'Hi' \(bytes\): bytes are not accepted; decode them"),
        ({"prompt": 5}, r"prompts\[1\]\['prompt'\] must be a string"),
        ("Hi \ud800", r"prompts\[1\] is not valid Unicode: '\\ud800' at index 3 is a lone surrogate"),
        ({"prompt": "\udfff"}, r"prompts\[1\]\['prompt'\] is not valid Unicode"),
    ],
)
def test_bad_prompt_is_rejected_and_engine_still_serves(llm: LLM, prompt, message: str) -> None:
    expected = llm.generate(GOOD, PARAMS, use_tqdm=False)[0].token_ids
    with pytest.raises(ValueError, match=message):
        # The bad prompt comes second: the good one before it must not be admitted either.
        llm.generate([GOOD, prompt], PARAMS, use_tqdm=False)
    assert_pools_full(llm)
    assert llm.generate(GOOD, PARAMS, use_tqdm=False)[0].token_ids == expected
    assert_pools_full(llm)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (None, "prompts must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, or a list of them; "
         "got None (NoneType)"),
        # The bytes used to be iterated as prompts: "a prompt is a string ..., got 104".
        (b"hello", "got b'hello' (bytes): bytes are not accepted; decode them to a string first"),
        (bytearray(b"hello"), "bytes are not accepted"),
        (5, "got 5 (int)"),
    ],
)
def test_a_prompt_argument_of_no_accepted_form_says_what_is_accepted(llm: LLM, prompts, message: str) -> None:
    with pytest.raises(ValueError, match="prompts must be a string") as caught:
        llm.generate(prompts, PARAMS, use_tqdm=False)
    assert message in str(caught.value)
    assert_pools_full(llm)


def test_a_text_prompt_dict_is_its_string(llm: LLM) -> None:
    """vLLM's TextPrompt, {"prompt": str}, generates as the string does and reports it as the prompt."""
    as_str, as_dict = llm.generate(["Hi there", {"prompt": "Hi there"}], PARAMS, use_tqdm=False)
    assert as_dict.prompt == as_str.prompt == "Hi there"
    assert as_dict.prompt_token_ids == as_str.prompt_token_ids and as_dict.token_ids == as_str.token_ids


def test_a_lone_surrogate_in_a_chat_message_names_the_message(llm: LLM) -> None:
    """It used to reach the tokenizer, which raised a bare TypeError (a 500 in the server)."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "a\ud83dz"}]
    with pytest.raises(ValueError, match=r"messages\[1\]\.content is not valid Unicode: '\\ud83d' at index 1"):
        llm.chat(chat, PARAMS, use_tqdm=False)
    assert_pools_full(llm)


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"temperature": 1e-300}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 1e-300}, "top_p"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "x"}, "seed"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        # Values float32 (the sampling dtype) rounds to 0 or inf: repetition_penalty=1e-300 divided
        # the logits by 0 and sampled token 0 forever.
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e-39}, "repetition_penalty"),  # a float32 subnormal
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": 1e-300}, "presence_penalty"),
        ({"frequency_penalty": -1e-300}, "frequency_penalty"),
        ({"min_p": 1e-300}, "min_p"),
        ({"temperature": 1e300}, "temperature"),
        ({"temperature": 10**400}, "temperature"),  # too large for a float: used to raise OverflowError
    ],
)
def test_invalid_sampling_values_name_the_option(kwargs: dict, option: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{option}") as caught:
        SamplingParams(**kwargs)
    assert len(str(caught.value)) < 400  # the value is shown, cut short


@pytest.mark.parametrize(
    ("option", "allowed"),
    [
        ("repetition_penalty", r"a number in \[1.18e-38, 3.4e\+38\], 1 for off \(float32"),
        ("presence_penalty", r"0 \(off\) or a number in \[-2, 2\] at least 1.18e-38 in magnitude \(float32"),
        ("frequency_penalty", r"0 \(off\) or a number in \[-2, 2\] at least 1.18e-38 in magnitude"),
        ("min_p", r"0 \(off\) or a number in \[1.18e-38, 1\]"),
        ("top_p", r"a number in \[1.18e-38, 1\]"),
    ],
)
def test_float32_bounds_are_named_and_the_printed_ones_accepted(option: str, allowed: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{option} must be {allowed}"):
        SamplingParams(**{option: 1e-300})
    SamplingParams(**{option: 1.18e-38})  # the bounds as printed, and float32's own, are accepted
    SamplingParams(**{option: FLOAT32_TINY})
    if option == "repetition_penalty":
        SamplingParams(repetition_penalty=3.4e38)
        SamplingParams(repetition_penalty=FLOAT32_MAX)


def test_mismatched_params_list_is_rejected(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        llm.generate([GOOD, GOOD], [PARAMS], use_tqdm=False)
    assert_pools_full(llm)


def test_interrupted_generate_frees_everything(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real_step = llm.engine.step

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([GOOD] * 3, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert_pools_full(llm)
    assert len(llm.generate(GOOD, PARAMS, use_tqdm=False)[0].token_ids) == 4


def _broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_directory_and_config(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(model=str(tmp_path / "nowhere"))
    d = _broken_copy(tiny_model_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(model=str(d))


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (lambda c: "{not json", ConfigError, "not valid JSON"),
        # quantization_config is read by the loader, which takes ModelOpt FP8 only (models/quantization.py)
        (lambda c: {**c, "quantization_config": {"bits": 4}}, CheckpointError, "quant_algo must be one of"),
        (lambda c: {**c, "quantization_config": {"quant_method": "gptq", "bits": 4}}, CheckpointError,
         "quant_method is 'gptq'; replayserve loads NVIDIA ModelOpt"),
        (lambda c: {**c, "layers_block_type": ["linear_attention", "conv"]}, ConfigError, "conv"),
        (lambda c: {**c, "model_type": "llama"}, ConfigError, "model_type"),
        (lambda c: {k: v for k, v in c.items() if k != "model_type"}, ConfigError, "config.json has no model_type"),
        (lambda c: {**c, "eos_token_id": c["vocab_size"]}, ConfigError,
         r"eos_token_id: .*\[512\]; token ids must be < vocab_size=512"),
        (lambda c: {**c, "eos_token_id": [2, -1]}, ConfigError, "eos_token_id: must be >= 0"),
        (lambda c: {**c, "max_position_embeddings": 1}, ConfigError, "max_position_embeddings: must be >= 2, got 1"),

        (lambda c: {**c, "mlp_hidden_act": "gelu"}, ConfigError, "mlp_hidden_act"),
        (lambda c: {**c, "n_groups": 3}, ConfigError, "n_groups"),
        (lambda c: {**c, "hidden_size": 64}, CheckpointError, "shape"),
    ],
)
def test_malformed_config(tmp_path: Path, tiny_model_dir: Path, edit, error, message: str) -> None:
    d = _broken_copy(tiny_model_dir, tmp_path / "m")
    edited = edit(json.loads((d / "config.json").read_text()))
    (d / "config.json").write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(error, match=message):
        LLM(model=str(d), dtype="float32")


def test_max_model_len_above_the_model_s_positions_needs_the_override(tiny_model_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """As in vLLM (VLLM_ALLOW_LONG_MAX_MODEL_LEN): refused naming both values, unless the environment allows it."""
    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN, raising=False)
    with pytest.raises(ConfigError, match="engine option max_model_len: 1025 is above the model's "
                       f"max_position_embeddings=1024 .*set {ALLOW_LONG_MAX_MODEL_LEN}=1"):
        LLM(model=str(tiny_model_dir), dtype="float32", max_num_seqs=1, max_model_len=1025)
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN, "1")
    with caplog.at_level("WARNING", logger="replayserve.config"):
        llm = LLM(model=str(tiny_model_dir), dtype="float32", max_num_seqs=1, max_model_len=1025)
    assert llm.config.resolved_max_model_len == 1025
    assert "max_model_len=1025 is above the model's max_position_embeddings=1024" in caplog.text


def test_malformed_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = _broken_copy(tiny_model_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="not a valid safetensors"):
        LLM(model=str(d))
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLM(model=str(d))

    state = load_file(str(tiny_model_dir / "model.safetensors"))
    missing = {k: v for k, v in state.items() if not k.endswith("mixer.A_log")}
    save_file(missing, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors.*A_log"):
        LLM(model=str(d))
    save_file({**state, "backbone.extra.weight": state["backbone.norm_f.weight"].clone()}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="does not use.*backbone.extra.weight"):
        LLM(model=str(d))


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"ssm_backend": "magic"}, "ssm_backend"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"num_kv_blocks": 2, "max_model_len": 64, "block_size": 8}, "num_kv_blocks"),
    ],
)
def test_invalid_engine_options_name_the_option(tiny_model_dir: Path, kwargs: dict, option: str) -> None:
    with pytest.raises(ConfigError, match=f"engine option {option}"):
        LLM(model=str(tiny_model_dir), **kwargs)
