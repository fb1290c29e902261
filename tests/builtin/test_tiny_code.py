"""The built-in `replayserve/tiny-code`: the shipped weights are the trained ones (held-out perplexity
and function-header share as `eval.json` recorded them at training), they load by name, in
transformers too, the package stays small, and chat continues code (the README's examples)."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny_code import (
    CODE_CHAT_TEMPLATE,
    completes_as_python,
    eval_results,
    function_headers,
    heldout_perplexity,
    heldout_texts,
    perplexity_windows,
)
from replayserve.config import ModelConfig
from replayserve.config.builtin_models import TINY_CODE, TINY_CODE_DIR, resolve_model

# The least share of held-out function headers whose greedy body must be Python, for the weights
# shipped now (H200-trained, eval.json: 43 of 64), less a flip or two of a near-tie on another CPU.
MIN_HEADER_SHARE = 0.6


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=TINY_CODE, dtype="float32", device="cpu", max_num_seqs=32)


def test_heldout_perplexity_is_the_one_training_recorded(llm: LLM) -> None:
    recorded = eval_results(TINY_CODE_DIR)["heldout_perplexity"]
    assert (recorded["dtype"], recorded["device"]) == ("float32", "cpu")
    windows = perplexity_windows(llm, heldout_texts(TINY_CODE_DIR), recorded["files"], recorded["tokens_per_file"])
    ppl = heldout_perplexity(llm, windows)
    print(f"held-out perplexity {ppl:.3f} (recorded {recorded['value']:.3f})")
    assert ppl == pytest.approx(recorded["value"], rel=0.02)
    assert ppl < 0.1 * llm.config.model.vocab_size  # far from an untrained model's ~vocab_size


@pytest.mark.slow
def test_greedy_bodies_of_heldout_function_headers_are_python(llm: LLM) -> None:
    recorded = eval_results(TINY_CODE_DIR)["function_headers"]
    headers = function_headers(heldout_texts(TINY_CODE_DIR), recorded["count"])
    assert len(headers) == recorded["count"]
    outs = llm.generate(headers, SamplingParams(temperature=0.0, max_tokens=recorded["max_tokens"]), use_tqdm=False)
    parsed = [completes_as_python(h, o.outputs[0].text) for h, o in zip(headers, outs, strict=True)]
    share = sum(parsed) / len(parsed)
    print(f"{sum(parsed)}/{len(parsed)} held-out function bodies are Python (recorded {recorded['share']:.2f})")
    assert share >= MIN_HEADER_SHARE
    assert abs(share - recorded["share"]) <= 2 / len(parsed)  # a float tie may flip a greedy token or two


def test_completes_as_python_accepts_valid_prefixes_only() -> None:
    header = "def f(a):"
    assert completes_as_python(header, "\n    return a + 1\n\n\ndef g():\n    pass")
    assert completes_as_python(header, "\n    x = [a,\n         2,\n    ")  # an open bracket, a cut last line
    assert completes_as_python(header, '\n    """Docstring\n    that goes on\n')
    assert not completes_as_python(header, "\n    return )\n")
    assert not completes_as_python(header, "\nx = 1\n")  # no body
    assert not completes_as_python(header, "\n    x = 1\n  y = 2\n")  # a bad dedent


def test_the_name_resolves_and_the_package_stays_small(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model(TINY_CODE) == str(TINY_CODE_DIR)
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    files = {p.name: p.stat().st_size for p in TINY_CODE_DIR.iterdir()}
    assert sum(files.values()) <= 42 * 10**6
    assert all(size <= 16 * 10**6 for name, size in files.items() if name.endswith(".safetensors"))
    assert files["heldout_sample.json"] <= 300_000
    cfg = ModelConfig.from_dir(TINY_CODE_DIR)
    assert {"linear_attention", "full_attention", "mlp", "moe"} <= set(cfg.layer_types)
    assert cfg.num_nextn_predict_layers == 1
    (tmp_path / "replayserve" / "tiny-code").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # a local directory of that name wins
    assert resolve_model(TINY_CODE) == TINY_CODE


def test_transformers_reads_the_shipped_checkpoint_to_the_same_logprobs(llm: LLM) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import NemotronHForCausalLM

    hf = NemotronHForCausalLM.from_pretrained(TINY_CODE_DIR, dtype=torch.float32).eval()
    assert llm.tokenizer is not None
    ids = llm.tokenizer.encode("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n")
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)])
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    theirs = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def _readme_python_block(containing: str) -> str:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    return next(block for block in readme.split("```python\n")[1:] if containing in block.split("```")[0])


def test_chat_continues_code_as_the_readme_shows(llm: LLM) -> None:
    tokenizer_config = json.loads((TINY_CODE_DIR / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CODE_CHAT_TEMPLATE
    example = _readme_python_block('LLM(model="replayserve/tiny-code")')
    content = ast.literal_eval(re.search(r'"content": ("[^"]*")', example).group(1))
    shown = ast.literal_eval(re.search(r'# (".*)\.\.\."', example).group(1) + '"')
    max_tokens = int(re.search(r"max_tokens=(\d+)", example).group(1))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    reply = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0].outputs[0]
    assert reply.token_ids == llm.generate(content, params, use_tqdm=False)[0].outputs[0].token_ids
    assert reply.text.startswith(shown) and completes_as_python(content, reply.text)


def test_the_serving_example_sends_code(llm: LLM) -> None:
    example = _readme_python_block("client.chat.completions.create")
    prompts = [ast.literal_eval(m) for m in re.findall(r'(?:prompt=|"content": )("[^"]*")', example)]
    assert len(prompts) == 2
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert all(completes_as_python(p, o.outputs[0].text) for p, o in zip(prompts, outs, strict=True))
