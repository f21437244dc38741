"""Any pydantic model as a command line: flags > ``PDSERVE_*`` env > a TOML file.

:func:`load_config` turns any pydantic model into a command line: every field becomes
``--field-name`` (bools ``--flag/--no-flag``), plus ``--config PATH``. Precedence, highest
first: CLI flags, ``PDSERVE_<FIELD_NAME>`` environment variables, the TOML file (a
``[<command>]`` table overrides its top-level keys), the model's defaults.

One rule for options only some commands use (a field's ``json_schema_extra={USED_BY: (...)}``
names them, e.g. ``--kv-port`` for prefill and decode): any other command neither lists nor
accepts them, as a flag, a ``PDSERVE_*`` variable, a top-level TOML key or a key in its own
table. Each is one line naming where the value came from and which commands use it, and exit
status 2; a value that would be silently ignored is never accepted. A bad value prints one line
naming the option and the problem and exits with status 2 too.
"""

from __future__ import annotations

import argparse
import os
import tomllib
import typing
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, TypeVar

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

M = TypeVar("M", bound=BaseModel)
ENV_PREFIX = "PDSERVE_"
# A field's ``json_schema_extra`` key naming the commands that use it (a field without one: every
# command). A command's own TOML table may not set a field it does not use.
USED_BY = "used_by"


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (the full usage is in --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


@dataclass
class _Source:
    """Where a value came from, so an error names what the person actually typed."""

    kind: Literal["cli", "env", "file"]
    detail: str = ""

    def describe(self, field: str) -> str:
        if self.kind == "env":
            return env_name(field)
        if self.kind == "file":
            return f"{field} (in {self.detail})"
        return flag_name(field)


def used_by(info: FieldInfo, command: str) -> bool:
    """Does ``command`` (``serve``, ``prefill``...) read this field?"""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    commands = extra.get(USED_BY)
    return commands is None or command in commands  # type: ignore[operator]


def unused_fields(cls: type[BaseModel], command: str) -> dict[str, FieldInfo]:
    """The fields ``command`` does not read (another command's own options)."""
    return {name: info for name, info in cls.model_fields.items() if not used_by(info, command)}


def _not_used(where: str, prog: str, info: FieldInfo) -> str:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    users = [f"pdserve {c}" for c in extra.get(USED_BY, ())]  # type: ignore[union-attr]
    verb = "uses" if len(users) == 1 else "use"
    return f"{prog}: error: {where} is not used by {prog} (only {' and '.join(users)} {verb} it)\n"


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def load_config(
    cls: type[M],
    argv: list[str] | None,
    prog: str,
    description: str = "",
    *,
    defaults: dict[str, Any] | None = None,
    fixed: dict[str, Any] | None = None,
    env: typing.Mapping[str, str] | None = None,
) -> M:
    """Parse ``argv`` (default ``sys.argv[1:]``) into a validated ``cls``; exit 2 on bad input.

    ``defaults`` replaces field defaults (shown in --help); ``fixed`` sets fields the command
    decides (e.g. the node role) and hides their flags.
    """
    defaults, fixed = defaults or {}, fixed or {}
    env = os.environ if env is None else env
    unused = unused_fields(cls, prog.split()[-1])
    parser = _build_parser(cls, prog, description, defaults, fixed, unused)
    args = vars(parser.parse_args(argv))
    for name in [n for n in unused if n in args]:
        parser.exit(2, _not_used(flag_name(name), prog, unused[name]))
    for name in [n for n in unused if env_name(n) in env]:
        parser.exit(2, _not_used(f"{env_name(name)} (in the environment)", prog, unused[name]))
    values: dict[str, Any] = dict(defaults)
    sources: dict[str, _Source] = {}
    config_path = args.pop("config", None) or env.get(ENV_PREFIX + "CONFIG")
    if config_path:
        for key, value in _read_toml(parser, cls, config_path, prog, fixed).items():
            values[key], sources[key] = value, _Source("file", config_path)
    for name, info in cls.model_fields.items():
        if name not in fixed and env_name(name) in env:
            values[name] = _from_env(env[env_name(name)], info)
            sources[name] = _Source("env")
    for name, value in args.items():
        values[name], sources[name] = value, _Source("cli")
    values.update(fixed)
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        parser.exit(2, f"{prog}: error: {_first_error(cls, exc, sources)}\n")


def fields_given(cls: type[BaseModel], argv: list[str], prog: str, fixed: dict[str, Any] | None = None) -> set[str]:
    """The fields ``argv`` (already accepted by :func:`load_config`) sets, as flags or in its
    ``--config`` file: what a launcher that adds its own flags must not let it set too."""
    fixed = fixed or {}
    parser = _build_parser(cls, prog, "", {}, fixed, unused_fields(cls, prog.split()[-1]))
    given = vars(parser.parse_args(argv))
    path = given.pop("config", None)
    return set(given) | (set(_read_toml(parser, cls, path, prog, fixed)) if path else set())


def _build_parser(
    cls: type[BaseModel], prog: str, description: str, defaults: dict[str, Any], fixed: dict[str, Any],
    unused: dict[str, FieldInfo],
) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description=description, argument_default=argparse.SUPPRESS)
    parser.add_argument(
        "--config",
        metavar="PATH",
        help=f"TOML file of option values (keys are option names with '_'); "
        f"a [{prog.split()[-1]}] table overrides top-level keys. Env: {env_name('config')}",
    )
    for name, info in cls.model_fields.items():
        if name in fixed:
            continue
        default = defaults.get(name, info.get_default(call_default_factory=True))
        shown = "unset" if default is None else default
        help_text = f"{info.description or ''} (default: {shown}; env: {env_name(name)})"
        # another command's option: parsed only to name it in the error, never listed
        kwargs: dict[str, Any] = {"help": argparse.SUPPRESS if name in unused else help_text.replace("%", "%%")}
        if info.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif _is_list(info.annotation):
            kwargs.update(nargs="*", metavar="VALUE")
        else:
            choices = _literal_choices(info.annotation)
            kwargs["metavar"] = "{" + ",".join(choices) + "}" if choices else name.upper()
        parser.add_argument(flag_name(name), dest=name, **kwargs)
    return parser


