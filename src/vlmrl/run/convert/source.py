"""Reading a converter's input: a YAML config, a launch script (its ``torchrun`` / ``accelerate launch`` / ``swift rlhf``
line, or EasyR1's OmegaConf ``config=x.yaml a.b=c`` line, shell variables filled in), or those arguments themselves.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from vlmrl.config import ConfigError


def read_source(args: list[str]) -> dict[str, Any]:
    """The settings of a YAML file, a launch script, or ``--key value`` arguments, as {key: value} (nested for YAML).
    A script's ``VAR=value cmd`` environment prefixes come back as UPPERCASE keys (no option is spelled so). A script
    or arguments in OmegaConf's ``key=value`` form (EasyR1's ``python3 -m verl.trainer.main config=x.yaml a.b=c``)
    come back as the YAML that ``config=`` names with the dotted overrides merged in (easyr1_source)."""
    if not args:
        raise ConfigError("vlmrl convert: give a config file, a launch script or --key value arguments")
    first = Path(args[0])
    if len(args) == 1 and first.suffix in (".yaml", ".yml", ".json") and first.is_file():
        data = yaml.safe_load(first.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ConfigError(f"{first}: expected a mapping of settings")
        return data
    if len(args) == 1 and first.is_file():
        text = first.read_text(encoding="utf-8")
        environment, words = launch_command(text)
        if not words:
            overrides = dotlist_command(text)
            if overrides:
                return easyr1_source(overrides, first)
        return {**{k: _scalar(v) for k, v in environment.items()}, **parse_arguments(words)}
    if not any(a.startswith("--") for a in args) and all(DOTLIST.fullmatch(a) for a in args):
        return easyr1_source(args, None)
    return parse_arguments(args)


def script_arguments(text: str) -> list[str]:
    """The ``--key value`` words of a launch script's command (see launch_command)."""
    return launch_command(text)[1]


def command_lines(text: str) -> list[list[str]]:
    """A shell script's command lines as words: lines joined at a trailing backslash (one newline: an empty line after
    it ends the command, as in bash; a ``# comment`` after the backslash is dropped and the line still joined, as the
    script's author meant it), comments dropped, and ``VAR=value`` lines of the script substituted into ``$VAR`` /
    ``${VAR}``. A line that is only ``VAR=value`` is an assignment, not a command."""
    joined = re.sub(r"\\[ \t]*(?:#[^\n]*)?\n", " ", text)
    variables: dict[str, str] = {}
    commands = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        assignment = re.fullmatch(r"(?:export\s+)?([A-Za-z_]\w*)=(.*)", line)
        if assignment:
            try:
                words = shlex.split(assignment[2])
            except ValueError:
                words = []
            if len(words) <= 1:  # `VAR=value` alone; `VAR=value cmd --args` is a command with an environment prefix
                variables[assignment[1]] = _substitute(words[0], variables) if words else ""
                continue
        try:
            commands.append(shlex.split(_substitute(line, variables)))
        except ValueError:
            continue
    return commands


def launch_command(text: str) -> tuple[dict[str, str], list[str]]:
    """(environment prefixes, arguments) of a launch script's command: of the command line (command_lines) with the
    most words from its first ``--`` option on, its ``VAR=value`` prefixes and those words."""
    best: tuple[dict[str, str], list[str]] = ({}, [])
    for words in command_lines(text):
        options = [i for i, w in enumerate(words) if w.startswith("--")]
        if options and len(words) - options[0] > len(best[1]):
            prefix = dict(re.fullmatch(r"([A-Za-z_]\w*)=(.*)", w, re.DOTALL).groups() for w in _env_prefix(words))
            best = (prefix, words[options[0] :])
    return best


# OmegaConf's command-line override: a dotted key (lower case: environment prefixes are UPPERCASE), `=`, a value.
DOTLIST = re.compile(r"[a-z_][\w-]*(\.[\w-]+)*=.*", re.DOTALL)


def dotlist_command(text: str) -> list[str]:
    """The ``key=value`` words of a script's command line in OmegaConf's form (EasyR1's ``python3 -m
    verl.trainer.main config=examples/config.yaml data.train_files=...``): of the command line holding the most such
    words after its environment prefixes, those words; [] when no line holds one."""
    best: list[str] = []
    for words in command_lines(text):
        found = [w for w in words[len(_env_prefix(words)) :] if DOTLIST.fullmatch(w)]
        if len(found) > len(best):
            best = found
    return best


