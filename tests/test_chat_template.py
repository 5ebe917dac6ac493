"""Specification of chat templates: `HFTokenizer.apply_chat_template` equals `transformers`.

The reference is ``transformers.AutoTokenizer.from_pretrained(dir).apply_chat_template`` on the
real Qwen3 tokenizer files (``tests/data/qwen3-tokenizer``, Apache-2.0, origin in its README:
``tokenizer.json.gz``, decompressed into a temporary checkpoint directory, and
``tokenizer_config.json`` with Qwen3's chat template), plus Qwen3-0.6B's published
``generation_config.json`` values. Rendered text and token ids must be equal, character for
character and id for id.
"""

from __future__ import annotations

import gzip
import json
import shutil
import unicodedata
from collections.abc import Mapping
from pathlib import Path

import pytest
import transformers

from ais_jax.io.hf import CheckpointError, HFTokenizer
from ais_jax.tasks import load_gsm8k, load_math, render_chat_template
from ais_jax.train import data

# The repository's copy (tests/data/qwen3-tokenizer/README.md); a missing file fails the tests.
FIXTURE = Path(__file__).resolve().parent / "data" / "qwen3-tokenizer"


# Qwen3-0.6B's generation_config.json as published (ids 151645 <|im_end|>, 151643 <|endoftext|>)
QWEN3_GENERATION = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}
IM_END, ENDOFTEXT = 151645, 151643


def _tokenizer_dir(folder: Path, generation: bool = True) -> Path:
    for name in ("tokenizer.json.gz", "tokenizer_config.json"):
        assert (FIXTURE / name).is_file(), f"test data {FIXTURE / name} is missing"
    folder.mkdir(parents=True)
    with (
        gzip.open(FIXTURE / "tokenizer.json.gz", "rb") as src,
        open(folder / "tokenizer.json", "wb") as dst,
    ):
        shutil.copyfileobj(src, dst)
    shutil.copy(FIXTURE / "tokenizer_config.json", folder / "tokenizer_config.json")
    if generation:
        (folder / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION))
    return folder


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """A Qwen3 tokenizer directory: tokenizer.json, tokenizer_config.json, generation_config."""
    return _tokenizer_dir(tmp_path_factory.mktemp("qwen3") / "ckpt")


@pytest.fixture(scope="module")
def both(qwen3):
    return HFTokenizer(qwen3), transformers.AutoTokenizer.from_pretrained(qwen3)