def _read_toml(
    parser: argparse.ArgumentParser, cls: type[BaseModel], path: str, prog: str, fixed: dict[str, Any]
) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        parser.exit(2, f"{prog}: error: --config: file not found: {path}\n")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        parser.exit(2, f"{prog}: error: --config: cannot read {path}: {exc}\n")
    command = prog.split()[-1]
    section_names = {prog, command}
    unused = unused_fields(cls, command)
    # every table is a command's section (no option is a table): `[proxy]` is not the `proxy` option
    top = {k: v for k, v in data.items() if not isinstance(v, dict)}
    for name in [k for k in top if k in unused]:
        parser.exit(2, _not_used(f"--config: top-level key '{name}' of {path}", prog, unused[name])
                    .replace(" it)", " it; set it in their own tables)"))
    for key, value in data.items():
        if key in section_names and isinstance(value, dict):
            for name in [k for k in value if k in unused]:
                parser.exit(2, _not_used(f"--config: key '{name}' in table [{key}] of {path}", prog, unused[name]))
            top.update(value)
    for key in top:
        if key not in cls.model_fields or key in fixed:
            known = ", ".join(n for n in cls.model_fields if n not in fixed)
            parser.exit(2, f"{prog}: error: --config: unknown key '{key}' in {path} (known: {known})\n")
    return top


def _from_env(raw: str, info: FieldInfo) -> Any:
    if _is_list(info.annotation):
        return [item.strip() for item in raw.split(",") if item.strip()]
    return raw


def _first_error(cls: type[BaseModel], exc: ValidationError, sources: dict[str, _Source]) -> str:
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else ""
    if not field:
        return err["msg"].removeprefix("Value error, ")
    where = sources.get(field, _Source("cli")).describe(field)
    bounds = _bounds(cls.model_fields[field]) if field in cls.model_fields else None
    if err["type"] in ("less_than_equal", "greater_than_equal", "less_than", "greater_than") and bounds:
        problem = bounds
    else:
        problem = err["msg"].removeprefix("Value error, ").replace("Input should", "should")
    got = err.get("input")
    return f"{where}: {problem} (got {got})" if not isinstance(got, dict) else f"{where}: {problem}"


def _bounds(info: FieldInfo) -> str | None:
    """'must be between 1 and 65535' style text from the field's ge/gt/le/lt constraints."""
    lo = hi = None
    for meta in info.metadata:
        if isinstance(meta, annotated_types.Ge):
            lo = (">=", meta.ge)
        elif isinstance(meta, annotated_types.Gt):
            lo = (">", meta.gt)
        elif isinstance(meta, annotated_types.Le):
            hi = ("<=", meta.le)
        elif isinstance(meta, annotated_types.Lt):
            hi = ("<", meta.lt)
    if lo and hi and lo[0] == ">=" and hi[0] == "<=":
        return f"must be between {lo[1]} and {hi[1]}"
    parts = [f"{b[0]} {b[1]}" for b in (lo, hi) if b]
    return "must be " + " and ".join(parts) if parts else None


def _literal_choices(annotation: Any) -> list[str]:
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is Literal:
            return [str(c) for c in typing.get_args(arg)]
    return []


def _is_list(annotation: Any) -> bool:
    return any(typing.get_origin(a) is list for a in (annotation, *typing.get_args(annotation)))
