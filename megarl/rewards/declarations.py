"""What a reward function declares about itself: the ground-truth fields it reads, and how an
answer is read out of a response (for majority voting).

**Required fields.**  A reward may set ``required_fields``: a tuple whose items are a field name
(the row must carry it, not null) or a tuple of names (the row must carry at least one of them,
e.g. ``code_exec``'s ``tests`` or ``asserts``).  The builtins declare theirs, honouring their
``answer_key`` kwarg; a composite's fields are the union of its parts'; a user plug-in declares
its own by a ``required_fields`` attribute on the function or class (or the instance).  A reward
that declares nothing reads nothing the start-up check can verify; ``reward.required_fields``
in the config declares (or overrides) the fields for any reward.

**Answers.**  :func:`extract_answer` is what ``maj@k`` votes over: the reward's own parsed
answer when it has an ``extract_answer(text)`` method (the number ``exact_numeric`` compares,
the integer ``arithmetic`` compares, the last ``\\boxed{}`` for ``math_verify``), else the
response text with its whitespace collapsed.  A composite uses its first part that extracts.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

from megarl.rewards.base import AnswerExtracting, FieldDeclaring, reward_identity

__all__ = ["Requirement", "required_fields", "normalise_requirements", "describe_requirement", "extract_answer",
           "extractor", "normalised_text", "union_of", "component_checks"]

#: one requirement: a field name, or a tuple of names of which at least one must be present
Requirement = Union[str, Tuple[str, ...]]


def normalise_requirements(value: Any, where: str) -> Tuple[Requirement, ...]:
    """``value`` (a list of names / lists of names) as a tuple of requirements; raises
    RewardConfigError naming ``where`` for anything else."""
    from megarl.rewards.base import RewardConfigError

    if isinstance(value, str) or not isinstance(value, Sequence):
        raise RewardConfigError(f"{where} must be a list of field names, got {value!r}")
    out: list = []
    for item in value:
        if isinstance(item, str) and item:
            req: Requirement = item
        elif isinstance(item, Sequence) and not isinstance(item, str) and item and all(
                isinstance(x, str) and x for x in item):
            req = tuple(item) if len(item) > 1 else item[0]
        else:
            raise RewardConfigError(f"{where}: {item!r} is not a field name (or a list of alternative names)")
        if req not in out:
            out.append(req)
    return tuple(out)


def required_fields(fn: Any) -> Optional[Tuple[Requirement, ...]]:
    """The fields ``fn`` declares it reads (None: it declares nothing).  A composite unions its
    parts' declarations (None only when no part declares anything)."""
    declared = fn.required_fields if isinstance(fn, FieldDeclaring) else None
    if callable(declared):
        declared = declared()
    if declared is None:
        return None
    return normalise_requirements(declared, f"{reward_identity(fn)[0]}.required_fields")


def describe_requirement(req: Requirement) -> str:
    return repr(req) if isinstance(req, str) else "one of " + ", ".join(repr(r) for r in req)


def normalised_text(text: str) -> str:
    """The response text with runs of whitespace collapsed to one space and the ends stripped."""
    return " ".join(str(text).split())


def union_of(declarations: Sequence[Optional[Tuple[Requirement, ...]]]) -> Optional[Tuple[Requirement, ...]]:
    """The union of several declarations in order (None when none of them declares anything)."""
    if all(d is None for d in declarations):
        return None
    out: list = []
    for d in declarations:
        for req in d or ():
            if req not in out:
                out.append(req)
    return tuple(out)


def extract_answer(fn: Any, text: str) -> Optional[str]:
    """The answer ``fn`` reads in ``text`` (see the module docstring); None when the reward's own
    parser finds no answer."""
    ex = extractor(fn)
    return normalised_text(text) if ex is None else ex(text)


def extractor(fn: Any):
    """``fn``'s own ``extract_answer`` (or its wrapped callable's), else None."""
    return fn.extract_answer if isinstance(fn, AnswerExtracting) else None


def component_checks(fn) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """``(format components, answer components)``: the record components of ``fn`` whose score
    says a response has the right form (``checks = "format"``: ``regex``) or the right answer
    (``checks = "answer"``: the verifiers, ``code_exec``), by component name.  A composite's
    parts name its components; a plug-in declares by a ``checks`` attribute."""
    parts = getattr(fn, "parts", None)
    if parts is None:
        kind, name = getattr(fn, "checks", None), getattr(fn, "name", "")
        return ((name,) if kind == "format" else (), (name,) if kind == "answer" else ())
    fmt, ans = [], []
    for pname, _, part in parts:
        kind = getattr(part, "checks", None)
        if kind == "format":
            fmt.append(pname)
        elif kind == "answer":
            ans.append(pname)
    return tuple(fmt), tuple(ans)

