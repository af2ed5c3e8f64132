"""Count a model's parameters without allocating it: build it on the meta device.

`lightning-zero estimate --model SPEC` needs one number, Ψ (with `--whole-tensor-optimizer`, each
parameter's size: `parameter_numels`). For a model that does not fit in this
machine's memory (the point of asking which ZeRO stage it needs) the only cheap way to get it is to
run the constructor under `torch.device("meta")`, where every tensor has a shape and no storage.
This module turns a `package.module:Class` or `path/to/file.py:Class` spec plus JSON init args into that
number, and turns every way the spec can be wrong into a `ModelSpecError` that says which part.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import sys
import typing
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn


class ModelSpecError(ValueError):
    """A `--model` spec, its module, its class or its init args are unusable; the message says why."""


def count_parameters(spec: str, init_args: str | Mapping[str, Any] | None = None) -> int:
    """Parameters of the model `spec` names, built with `init_args` on the meta device.

    `spec` is `package.module:Class` (importable from `sys.path`) or `path/to/file.py:Class`;
    `init_args` are the constructor's keyword arguments, as a JSON object or a mapping. As in
    LightningCLI's `init_args`, an object given for a parameter annotated with a dataclass becomes
    that dataclass, so `lightning_zero.models.gpt:GPT` takes `{"config": {"n_layer": 12}}`.

    The meta device gives every tensor a shape and no storage, so a model of any size is counted in
    milliseconds and no memory. Tied parameters are counted once (`Module.parameters` deduplicates).
    """
    return sum(parameter_numels(spec, init_args))


def parameter_numels(spec: str, init_args: str | Mapping[str, Any] | None = None) -> list[int]:
    """Each parameter's number of elements, in `Module.parameters` order (an optimizer's over the
    whole model), for the model `spec` names, built as `count_parameters` builds it: what the owner
    plan of a whole-tensor optimizer is computed from (`lightning_zero.estimate.OwnedParameters`)."""
    kwargs = _parse_init_args(init_args)
    factory = _load_attribute(spec)
    try:
        with torch.device("meta"):
            model = factory(**_dataclass_args(factory, kwargs))
    except Exception as error:  # any constructor failure is the user's spec or args, reported as such
        raise ModelSpecError(
            f"building {spec} with init args {json.dumps(kwargs)} on the meta device failed: "
            f"{type(error).__name__}: {error}. HINT: init args are the constructor's keyword arguments; "
            "a constructor that reads tensor values (.item(), .tolist()) cannot run on the meta device."
        ) from error
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{spec} built a {type(model).__name__}, not a torch.nn.Module")
    return [p.numel() for p in model.parameters()]


def _parse_init_args(init_args: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if init_args is None:
        return {}
    if isinstance(init_args, str):
        try:
            init_args = json.loads(init_args)
        except json.JSONDecodeError as error:
            raise ModelSpecError(
                f"init args are not valid JSON ({error}); expected an object such as '{{\"n_layer\": 12}}'"
            ) from None
    if not isinstance(init_args, Mapping):
        raise ModelSpecError(
            f"init args must be a JSON object of keyword arguments such as '{{\"n_layer\": 12}}', "
            f"got {type(init_args).__name__}"
        )
    return dict(init_args)


def _load_attribute(spec: str) -> Any:
    """The object `module:Qualified.name` points to; every failure is a `ModelSpecError` saying which part."""
    module_name, sep, qualname = spec.rpartition(":")
    if not sep or not module_name or not qualname or not all(p.isidentifier() for p in qualname.split(".")):
        raise ModelSpecError(
            f"model spec {spec!r} is not of the form package.module:Class or path/to/file.py:Class"
        )
    module = _import_file(module_name) if module_name.endswith(".py") else _import_module(module_name)
    obj: Any = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ModelSpecError(f"module {module_name!r} has no attribute {qualname!r}") from None
    if not callable(obj):
        raise ModelSpecError(f"{spec} is a {type(obj).__name__}, not a class")
    return obj


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        raise ModelSpecError(
            f"cannot import module {name!r}: {error}. HINT: put its package on PYTHONPATH, run from the "
            "directory that holds it, or give a file path such as path/to/model.py:GPT"
        ) from None


def _import_file(path_text: str) -> Any:
    """Import a source file as a module named after its stem. It is registered in `sys.modules` before
    it runs because dataclasses (and pickling) look their module up there."""
    path = Path(path_text)
    if not path.is_file():
        raise ModelSpecError(f"model file {path_text!r} does not exist")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ModelSpecError(f"cannot import {path_text!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[path.stem]
        raise ModelSpecError(f"importing {path_text!r} failed: {type(error).__name__}: {error}") from error
    return module


def _dataclass_args(factory: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with each JSON object given for a dataclass-annotated parameter built into that dataclass."""
    target = factory.__init__ if inspect.isclass(factory) else factory
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # unresolvable annotations: pass the arguments through untouched
        return kwargs
    return {
        name: hints[name](**value)
        if isinstance(value, Mapping) and dataclasses.is_dataclass(hints.get(name)) and isinstance(hints[name], type)
        else value
        for name, value in kwargs.items()
    }
