"""LLM.chat: the model directory's chat template rendered as transformers renders it, the
documented default without one, bad conversations refused with the field named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from replayserve import LLM, SamplingParams
from replayserve.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate

# ChatML-style, with the special token, a system default and raise_exception, as real templates use.
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [{"role": "user", "content": "  What is 2 + 2? "}, {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And 3 + 3?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_model_dir, out)
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>",
                                                          "eos_token": {"content": "</s>"}}))
    return out


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_renders_as_transformers_does(chat_model_dir: Path, add_generation_prompt: bool) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(chat_model_dir / "tokenizer.json"), bos_token="<s>",
                                 eos_token="</s>", chat_template=TEMPLATE)
    want = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = ChatTemplate.from_dir(chat_model_dir).render(CONVERSATION, add_generation_prompt)
    assert got == want and "You are helpful." in got


def test_chat_equals_generate_on_the_rendered_prompt(chat_model_dir: Path) -> None:
    llm = LLM(model=str(chat_model_dir), dtype="float64", device="cpu")
    text = ChatTemplate.from_dir(chat_model_dir).render(CONVERSATION)
    want = llm.generate({"prompt_token_ids": llm.get_tokenizer().encode(text, add_special_tokens=False)}, GREEDY,
                        use_tqdm=False)
    one = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    two = llm.chat([CONVERSATION, CONVERSATION[:1]], GREEDY, use_tqdm=False)
    assert one[0].outputs[0].token_ids == want[0].outputs[0].token_ids == two[0].outputs[0].token_ids
    assert len(two) == 2 and two[1].prompt_token_ids != two[0].prompt_token_ids
    # The rendered prompt, as vLLM's chat returns it.
    assert one[0].prompt == two[0].prompt == text and two[1].prompt == ChatTemplate.from_dir(chat_model_dir).render(
        CONVERSATION[:1])


def test_without_a_template_the_documented_default_is_used(tiny_model_dir: Path) -> None:
    template = ChatTemplate.from_dir(tiny_model_dir)
    assert template.source == DEFAULT_CHAT_TEMPLATE
    assert template.render([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"


def test_a_developer_message_renders_as_a_system_one(chat_model_dir: Path) -> None:
    """OpenAI's developer role is its system role; the template (which refuses unknown roles) sees "system"."""
    template = ChatTemplate.from_dir(chat_model_dir)
    developer = [{"role": "developer", "content": "Answer in digits."}, *CONVERSATION]
    assert template.render(developer) == template.render([{**developer[0], "role": "system"}, *CONVERSATION])
    assert developer[0]["role"] == "developer", "the caller's messages are left as they were"


@pytest.mark.parametrize(("messages", "message"), [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "user"}], r"messages\[0\]"),
    ([{"role": "user", "content": 3}], r"messages\[0\]"),
    ([{"role": "robot", "content": "x"}], "role 'robot'"),
])
def test_bad_conversations_are_refused(tiny_model_dir: Path, messages: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChatTemplate.from_dir(tiny_model_dir).render(messages)  # type: ignore[arg-type]


def test_a_template_that_raises_names_the_problem() -> None:
    template = ChatTemplate(TEMPLATE, {"bos_token": "<s>"})
    with pytest.raises(ValueError, match="unknown role tool"):
        template.render([{"role": "tool", "content": "x"}])


def test_tools_and_template_kwargs_reach_the_template(tiny_model_dir: Path) -> None:
    source = ("{% for tool in tools or [] %}[{{ tool.function.name }}: {{ tool | tojson }}]{% endfor %}"
              "{% for m in messages %}{{ m.role }}: {{ m.content }}"
              "{% for c in m.tool_calls or [] %} calls {{ c.function.arguments.city }}{% endfor %};{% endfor %}"
              "{% if not enable_thinking | default(true) %}<think></think>{% endif %}")
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conversation = [{"role": "user", "content": "<Paris & Rome>"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "content": "21 C"}]
    out = llm.chat(conversation, GREEDY, use_tqdm=False, chat_template=source, tools=tools,
                   chat_template_kwargs={"enable_thinking": False})
    assert out[0].prompt == (
        '[get_weather: {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]'
        "user: <Paris & Rome>;assistant:  calls Paris;tool: 21 C;<think></think>")
    with pytest.raises(ValueError, match="chat_template_kwargs must not set"):
        ChatTemplate(source).render(conversation, template_kwargs={"tools": []})
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls must be an assistant's list"):
        ChatTemplate(source).render([conversation[0], {"role": "assistant", "content": "x", "tool_calls": [1]}])