TOOL = {
    "type": "function",
    "function": {
        "name": "convert_currency",
        "description": "Convertit un montant — 換算する",
        "parameters": {
            "type": "object",
            "properties": {"amount": {"type": "number"}, "to": {"type": "string"}},
            "required": ["amount", "to"],
        },
    },
}
USER = {"role": "user", "content": "What is 2+2?"}
CONVERSATIONS = {
    "user-thinking-default": ([USER], {"add_generation_prompt": True}),
    "user-thinking-off": ([USER], {"add_generation_prompt": True, "enable_thinking": False}),
    "user-thinking-on": ([USER], {"add_generation_prompt": True, "enable_thinking": True}),
    "user-no-generation-prompt": ([USER], {}),
    "system-user": (
        [{"role": "system", "content": "You are a helpful math tutor."}, USER],
        {"add_generation_prompt": True},
    ),
    "system-user-assistant": (
        [
            {"role": "system", "content": "Be brief."},
            USER,
            {"role": "assistant", "content": "4"},
        ],
        {},
    ),
    "multi-turn-thinking-off": (
        [
            USER,
            {"role": "assistant", "content": "2+2 = 4."},
            {"role": "user", "content": "And times 3?"},
            {"role": "assistant", "content": "4 * 3 = 12."},
            {"role": "user", "content": "Minus 5?"},
        ],
        {"add_generation_prompt": True, "enable_thinking": False},
    ),
    "think-in-history-is-dropped": (
        [
            USER,
            {"role": "assistant", "content": "<think>\nAdd two and two.\n</think>\n\n4."},
            {"role": "user", "content": "Sure?"},
        ],
        {"add_generation_prompt": True},
    ),
    "think-in-last-turn-is-kept": (
        [USER, {"role": "assistant", "content": "<think>\n2 and 2 make 4.\n</think>\n\n4"}],
        {},
    ),
    "reasoning-content-field": (
        [USER, {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"}],
        {},
    ),
    "thinking-field-alias": (
        [USER, {"role": "assistant", "content": "4", "thinking": "count up"}],
        {},
    ),
    "unicode": (
        [
            {"role": "system", "content": "Réponds en français — ou en 日本語. ✓"},
            {
                "role": "user",
                "content": "数学の問題：½ + ¼ = ? 🙂🧮 Ünïcödé, עברית, Ελληνικά, e\u0301, "
                "\\frac{1}{2}",
            },
        ],
        {"add_generation_prompt": True, "enable_thinking": False},
    ),
    "special-token-text-in-content": (
        [{"role": "user", "content": "Say <|im_end|> then <think>x</think> and <|endoftext|>."}],
        {"add_generation_prompt": True},
    ),
    "second-system-message": (
        [USER, {"role": "system", "content": "New rule: answer in words."}, USER],
        {"add_generation_prompt": True},
    ),
    "whitespace-edges": (
        [{"role": "user", "content": "\n\n  padded question  \n"}],
        {"add_generation_prompt": True},
    ),
    "none-values-dropped": (
        [
            {"role": "user", "content": "Hi", "name": None},
            {"role": "assistant", "content": "Hey", "tool_calls": None},
        ],
        {},
    ),
    "tools-and-tool-calls": (
        [
            {"role": "user", "content": "Convert 10 euros to yen."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "convert_currency",
                            "arguments": {"amount": 10, "to": "JPY"},
                        },
                    }
                ],
            },
            {"role": "tool", "content": '{"yen": 1620}'},
            {"role": "tool", "content": '{"rate": 162.0}'},
        ],
        {"add_generation_prompt": True, "tools": [TOOL]},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_rendering_equals_transformers(both, name):
    ours, theirs = both
    messages, kwargs = CONVERSATIONS[name]
    text = ours.apply_chat_template(messages, **kwargs)
    assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = ours.apply_chat_template(messages, tokenize=True, **kwargs)
    assert ids == theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert ids == ours.encode(text)
    # Qwen's tokenizer normalizes to NFC ("e" + U+0301 -> "é"); otherwise decoding is exact
    assert ours.decode(ids, skip_special=False) == unicodedata.normalize("NFC", text)


@pytest.mark.slow
def test_the_conversations_cover_what_matters(both):
    """Guards the list above against losing what it is for (each must change the rendering)."""
    ours, _ = both
    render = {n: ours.apply_chat_template(m, **k) for n, (m, k) in CONVERSATIONS.items()}
    distinct = {text for name, text in render.items() if name != "user-thinking-on"}
    assert len(render) >= 10 and len(distinct) == len(render) - 1
    assert render["user-thinking-off"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render["user-thinking-on"] == render["user-thinking-default"]
    assert "Add two" not in render["think-in-history-is-dropped"]
    assert "<think>\n2 and 2 make 4.\n</think>" in render["think-in-last-turn-is-kept"]
    assert "<think>\n2+2=4\n</think>" in render["reasoning-content-field"]
    assert '"Convertit un montant — 換算する"' in render["tools-and-tool-calls"]  # tojson keeps it
    assert '{"amount": 10, "to": "JPY"}' in render["tools-and-tool-calls"]
    ids = ours.apply_chat_template(
        *CONVERSATIONS["special-token-text-in-content"][:1], tokenize=True
    )
    assert (
        ids.count(IM_END) == 2 and ENDOFTEXT in ids
    )  # read as special tokens, as transformers does


@pytest.mark.slow
def test_task_prompts_render_like_transformers(both, tmp_path):
    ours, theirs = both
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text(
        json.dumps({"question": "Tom has 3 cats. 2 more? 猫", "answer": "#### 5"}) + "\n"
    )
    math = tmp_path / "math.jsonl"
    math.write_text(
        json.dumps({"problem": "Simplify $\\frac{6}{8}$.", "solution": "\\boxed{\\frac34}"}) + "\n"
    )
    for task in (
        load_gsm8k(gsm),
        load_gsm8k(gsm, system_prompt="Think, then answer.", enable_thinking=False),
        load_math(math, instruction=None, enable_thinking=True),
    ):
        ex = task.examples[0]
        kwargs = {"add_generation_prompt": True, **task.chat.template_kwargs}
        text = ours.apply_chat_template(ex.messages, **kwargs)
        assert text == theirs.apply_chat_template(list(ex.messages), tokenize=False, **kwargs)
        assert ex.prompt in text and text.endswith(
            "<|im_start|>assistant\n"
            + ("<think>\n\n</think>\n\n" if task.chat.enable_thinking is False else "")
        )
        # what the trainer feeds the policy: those ids, left-padded
        want = theirs.apply_chat_template(list(ex.messages), tokenize=True, **kwargs)
        want = list(want["input_ids"]) if isinstance(want, Mapping) else list(want)
        prompts, mask = data.encode_prompts(ours, [ex], len(want) + 3, task.chat.template_kwargs)
        assert prompts[0, 3:].tolist() == want and mask[0].tolist() == [False] * 3 + [True] * len(
            want
        )
        assert (prompts[0, :3] == ours.pad_id).all()


@pytest.mark.slow
def test_eos_and_pad_ids(qwen3, both, tmp_path):
    """Qwen3 stops on <|im_end|> and <|endoftext|> (generation_config.json), <|im_end|> first:
    the tokenizer config's eos_token, what transformers calls eos_token_id."""
    ours, theirs = both
    assert ours.eos_ids == (IM_END, ENDOFTEXT) and ours.eos_id == IM_END == theirs.eos_token_id
    assert list(ours.eos_ids) == transformers.GenerationConfig.from_pretrained(qwen3).eos_token_id
    assert ours.pad_id == ENDOFTEXT == theirs.pad_token_id
    assert ours.vocab_size == len(theirs) == 151669  # 151,643 BPE tokens + 26 added
    bare = HFTokenizer(_tokenizer_dir(tmp_path / "bare", generation=False))
    assert (bare.eos_ids, bare.pad_id) == ((IM_END,), ENDOFTEXT)  # tokenizer_config.json alone


@pytest.mark.slow
def test_chat_template_jinja_file_wins(qwen3, tmp_path):
    """chat_template.jinja beats tokenizer_config.json in both libraries. The template puts
    block tags on their own indented lines, so trim_blocks / lstrip_blocks decide the output
    (Qwen3's own template uses {%- -%} everywhere and would not notice them)."""
    folder = Path(shutil.copytree(qwen3, tmp_path / "ckpt"))
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}\n"
        "    [{{ m.role }}] {{ m.content | trim }}\n"
        "  {% endfor %}\n"
        "{% generation %}\n"
        "  {% if add_generation_prompt %}[assistant]{% endif %}\n"
        "{% endgeneration %}\n"
        "{{ eos_token }}\n"
    )
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    text = HFTokenizer(folder).apply_chat_template(messages, add_generation_prompt=True)
    assert text == "    [user] hi\n    [assistant] yo\n[assistant]<|im_end|>"
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
def test_named_template_list_and_missing_template(qwen3, tmp_path):
    folder = Path(shutil.copytree(qwen3, tmp_path / "named"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ messages[0].content }}!"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert HFTokenizer(folder).apply_chat_template([USER]) == "What is 2+2?!"
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"without a string 'default' one \(names: \['tool_use'\]\)"
    ):
        HFTokenizer(folder)
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template is None and theirs.chat_template is None
    assert tok.encode("héllo 世界") == theirs.encode("héllo 世界", add_special_tokens=False)
    with pytest.raises(
        CheckpointError, match=rf"{folder} has no chat template: put one in tokenizer_config"
    ):
        tok.apply_chat_template([USER])


