"""Finding the error a test expects inside the exception groups task groups raise."""

from __future__ import annotations


def find_leaf(exc: BaseException, kind: type[BaseException]) -> tuple[BaseException, list[str]]:
    """The first `kind` leaf inside `exc`'s groups, with every note on the way to it."""
    notes = list(getattr(exc, "__notes__", []))
    if isinstance(exc, kind):
        return exc, notes
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            try:
                leaf, more = find_leaf(sub, kind)
            except LookupError:
                continue
            return leaf, notes + more
    raise LookupError(f"no {kind.__name__} in {exc!r}")
