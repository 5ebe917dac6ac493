"""Chat prompts: how a task's question becomes messages, and how a chat template renders them.

An instruction-tuned model is not prompted with the bare question. RL recipes build a short
conversation and render it with the checkpoint's chat template, ending in the assistant header
(``add_generation_prompt=True``) so that the model answers as the assistant:

* verl (``examples/data_preprocess/gsm8k.py``, ``math_dataset.py``): no system message and one
  user message, ``question + " " + instruction``, with the instructions
  ``Let's think step by step and output the final answer after "####".`` (GSM8K) and
  ``Let's think step by step and output the final answer within \\boxed{}.`` (MATH);
* TRL (``examples/scripts/async_grpo.py``, Qwen3-0.6B on GSM8K): one user message holding the
  bare question, rendered with ``chat_template_kwargs={"enable_thinking": False}``; its GSPO
  example (``examples/scripts/gspo.py``) adds a system prompt that asks for ``<think>`` tags.

:class:`ChatFormat` holds those three choices (system prompt, instruction, thinking switch) and
turns a question into messages: ``({"role": "system", ...}, {"role": "user", ...})``.

:func:`render_chat_template` renders a Jinja chat template as `transformers` does
(``transformers/utils/chat_template_utils.py``: ``_cached_compile_jinja_template`` and
``render_jinja_template``): an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII
characters (Jinja's own escapes HTML), and the globals ``raise_exception`` and
``strftime_now``; the template sees ``messages``, ``tools``, ``documents``,
``add_generation_prompt`` and any further variables (the tokenizer's special tokens, switches
such as ``enable_thinking``). Messages are normalized as `transformers` normalizes them: keys
whose value is None are dropped and a message's reasoning, given as ``reasoning_content``,
``thinking`` or ``reasoning``, is offered under the first two names. Simplifications: a
``{% generation %}`` block renders as its body (no assistant-token mask is computed), and a
value in a message that is not JSON-like (str, number, bool, None, list, tuple, dict) is a
``TypeError`` instead of a placeholder string.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = ["ChatFormat", "compile_chat_template", "render_chat_template"]

# A message's reasoning may come under any of these names; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatFormat:
    """How a question becomes a chat prompt.

    Attributes:
      system_prompt: content of a leading system message; None or "" for no system message.
      instruction: appended to the question after one space (verl's convention); None or ""
        for the bare question.
      enable_thinking: passed to the chat template as ``enable_thinking`` (Qwen3's switch:
        False makes the generation prompt end in an empty ``<think>\\n\\n</think>\\n\\n``);
        None passes nothing, so the template's default applies (thinking on, for Qwen3).

    >>> fmt = ChatFormat(instruction="Answer in \\\\boxed{}.", enable_thinking=False)
    >>> fmt.messages("What is 2+2?")
    ({'role': 'user', 'content': 'What is 2+2? Answer in \\\\boxed{}.'},)
    >>> fmt.template_kwargs
    {'enable_thinking': False}
    """

    system_prompt: str | None = None
    instruction: str | None = None
    enable_thinking: bool | None = None

    def __post_init__(self):
        for field in ("system_prompt", "instruction"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{field} must be a string or None, got {value!r}")
        if self.enable_thinking is not None and not isinstance(self.enable_thinking, bool):
            raise TypeError(
                f"enable_thinking must be true, false or null (the template's default), got "
                f"{self.enable_thinking!r}"
            )

    def user_content(self, question: str) -> str:
        """The user message: ``question``, then a space and the instruction if there is one."""
        return f"{question} {self.instruction}" if self.instruction else question

    def messages(self, question: str) -> tuple[dict[str, str], ...]:
        """The conversation for ``question``: an optional system message, then the user's."""
        system = ({"role": "system", "content": self.system_prompt},) if self.system_prompt else ()
        return (*system, {"role": "user", "content": self.user_content(question)})

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template (``enable_thinking`` when it is set)."""
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    **variables: Any,
) -> str:
    """``template`` rendered for ``messages``, exactly as `transformers` renders it.

    ``variables`` are further template variables: the tokenizer's special tokens
    (``eos_token``, ...), ``enable_thinking``, ``tools`` (a list of JSON schemas), ...
    Raises ValueError for an empty conversation or a message without a string ``role``,
    TypeError for a value that is not JSON-like, and `jinja2.TemplateError` for what the
    template itself rejects (``raise_exception``) or a syntax error.

    >>> render_chat_template(
    ...     "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    ...     "{% if add_generation_prompt %}<assistant>{% endif %}",
    ...     [{"role": "user", "content": "hi", "name": None}], add_generation_prompt=True)
    '<user>hi<assistant>'
    """
    if isinstance(messages, Mapping | str) or len(messages) == 0:
        raise ValueError(
            "messages must be a non-empty list of {'role': ..., 'content': ...} dicts, got "
            f"{messages!r:.200}"
        )
    chat = [_message(m, i) for i, m in enumerate(messages)]
    context = {"tools": None, "documents": None, **_plain(variables, "template variable")}
    return compile_chat_template(template).render(
        messages=chat, add_generation_prompt=add_generation_prompt, **context
    )


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str):
    """The compiled `jinja2.Template` (cached per template text); a syntax error raises
    `jinja2.TemplateSyntaxError` with the template's line number."""
    return _environment().from_string(template)


@functools.cache
def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %} ... {% endgeneration %}``: transformers' marker for assistant
        tokens, rendered here as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _message(message: Any, index: int) -> dict[str, Any]:
    """One message as plain data: None-valued keys dropped, reasoning offered under
    ``reasoning_content`` and ``thinking`` (transformers' ``_alias_reasoning_fields``)."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(
            f"message {index} must be a dict with a string 'role' (and usually 'content'), "
            f"got {message!r:.200}"
        )
    plain = {k: v for k, v in _plain(message, f"message {index}").items() if v is not None}
    reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _plain(value: Any, where: str) -> Any:
    """``value`` rebuilt from JSON-like types only (what a sandboxed template may see); a
    subclass (a str enum, a numpy float) becomes its base type, a namedtuple a tuple."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v, where) for v in value)
    raise TypeError(
        f"{where} holds a value of type {type(value).__name__}; chat templates see only "
        "strings, numbers, booleans, None, lists and dicts"
    )
