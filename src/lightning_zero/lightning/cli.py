"""``ZeroCLI``: ``LightningCLI`` whose errors about the strategy come as one line saying what to give.

LightningCLI parses the Trainer's ``strategy: Union[str, Strategy]`` with jsonargparse, which reports

- an option of the strategy it cannot parse (``--trainer.strategy.bucket_size_mb=big``, or
  ``bucket_size_mb: big`` under ``init_args``) as the failure of both union members, after 70 lines
  of usage, with the type it expected but not what the option means;
- an option the strategy's constructor refuses (``bucket_size_mb: -1``, ``unit_classes`` at stage 2)
  as a 55-line traceback, the constructor's message between two dumps of the whole configuration;
- options given to a registered name (``--trainer.strategy=zero3 --trainer.strategy.prefetch_units=2``)
  as "Expected a dot import path string: zero3";

and the Trainer then refuses a misspelled name (``zer03``) with Lightning's "invalid strategy name",
which lists none of lightning-zero's names. ``ZeroCLI`` exits instead with status 2 (argparse's
status for a bad option) and one line, e.g.::

    error: trainer.strategy (lightning_zero.ZeroStrategy): `bucket_size_mb` must be a positive number of MiB, got 'big'.

the strategy constructor's own message, which says what it accepts; or the registered names closest
to a misspelled one; or how to give a registered name's options. An error it cannot attribute to the
strategy reaches the user as LightningCLI shows it. The messages it reads are jsonargparse's
(``explain_parse_error``), tested against the installed release; one it does not recognise is left as is.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import sys
from typing import Any, NoReturn, Optional

import yaml
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

from lightning_zero.engine.config import STRATEGY_NAMES
from lightning_zero.engine.zero_plus_plus import NodeLayoutError
from lightning_zero.lightning.strategy import ZeroStrategy

STRATEGY_KEY = "trainer.strategy"

_UNION_FAILED = re.compile(r'^Parser key "(?:\w+\.)?trainer\.strategy":')
_PROBLEM = re.compile(r"Problem with given class_path '(?P<cls>[^']+)':$")
_KEY = re.compile(r'\s*Parser key "(?P<key>[^"]+)":$')
_NAME_GIVEN_OPTIONS = re.compile(r"Expected a dot import path string: (?P<name>\S+)")
_NESTED_KEY = re.compile(r"NestedArg\(key='(?P<key>[^']+)'")


class ZeroCLI(LightningCLI):
    """``LightningCLI`` whose errors about ``trainer.strategy`` are one line naming the option and what
    it accepts (see the module's docstring); use it wherever ``LightningCLI`` would be."""

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        parser = super().init_parser(**kwargs)  # the main parser and each subcommand's: each reports its own errors
        parser.error = _StrategyErrorFirst(parser)  # type: ignore[method-assign]
        return parser

    @override
    def instantiate_classes(self) -> None:
        trainer = self.config.get(str(self.subcommand), self.config).get("trainer") or Namespace()
        strategy = trainer.get("strategy")
        unknown = unknown_strategy_name(strategy) if isinstance(strategy, str) else None
        if unknown is not None:
            _exit(f"{STRATEGY_KEY}: {unknown}")  # before the model is built
        try:
            super().instantiate_classes()
        except NodeLayoutError as refused:  # ZeRO++'s options against the nodes, refused by the Trainer
            _exit(f"{STRATEGY_KEY}: {refused}")
        except (TypeError, ValueError):
            explained = strategy_refusal(strategy) if isinstance(strategy, Namespace) else None
            if explained is None:
                raise
            _exit(explained)


class _StrategyErrorFirst:
    """A parser's ``error``, which exits with ``explain_parse_error``'s line alone where it has one."""

    def __init__(self, parser: LightningArgumentParser) -> None:
        self.parser, self.error = parser, parser.error

    def __call__(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        explained = explain_parse_error(message) if self.parser.exit_on_error else None
        if explained is not None:
            _exit(explained)
        self.error(message, ex)
        raise AssertionError("unreachable: jsonargparse's error exits or raises")


def explain_parse_error(message: str) -> Optional[str]:
    """One line for jsonargparse's ``message`` about ``trainer.strategy``, or None for any other."""
    if not _UNION_FAILED.match(message):
        return None
    option = _class_option(message.splitlines())
    if option is not None:
        class_path, key, why, value = option
        refusal = _refusal(class_path, key, _as_given(value)) if value is not None else None
        return f"{STRATEGY_KEY} ({class_path}): {refusal or f'`{key}`: {why}'}"
    named = _NAME_GIVEN_OPTIONS.search(message)
    if named is not None and named["name"] in StrategyRegistry:
        nested = _NESTED_KEY.search(message)
        return _options_of_a_name(named["name"], nested["key"] if nested else None)
    return None


def _class_option(lines: list[str]) -> Optional[tuple[str, str, str, Optional[str]]]:
    """From jsonargparse's report of a class's option it could not parse::

        - Problem with given class_path 'lightning_zero.ZeroStrategy':
            Parser key "bucket_size_mb":
              Expected a <class 'float'>. Got value: big

    (or, for an option of several types, their errors as ``- `` lines and ``Given value: big``): the
    class path, the option, what was wrong, and the value as printed (None if not found)."""
    for i, line in enumerate(lines[:-1]):
        problem, key = _PROBLEM.search(line), _KEY.match(lines[i + 1])
        if problem is None or key is None:
            continue
        indent = len(lines[i + 1]) - len(lines[i + 1].lstrip())
        block = []
        for inner in lines[i + 2 :]:
            if len(inner) - len(inner.lstrip()) <= indent:
                break
            block.append(inner.strip())
        if not block:
            return None
        first, _, value = block[0].partition(". Got value: ")
        given = next((b[len("Given value: ") :] for b in block if b.startswith("Given value: ")), None)
        errors = [b[2:].split(". Got value: ")[0] for b in block if b.startswith("- ")]
        why = "; ".join(errors) if first.startswith("Does not validate") and errors else first
        return problem["cls"], key["key"], why, value or given
    return None


def strategy_refusal(strategy: Namespace) -> Optional[str]:
    """The message with which the strategy's class refuses the options parsed for it (its
    ``init_args``, all plain values), or None: none, or nested classes it cannot build alone."""
    options = dict(vars(strategy.get("init_args") or Namespace()))
    strategy_class = _import(strategy.get("class_path"))
    if strategy_class is None or any(isinstance(v, (Namespace, dict)) for v in options.values()):
        return None
    try:
        strategy_class(**options)
    except (TypeError, ValueError) as err:
        return f"{STRATEGY_KEY} ({strategy.get('class_path')}): {err}"
    return None


def unknown_strategy_name(name: str) -> Optional[str]:
    """Why ``name`` is no strategy the Trainer knows, with the registered names closest to it and
    lightning-zero's; None for a registered name (or ``"auto"``)."""
    if name.lower() == "auto" or name.lower() in StrategyRegistry:
        return None
    close = difflib.get_close_matches(name.lower(), StrategyRegistry.available_strategies(), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return (
        f"{name!r} is not a registered strategy name (Lightning: \"You selected an invalid strategy name\"). HINT:"
        f" {hint}lightning-zero registers {', '.join(STRATEGY_NAMES)} (each also with _spawn and _notebook), or give"
        " the class: lightning_zero.ZeroStrategy."
    )


def _refusal(class_path: str, key: str, value: Any) -> Optional[str]:
    """The class's own message for ``key=value`` alone, where it is about that option's value
    (`` `key` must ...``): it says what is accepted, in the option's terms."""
    strategy_class = _import(class_path)
    if strategy_class is None:
        return None
    try:
        strategy_class(**{key: value})
    except (TypeError, ValueError) as err:
        return str(err) if f"`{key}` must" in str(err) else None
    return None


def _options_of_a_name(name: str, key: Optional[str]) -> str:
    """How to give ``key`` (None: unknown) with what the registered ``name`` stands for: its class and
    options; or, for an option of ``ZeroStrategy``'s that the name's class lacks (a script's default
    ``ddp`` and ``--trainer.strategy.bucket_size_mb``), ``ZeroStrategy``."""
    entry = StrategyRegistry[name]
    strategy_class, params = entry["strategy"], entry["init_params"]
    accepted = inspect.signature(strategy_class.__init__).parameters
    yours = f"--{STRATEGY_KEY}.{key or 'OPTION'}=..."
    given = f"({f'`{key}`' if key else 'options'} given)"
    if key is not None and key not in accepted and key in inspect.signature(ZeroStrategy.__init__).parameters:
        return (
            f"{STRATEGY_KEY}: {name!r} is a registered name, which takes no options {given}, and `{key}` is not an"
            f" option of {strategy_class.__name__}. HINT: it is lightning-zero's: --{STRATEGY_KEY}=lightning_zero.ZeroStrategy"
            f" --{STRATEGY_KEY}.stage=3 {yours} (or stage 1 or 2; in YAML: `class_path` and `init_args`, as configs/zero_class_path.yaml)."
        )
    ours = strategy_class.__module__.startswith("lightning_zero.")  # ZeroStrategy: exported at the top
    class_path = f"lightning_zero.{strategy_class.__name__}" if ours else f"{strategy_class.__module__}.{strategy_class.__qualname__}"
    # every option the name stands for but how its ranks start, where that is the class's default
    start = accepted.get("start_method")
    options = {k: v for k, v in params.items() if not (k == "start_method" and start is not None and v == start.default)}
    flags = "".join(f" --{STRATEGY_KEY}.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())
    return (
        f"{STRATEGY_KEY}: {name!r} is a registered name, which takes no options {given}. HINT: give its class"
        f" with the name's options, then yours: --{STRATEGY_KEY}={class_path}{flags} {yours}"
        " (in YAML: `class_path` and `init_args`, as configs/zero_class_path.yaml)."
    )


def _as_given(text: str) -> Any:
    """A value as jsonargparse printed it, read back as YAML (``big`` -> 'big', ``[1]`` -> [1])."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _import(class_path: Any) -> Optional[type]:
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None


def _exit(line: str) -> NoReturn:
    sys.stderr.write(f"error: {line}\n")
    raise SystemExit(2)


__all__ = ["ZeroCLI", "explain_parse_error", "strategy_refusal", "unknown_strategy_name"]
