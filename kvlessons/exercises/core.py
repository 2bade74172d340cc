"""What every checker shares: the verdict it returns, numeric questions with known wrong answers and tiered hints, and reading a learner's value leniently."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Feedback:
    """A checker's verdict; shows as its message in a notebook."""

    correct: bool
    message: str

    def __repr__(self) -> str:
        return self.message

    def __bool__(self) -> bool:
        return self.correct  # so `assert exercises.check_...(...)` fails on a wrong answer


@dataclass
class NumericExercise:
    """A question with one numeric answer, known wrong answers with their diagnosis, and tiered hints."""

    name: str
    question: str
    answer: float
    unit: str
    explanation: str
    mistakes: list[tuple[float, str]] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    rel_tol: float = 0.005

    def _close(self, a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=self.rel_tol, abs_tol=1e-9)

    def check(self, value) -> Feedback:
        """Feedback on ``value``: correct, a named mistake with a hint, or a first hint.

        Plain numbers, NumPy scalars and one-element tensors are read as numbers; anything
        else is explained, never raised on.
        """
        if not isinstance(value, (bool, int, float, str)) and as_number(value) is not None:
            value = as_number(value)  # a NumPy scalar or a one-element tensor
        if isinstance(value, str):
            return Feedback(False, f"Expected a number ({self.unit}), got the text {value!r}: remove the quotes.")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return Feedback(False, f"Expected a number ({self.unit}), got {value!r}. Replace the None (or ...) with your answer.")
        if self._close(value, self.answer):
            return Feedback(True, f"Correct: {self.explanation}")
        for wrong, diagnosis in self.mistakes:
            if self._close(value, wrong):
                return Feedback(False, f"Not quite: {_shown(value)} {self.unit}. {diagnosis}")
        shown = _shown(value)
        return Feedback(False, f"Not {shown} {self.unit}. Hint: {self.hints[0]}" if self.hints else f"Not {shown}.")

    def hint(self, level: int = 1) -> str:
        """Hint number ``level`` (1 = gentlest); the last one works the answer out."""
        if not self.hints:
            return "No hints for this one."
        level = min(max(int(level), 1), len(self.hints))
        return f"Hint {level}/{len(self.hints)}: {self.hints[level - 1]}"


def _shown(value: float) -> str:
    """A learner's number as they would write it: whole numbers in full with thousands separators, others as %g."""
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{value:,.0f}"
    return f"{value:g}"


def as_list(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.reshape(-1).tolist()
    return list(x)


def as_number(value) -> float | None:
    """``value`` as a float if it is one number (int, float, NumPy scalar, one-element tensor), else None."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def as_int(value) -> int | None:
    """``value`` as an int if it is an integer (Python, NumPy, 0-d integer tensor), else None; True is no integer here."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_ints(values) -> list[int] | None:
    """``values`` (a list, tuple, bytes, NumPy array or tensor of integers) as a list of ints, else None."""
    if values is None or isinstance(values, str):
        return None
    if isinstance(values, (bytes, bytearray)):
        return list(values)
    try:
        items = [as_int(v) for v in as_list(values)]  # ints and NumPy ints; not floats, not bools
    except TypeError:
        return None
    return None if None in items else items


def describe_error(err: BaseException) -> str:
    """What a learner's exception says, in a sentence; a stub's NotImplementedError is named as such."""
    if isinstance(err, NotImplementedError):
        return "NotImplementedError: it is still the stub. Write its body, run that cell, then this check again."
    return f"{type(err).__name__}: {str(err).rstrip('.')}."


def raised(call: str, err: BaseException, hint: str) -> Feedback:
    """Feedback for a learner's function that raised when the checker called it as ``call``."""
    return Feedback(False, f"{call} raised {describe_error(err)} Hint: {hint}")


def check_parts(*parts) -> Feedback:
    """One verdict for an exercise with several numeric answers: ``(label, NumericExercise, value)`` each,
    one line of feedback per part, correct only if every part is."""
    verdicts = [(label, exercise.check(value)) for label, exercise, value in parts]
    return Feedback(all(fb.correct for _, fb in verdicts), "\n".join(f"{label}: {fb.message}" for label, fb in verdicts))