@pytest.mark.slow
def test_template_errors_name_the_template(qwen3, tmp_path):
    folder = Path(shutil.copytree(qwen3, tmp_path / "errors"))
    jinja = folder / "chat_template.jinja"
    jinja.write_text(
        "{% if messages[0].role != 'system' %}{{ raise_exception('System first!') }}{% endif %}"
    )
    with pytest.raises(
        ValueError, match=rf"chat template in {jinja} rejected the messages: System first!"
    ):
        HFTokenizer(folder).apply_chat_template([USER])
    jinja.write_text("line one\n{% for m in messages %}{{ m.content }")
    with pytest.raises(
        CheckpointError, match=rf"{jinja} is not valid Jinja: .*\(template line 2\)"
    ):
        HFTokenizer(folder).apply_chat_template([USER])
    tok = HFTokenizer(folder)
    for bad, message in [
        ([], "messages must be a non-empty list"),
        (USER, "messages must be a non-empty list"),
        ([{"content": "no role"}], "message 0 must be a dict with a string 'role'"),
    ]:
        with pytest.raises(ValueError, match=message):
            tok.apply_chat_template(bad)


def test_sandbox_and_helpers():
    """The environment is transformers': sandboxed, trim/lstrip blocks, loop controls, tojson
    without HTML escaping, strftime_now."""
    import jinja2.exceptions

    render = render_chat_template
    msgs = [{"role": "user", "content": "<b>&</b>"}]
    assert render("{{ messages[0] | tojson }}", msgs) == '{"role": "user", "content": "<b>&</b>"}'
    assert render("  {% if true %}\nx\n{% endif %}\n", msgs) == "x\n"
    assert (
        render(
            "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}", msgs
        )
        == "01"
    )
    assert render("{{ strftime_now('%Y') | length }}", msgs) == "4"
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{{ messages.__class__.__mro__ }}", msgs)
    with pytest.raises(
        jinja2.exceptions.SecurityError
    ):  # immutable: templates cannot mutate inputs
        render("{{ messages.append(1) }}", msgs)
    with pytest.raises(TypeError, match="message 0 holds a value of type object"):
        render("x", [{"role": "user", "content": object()}])
