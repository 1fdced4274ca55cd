"""A local server's completion-token settings, checked together: the tokens a request that
names no ``max_tokens`` decodes (the default) and the most one request may ask for (the limit).

Torch-free on purpose: a backend checks them before it loads anything, and they are tested
where the model stack is not installed.
"""

from __future__ import annotations


def completion_token_default(
    default_max_tokens: int | None, max_tokens_limit: int | None, *, fallback: int
) -> int:
    """The tokens a request that names no ``max_tokens`` decodes: `default_max_tokens` if
    given, else `fallback` held to the limit (None: no limit but the model's context).

    Raises ValueError, saying what to pass instead, for a limit below 1, a default below 1,
    or a default given above the limit (a request without ``max_tokens`` would decode past
    the limit every request is held to).
    """
    if max_tokens_limit is not None and max_tokens_limit < 1:
        raise ValueError("max_tokens_limit must be >= 1 (or None: the context length)")
    if default_max_tokens is None:
        return fallback if max_tokens_limit is None else min(fallback, max_tokens_limit)
    if default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
    if max_tokens_limit is not None and default_max_tokens > max_tokens_limit:
        raise ValueError(
            f"default_max_tokens={default_max_tokens} is above max_tokens_limit="
            f"{max_tokens_limit}: a request that names no max_tokens would decode "
            f"{default_max_tokens} tokens, past the limit every request is held to. Pass "
            f"default_max_tokens <= {max_tokens_limit}, or max_tokens_limit >= "
            f"{default_max_tokens} (or None: the model's context)."
        )
    return default_max_tokens


def default_completion_tokens(
    default_max_tokens: int, max_tokens_limit: int | None, room: int
) -> int:
    """Tokens a request that names no ``max_tokens`` may decode: the default, held to the
    limit like any request, and to the `room` its prompt leaves in the context."""
    budget = min(default_max_tokens, room)
    return budget if max_tokens_limit is None else min(budget, max_tokens_limit)
