"""A character-level tokenizer for the synthetic tasks: one token per character.

The synthetic tasks (arithmetic, Countdown, Sudoku) use a tiny alphabet, so a from-scratch
model can use a vocabulary of 78 instead of Qwen's 151k -- small embeddings, fast tests.
The ids are fixed (changing them would silently invalidate checkpoints)::

    0 <pad>   1 <bos>   2 <eos>
    3 '\\n'   4 ' '   5 '#'   6 '('   7 ')'   8 '*'   9 '+'   10 ','   11 '-'   12 '.'
    13 '/'    14-23 '0'-'9'   24 '='   25 '|'   26-51 'A'-'Z'   52-77 'a'-'z'

that is, the three special tokens, then the characters of :data:`CHARACTERS` in order. It has
the interface of the ``tokenizers``-backed wrapper for real checkpoints (`io.hf.HFTokenizer`):
``encode``, ``decode``, ``vocab_size``, ``pad_id``, ``bos_id``, ``eos_id``, ``eos_ids`` and
``chat_template`` (always None here: prompts stay plain text).
``encode`` adds no special tokens; the caller prepends ``bos_id`` / appends ``eos_id``.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Iterable
from typing import ClassVar

__all__ = ["CHARACTERS", "SPECIAL_TOKENS", "CharTokenizer"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
CHARACTERS = "\n #()*+,-./" + string.digits + "=|" + string.ascii_uppercase + string.ascii_lowercase


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """Maps each character of :data:`CHARACTERS` to one id, after three special tokens.

    >>> tok = CharTokenizer()
    >>> tok.encode("47+385=")
    [18, 21, 9, 17, 22, 19, 24]
    >>> tok.decode([tok.bos_id, *tok.encode("432"), tok.eos_id])
    '432'
    """

    pad_id: ClassVar[int] = 0
    bos_id: ClassVar[int] = 1
    eos_id: ClassVar[int] = 2
    eos_ids: ClassVar[tuple[int, ...]] = (2,)  # every id that ends generation, as in HFTokenizer
    vocab_size: ClassVar[int] = len(SPECIAL_TOKENS) + len(CHARACTERS)
    chat_template: ClassVar[None] = None  # prompts are plain text (HFTokenizer may have one)

    _ids: ClassVar[dict[str, int]] = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(CHARACTERS)}

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; raises ValueError naming any character outside the vocabulary."""
        try:
            return [self._ids[c] for c in text]
        except KeyError:
            position, char = next((i, c) for i, c in enumerate(text) if c not in self._ids)
            raise ValueError(
                f"character {char!r} at position {position} of {_preview(text)} is not in the "
                f"vocabulary; allowed: the special tokens and {CHARACTERS!r}"
            ) from None

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """The text of ``ids``; special tokens are dropped, or written as ``<eos>`` etc."""
        pieces = []
        for position, i in enumerate(ids):
            i = int(i)  # accepts numpy / jax integer scalars
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} at position {position} is outside [0, {self.vocab_size})"
                )
            if i < len(SPECIAL_TOKENS):
                if not skip_special:
                    pieces.append(SPECIAL_TOKENS[i])
            else:
                pieces.append(CHARACTERS[i - len(SPECIAL_TOKENS)])
        return "".join(pieces)


def _preview(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