def easyr1_source(overrides: list[str], script: Path | None) -> dict[str, Any]:
    """EasyR1's settings from its command line: the YAML named by ``config=`` (relative to the folder the command runs
    in: here, or the script's folder or one of the two above it, as EasyR1's examples/*.sh are run from the checkout's root),
    then each dotted ``key=value`` set in it (values read as YAML, as OmegaConf reads them)."""
    tree: dict[str, Any] = {}
    rest = []
    for word in overrides:
        key, _, value = word.partition("=")
        if key == "config":
            tree = _easyr1_base(value, script)
        else:
            rest.append((key, value))
    for key, value in rest:
        *sections, name = key.split(".")
        node = tree
        for section in sections:
            if not isinstance(node.get(section), dict):
                node[section] = {}
            node = node[section]
        node[name] = _override_value(value)
    return tree


def _override_value(text: str) -> Any:
    """An OmegaConf override's value: YAML, so `'{"n": 16}'` is a mapping and `[a, b]` a list; scalars as _scalar."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (dict, list)) else _scalar(text)


def _easyr1_base(name: str, script: Path | None) -> dict[str, Any]:
    path = Path(name)
    places = [Path.cwd()] + ([script.resolve().parent, *script.resolve().parent.parents][:3] if script else [])
    found = next((p / path for p in places if (p / path).is_file()), None) if not path.is_absolute() else path if path.is_file() else None
    where = f"{script}: " if script else ""
    if found is None:
        looked = ", ".join(str(p) for p in places)
        raise ConfigError(
            f"{where}config={name} is not here (looked in {looked}): run vlmrl convert in the EasyR1 checkout the script "
            "is run from, or give the YAML's path"
        )
    data = yaml.safe_load(found.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ConfigError(f"{found}: expected a mapping of settings (EasyR1's config=)")
    return data


def _substitute(text: str, variables: dict[str, str]) -> str:
    filled = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m[1] or m[2], m[0]), text)
    return _command_substitutions(filled)


# `$(expr 16 / 4)`, as ms-swift's scripts compute gradient_accumulation_steps (#4311): expr's integer arithmetic.
EXPR = re.compile(r"\$\(\s*expr\s+(-?\d+)\s*(\\?\*|[-+/%])\s*(-?\d+)\s*\)")
EXPR_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: int(a / b), "%": lambda a, b: a % b}


def _command_substitutions(text: str) -> str:
    """`$(expr a op b)` of two integers as its value (expr truncates division towards zero); any other `$(...)` as
    one `${command_output}` word, which drop_unresolved then lists (its value exists only when the script runs)."""

    def value(m: re.Match) -> str:
        a, op, b = int(m[1]), m[2].lstrip("\\"), int(m[3])
        return m[0] if op in "/%" and b == 0 else str(EXPR_OPS[op](a, b))

    return re.sub(r"\$\([^()]*\)", "${command_output}", EXPR.sub(value, text))


def _env_prefix(words: list[str]) -> list[str]:
    """The leading ``VAR=value`` words of a command (its environment)."""
    out = []
    for word in words:
        if not re.fullmatch(r"[A-Za-z_]\w*=.*", word, re.DOTALL):
            break
        out.append(word)
    return out


def parse_arguments(words: list[str]) -> dict[str, Any]:
    """``--key value [value ...]`` -> {key: value or list}; a flag without a value is true; values parsed as YAML.
    ``--key=value`` takes that one value: the words after it are not its (torchrun's ``--nnodes=2 train.py``)."""
    out: dict[str, Any] = {}
    key = None
    for word in words:
        if word.startswith("--"):
            key, eq, value = word[2:].partition("=")
            key = key.replace("-", "_")
            out[key] = _scalar(value) if eq else True
            key = None if eq else key
        elif key is not None:
            value = _scalar(word.rstrip(","))
            out[key] = value if out[key] is True else (out[key] if isinstance(out[key], list) else [out[key]]) + [value]
    return out


def _scalar(text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+(\.\d*)?[eE][+-]?\d+", value):
        return float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string
    return value if isinstance(value, (str, int, float, bool)) or value is None else text
