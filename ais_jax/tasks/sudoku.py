"""4x4 Sudoku (2x2 boxes): fill the blanks so every row, column and box holds 1-4.

Prompt and reference response, rows separated by ``|``::

    1.34|34.2|2.43|.3.1=      (prompt: 16 cells, '.' for a blank, then '=')
    1234|3412|2143|4321       (demonstration: the solution)

A puzzle is made by filling a grid at random (randomized backtracking) and then blanking cells
in random order, keeping a blank only if the puzzle still has exactly one solution (checked by
the same small solver); if that greedy pass cannot reach ``n_blank`` blanks a new grid is drawn.
The minimum number of clues for a unique 4x4 Sudoku is 4, so ``n_blank`` is at most 12.

Reward: the fraction of the originally blank cells whose digit matches the (unique) solution,
so partial credit is dense. Because the solution is unique, matching it is the same as the
completed grid obeying the rules; per-cell matching is simply the cheaper, denser check. The
answer is the *last non-empty line* of the response with ``|`` and spaces removed; it must be
exactly 16 digits from 1-4, else the reward is 0.0. Given cells are not scored: a response
that changes a given earns nothing for it and loses nothing for it.

This is d1's 4x4 Sudoku reward (diffu-GRPO's ``sudoku_reward_func``: the fraction of the
puzzle's empty cells whose digit matches the solution) with two departures, both about finding
the answer: d1 reads the last ``<answer>...</answer>`` span (our prompts have no tags; we read
the last non-empty line), keeps only its digits and pads or cuts them to 16, so a short or long
answer is still scored cell by cell; we require exactly 16 digits from 1-4 (``|`` and spaces
removed) and score anything else 0.0.
"""

from __future__ import annotations

import dataclasses
import random
from typing import ClassVar

from ais_jax.tasks.base import Example

__all__ = ["Sudoku", "count_solutions"]

SIZE = 4
MAX_BLANK = 12
_MAX_TRIES = 1000
_DIGITS = "1234"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sudoku:
    """4x4 Sudoku puzzles with ``n_blank`` blank cells and a unique solution."""

    name: ClassVar[str] = "sudoku"

    n_blank: int = 6

    def __post_init__(self):
        if not 1 <= self.n_blank <= MAX_BLANK:
            raise ValueError(f"n_blank must be in [1, {MAX_BLANK}], got {self.n_blank}")

    def sample(self, rng: random.Random) -> Example:
        for _ in range(_MAX_TRIES):
            solution = _random_grid(rng)
            puzzle = list(solution)
            order = list(range(SIZE * SIZE))
            rng.shuffle(order)
            blanks = 0
            for cell in order:
                if blanks == self.n_blank:
                    break
                puzzle[cell] = 0
                if count_solutions(puzzle, limit=2) == 1:
                    blanks += 1
                else:
                    puzzle[cell] = solution[cell]
            if blanks == self.n_blank:
                break
        else:
            raise RuntimeError(f"no unique puzzle with {self.n_blank} blanks in {_MAX_TRIES} tries")
        return Example(
            prompt=_render(puzzle) + "=",
            answer="".join(map(str, solution)),
            demonstration=_render(solution),
        )

    def reward(self, example: Example, response: str) -> float:
        cells = example.prompt.removesuffix("=").replace("|", "")
        blanks = [i for i, c in enumerate(cells) if c == "."]
        lines = [line for line in response.splitlines() if line.strip()]
        filled = "".join(lines[-1].split()).replace("|", "") if lines else ""
        if len(filled) != SIZE * SIZE or any(c not in _DIGITS for c in filled):
            return 0.0
        return sum(filled[i] == example.answer[i] for i in blanks) / len(blanks)


def count_solutions(grid: list[int], *, limit: int = 2) -> int:
    """Number of ways to complete ``grid`` (row-major, 0 = blank), counting at most ``limit``.

    >>> count_solutions([1, 2, 3, 4, 3, 4, 1, 2, 2, 1, 4, 3, 4, 3, 2, 1])
    1
    >>> count_solutions([0] * 16, limit=1000)
    288
    """
    grid = list(grid)
    return _count(grid, limit)


def _count(grid: list[int], limit: int) -> int:
    if 0 not in grid:
        return 1
    cell = grid.index(0)
    total = 0
    for digit in _candidates(grid, cell):
        grid[cell] = digit
        total += _count(grid, limit - total)
        grid[cell] = 0
        if total >= limit:
            break
    return total


def _candidates(grid: list[int], cell: int) -> list[int]:
    row, col = divmod(cell, SIZE)
    box_row, box_col = row - row % 2, col - col % 2
    seen = {grid[row * SIZE + c] for c in range(SIZE)}
    seen |= {grid[r * SIZE + col] for r in range(SIZE)}
    seen |= {grid[r * SIZE + c] for r in (box_row, box_row + 1) for c in (box_col, box_col + 1)}
    return [d for d in range(1, SIZE + 1) if d not in seen]


def _random_grid(rng: random.Random) -> list[int]:
    """A random complete grid: shuffled digits at each backtracking step (not exactly uniform)."""
    grid = [0] * (SIZE * SIZE)

    def fill(cell: int) -> bool:
        if cell == len(grid):
            return True
        digits = _candidates(grid, cell)
        rng.shuffle(digits)
        for digit in digits:
            grid[cell] = digit
            if fill(cell + 1):
                return True
        grid[cell] = 0
        return False

    fill(0)
    return grid


def _render(grid: list[int]) -> str:
    cells = "".join(str(d) if d else "." for d in grid)
    return "|".join(cells[r * SIZE : (r + 1) * SIZE] for r in range(SIZE))
