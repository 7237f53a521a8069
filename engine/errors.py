"""Errors a user can act on: a bad config, or a rank that failed."""
from __future__ import annotations


def shown_value(value: object, limit: int = 1000) -> str:
    """repr() of a config value, shortened (an int of over 4,300 digits cannot even be repr'd)."""
    try:
        text = repr(value)
    except ValueError:
        return f"<{type(value).__name__} too large to print>"
    return text if len(text) <= limit else text[:limit] + "…"


class ConfigError(ValueError):
    """A config value breaks a rule. The message names the field, the value and the rule."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        self.field, self.value, self.rule = field, value, rule
        super().__init__(f"{field}={shown_value(value)}: {rule}")


class ConfigErrors(ConfigError):
    """Several config errors found at once; the message lists every one."""

    def __init__(self, errors: list[ConfigError]) -> None:
        self.errors = errors
        first = errors[0]
        ValueError.__init__(self, "\n".join(str(e) for e in errors))
        self.field, self.value, self.rule = first.field, first.value, first.rule


class RankFailure(RuntimeError):
    """A rank of a run failed; carries the rank number and its traceback."""

    def __init__(self, rank: int | None, reason: str, traceback: str = "") -> None:
        self.rank, self.reason, self.traceback = rank, reason, traceback
        where = f"rank {rank}" if rank is not None else "the run"  # a timeout or a store failure: no one rank
        msg = f"{where} failed: {reason}"
        if traceback:
            msg += f"\n--- traceback of {where} ---\n{traceback.rstrip()}"
        super().__init__(msg)


class JoinTimeout(RankFailure):
    """Not every node of a multi-node run joined the rendezvous in time: no rank ran (a setup error)."""
