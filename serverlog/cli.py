"""The two servers' command lines, made from their settings class: one flag per field, each with its help, a
readable metavar, its default and its environment variable.

pydantic-settings' own CLI shows pydantic's types (`SecretStr`, `{Path,null}`) and masks defaults as asterisks,
so the commands use this parser instead. Only the flags given reach the settings class, as init arguments,
which outrank the environment and `.env` as pydantic-settings' CLI did; `null` unsets an optional setting, as
there; a value pydantic refuses is a usage error (exit 2) that names the flag, never the value (it may be a
secret)."""

from __future__ import annotations

import argparse
import textwrap
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr, ValidationError
from pydantic.fields import FieldInfo

import client
from serverlog import redact

NULL = "null"  # the value that unsets an optional setting

_METAVARS: dict[Any, str] = {int: "INT", float: "FLOAT", str: "TEXT", Path: "PATH", SecretStr: "SECRET"}

_SOURCES = (
    "Each flag is also an environment variable (shown with it) and may be a line of a .env file: a flag outranks "
    f"the environment, which outranks .env. `{NULL}` unsets an optional setting."
)

S = TypeVar("S", bound=BaseModel)


def parse(settings_cls: type[S], argv: Sequence[str], *, description: str, exits: str) -> S:
    """The settings from `argv`, the environment and `.env`; `--help` and `--version` print and exit 0, a bad flag
    or value exits 2 with the short usage and one error line, as argparse does."""
    parser = build_parser(settings_cls, description=description, exits=exits)
    given = vars(parser.parse_args(argv))
    try:
        return settings_cls(**given)
    except ValidationError as error:
        parser.error("; ".join(_problem(settings_cls, problem) for problem in error.errors()))


def build_parser(settings_cls: type[BaseModel], *, description: str, exits: str) -> argparse.ArgumentParser:
    config = settings_cls.model_config
    parser = argparse.ArgumentParser(
        prog=str(config.get("cli_prog_name")),
        usage="%(prog)s [-h] [--version] [--FLAG VALUE ...]",
        description=textwrap.fill(description, 79),
        epilog="\n\n".join(textwrap.fill(paragraph, 79) for paragraph in (_SOURCES, exits)),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the epilog's paragraphs apart
        allow_abbrev=False,  # as pydantic-settings: a flag is spelled in full
        argument_default=argparse.SUPPRESS,  # only the flags given reach the settings
    )
    parser.add_argument("--version", action="version", version=f"llmq-redis {client.__version__}")
    for name, field in settings_cls.model_fields.items():
        parser.add_argument(f"--{name.replace('_', '-')}", **_argument(name, field, _env(settings_cls, name)))
    return parser


def _env(settings_cls: type[BaseModel], name: str) -> str:
    return f"{settings_cls.model_config.get('env_prefix', '')}{name}".upper()


def _argument(name: str, field: FieldInfo, env: str) -> dict[str, Any]:
    """`add_argument`'s keywords for one field."""
    kind, optional = _unwrap(field.annotation)
    text = field.description or ""
    default = _default(field)
    facts = f"default: {default}; env {env}" if default is not None else f"env {env}"
    keywords: dict[str, Any] = {"help": f"{text} ({facts})".replace("%", "%%")}
    if kind is bool:
        return keywords | {"action": argparse.BooleanOptionalAction}
    if get_origin(kind) is Literal:
        choices = [str(choice) for choice in get_args(kind)]
        return keywords | {"choices": choices, "metavar": "|".join(choices)}
    metavar = "URL" if name.endswith("_url") else _METAVARS.get(kind, "VALUE")
    return keywords | {"metavar": metavar, "type": _nullable if optional else str}


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (itself, False)."""
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0], len(rest) < len(get_args(annotation))
    return annotation, False


def _nullable(text: str) -> str | None:
    return None if text == NULL else text


def _default(field: FieldInfo) -> str | None:
    """The default as a person reads it; None where it is computed at start (the description says how)."""
    if field.default_factory is not None:
        return None
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, SecretStr):
        shown = value.get_secret_value()
        return shown if redact(shown) == shown else "set"  # a default with a password is not printed
    return str(value)


def _problem(settings_cls: type[BaseModel], problem: Any) -> str:
    """One pydantic error as `--flag (ENV): message`, without the input (it may be a secret)."""
    name = str(problem["loc"][0]) if problem["loc"] else ""
    where = f"--{name.replace('_', '-')} ({_env(settings_cls, name)})" if name else settings_cls.__name__
    return f"{where}: {problem['msg'].removeprefix('Value error, ')}"  # a validator's own words, as the client's
