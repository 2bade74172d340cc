"""Checkers for the lessons' exercises (every lesson, 01 to 11): they say what is wrong, in words, and hint before they tell.

A checker takes the learner's value as an argument (never reads notebook globals),
compares it with the answer computed by kvlessons, and recognises the common wrong
answers by computing them too: forgetting K and V, ignoring GQA, GB for GiB, and so on.

One module per lesson (``lesson02``, ...), on ``core``'s Feedback and NumericExercise;
everything is importable from here: ``from kvlessons import exercises; exercises.check_32k_estimate(...)``.
"""

import importlib
import pkgutil

from .core import Feedback, NumericExercise

# Every lessonNN module's public names (its __all__) are exported here, so a lesson calls
# exercises.check_...(); every NumericExercise among them is reachable by name through hint().
__all__ = ["EXERCISES", "Feedback", "NumericExercise", "hint"]
EXERCISES: dict[str, NumericExercise] = {}
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("lesson")):
    _lesson = importlib.import_module(f"{__name__}.{_module}")
    for _name in _lesson.__all__:
        _value = globals()[_name] = getattr(_lesson, _name)
        __all__.append(_name)
        if isinstance(_value, NumericExercise):
            EXERCISES[_value.name] = _value


def hint(name: str, level: int = 1) -> str:
    """Hint ``level`` for the exercise called ``name`` (e.g. hint('kv_32k', 2))."""
    if name not in EXERCISES:
        raise ValueError(f"name must be one of {', '.join(EXERCISES)}; got {name!r}")
    return EXERCISES[name].hint(level)
