"""Flags that default to ``VOICE_AGENT_<FLAG>`` variables, with one rule for all of them.

A variable that is unset, empty or only whitespace leaves the flag's own default. Any other
value loses its surrounding whitespace (an env file's trailing space, the newline a secret
read from a file ends with), then is converted with the flag's type and checked against its
choices, as argparse does a command-line value (it does neither for a default); a value it
refuses is a usage error naming the variable (``VOICE_AGENT_PORT='abc' is not a valid
int``), exit status 2.

The variables of a subcommand are read when that subcommand is parsed: a bad
``VOICE_AGENT_PORT`` does not stop ``voice-agent token``.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

ENV_PREFIX = "VOICE_AGENT_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


class EnvError(ValueError):
    """A ``VOICE_AGENT_*`` variable whose value its flag cannot take."""


def number(raw: str) -> float:
    """The type of every float flag: a finite number. ``float`` takes "nan" and "inf", which
    pass every ``<= 0`` check: a timeout of nan fails at once, a turn of inf seconds cannot
    be counted in windows (every microphone offer failed)."""
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"{raw!r} is not a finite number")
    return value


def env_value(env: Mapping[str, str], name: str) -> str | None:
    """``VOICE_AGENT_<name>`` without surrounding whitespace; None when unset, empty or only
    whitespace. Secrets too: a metrics token ``s3cret\\n`` read from a file is ``s3cret``,
    as a client's header presents it (a header cannot carry the newline)."""
    raw = env.get(ENV_PREFIX + name)
    return None if raw is None else raw.strip() or None


def env_bool(env: Mapping[str, str], name: str) -> bool:
    """An on/off variable: 1/true/yes/on or 0/false/no/off (any case); unset is off."""
    raw = env_value(env, name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value not in TRUE + FALSE:
        raise EnvError(f"{ENV_PREFIX}{name}={raw!r} is not one of {', '.join(TRUE + FALSE)}")
    return value in TRUE


def _choices(choices: Iterable[Any]) -> str:
    if isinstance(choices, range) and choices.step == 1 and len(choices) > 1:
        return f"{choices.start}-{choices[-1]}"
    return ", ".join(str(choice) for choice in choices)


def env_default(action: argparse.Action, env: Mapping[str, str], name: str) -> tuple[bool, Any]:
    """(found, value) of ``action``'s variable ``VOICE_AGENT_<name>``, converted and checked
    like a value given on the command line; EnvError naming the variable when refused."""
    if isinstance(action, argparse._StoreTrueAction):
        return env_value(env, name) is not None, env_bool(env, name)
    raw = env_value(env, name)
    if raw is None:
        return False, None
    kind = action.type if callable(action.type) else str
    try:
        value = kind(raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        kind_name = getattr(kind, "__name__", repr(kind))
        raise EnvError(f"{ENV_PREFIX}{name}={raw!r} is not a valid {kind_name}") from None
    if action.choices is not None and value not in action.choices:
        raise EnvError(f"{ENV_PREFIX}{name}={raw!r} is not one of {_choices(action.choices)}")
    return True, value


def env_name(action: argparse.Action) -> str | None:
    """``--opus-input-rate`` -> ``OPUS_INPUT_RATE``; None for a positional argument."""
    long = next((o for o in action.option_strings if o.startswith("--")), None)
    return None if long is None else long[2:].upper().replace("-", "_")


class EnvParser(argparse.ArgumentParser):
    """A subcommand whose flags default to their ``VOICE_AGENT_*`` variables.

    ``env_flags``: the destinations that read the environment (None: every flag but
    ``--help`` and repeatable ones, whose variables the caller reads itself).
    """

    env: Mapping[str, str] = {}
    env_flags: Collection[str] | None = ()

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:
        errors = self._apply_env()
        given = args[0] if args else kwargs.get("args")
        # ``--help`` still shows the help: the variable's error would hide what it asks for.
        if errors and not _asks_help(sys.argv[1:] if given is None else list(given)):
            # argparse's error, without the long usage: no flag was wrong
            self.exit(2, f"{self.prog}: error: {errors[0]}\n")
        return super().parse_known_args(*args, **kwargs)

    def _apply_env(self) -> list[EnvError]:
        """Set each flag's default from its variable; the variables it refused, in order."""
        errors: list[EnvError] = []
        for action in self._actions:
            name = env_name(action)
            if name is None or isinstance(action, argparse._HelpAction | argparse._AppendAction):
                continue
            if self.env_flags is not None and action.dest not in self.env_flags:
                continue
            try:
                found, value = env_default(action, self.env, name)
            except EnvError as exc:
                errors.append(exc)
                continue
            if found:
                action.default = value
        return errors


def unknown_variables(
    parser: argparse.ArgumentParser, env: Mapping[str, str], also: Iterable[str] = ()
) -> list[str]:
    """One line per ``VOICE_AGENT_*`` variable that names none of ``parser``'s flags (nor
    ``also``, the variables read elsewhere), with the nearest flag's variable when one is
    close: a typo (``VOICE_AGENT_MAX_SESION``) was ignored without a word, and the server
    ran with the default the operator meant to change."""
    # A repeatable flag's variable is read by its caller under its own name (``also``):
    # ``VOICE_AGENT_ICE_SERVER`` is not read, ``VOICE_AGENT_ICE_SERVERS`` is.
    known = {
        name
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._AppendAction)
        and (name := env_name(action)) is not None
    }
    known.update(also)
    lines = []
    for variable in sorted(env):
        if not variable.startswith(ENV_PREFIX) or variable[len(ENV_PREFIX) :] in known:
            continue
        line = f"{variable} is not a setting of {parser.prog}; it is ignored"
        near = difflib.get_close_matches(variable[len(ENV_PREFIX) :], known, n=1, cutoff=0.75)
        lines.append(line + (f" (did you mean {ENV_PREFIX}{near[0]}?)" if near else ""))
    return lines


def _asks_help(args: Sequence[str]) -> bool:
    """``-h`` or ``--help`` among the options (not after ``--``)."""
    for arg in args:
        if arg == "--":
            return False
        if arg in ("-h", "--help"):
            return True
    return False
