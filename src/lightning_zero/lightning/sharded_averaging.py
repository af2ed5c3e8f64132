"""Lightning's weight-averaging callbacks with their average kept as shards beside the optimizer's.

``EMAWeightAveraging`` / ``WeightAveraging`` keep an ``AveragedModel`` (a full copy of the module),
``StochasticWeightAveraging`` a copy of the module. Under ZeRO the copy is a ``ShardedAverage``:
this rank's chunks of the average, beside the optimizer's (``engine/optimizer/averaged_shards.py``), so 4 B
per fp32 parameter / N per rank at every stage, and an update reads only this rank's chunks (no
gather at stage 3). What Lightning wrote about *when* and *how* to average runs as it wrote it
(``should_update``, ``_latest_update_step``, SWA's epochs, its LR schedule and BatchNorm epoch, the
checkpoint hooks); only the methods that create or move the copy are replaced, before the
callbacks' ``setup``, in a class inserted between the callback's own class and Lightning's
(``sharded_class``):

    WeightAveraging:           setup, on_fit_start, _swap_models, _copy_average_to_current, on_load_checkpoint
    StochasticWeightAveraging: setup, on_fit_start

``setup`` copies nothing (nor calls ``configure_model``, which at stage 3 builds on the meta device
in the strategy's context); ``on_fit_start`` makes the average from the weights the strategy set
up, as Lightning's copy starts from the weights at setup. Outside ``fit`` the callbacks hold no
average, as on a Trainer that never fitted: after ``fit`` the module holds the average (copied in
when training ends), and ``validate(ckpt_path=...)`` loads the checkpoint's average (its weights),
so evaluation sees the average as under DDP, where the callback swaps it in and out again. A
subclass's own override of one of the replaced methods runs, and its ``super()`` call reaches the
sharded version (Lightning's own tests count calls that way).

SWA's ``update_parameters`` and ``transfer_weights`` are static methods, which subclasses (Lightning's
own tests among them) also call by class name: ``StochasticWeightAveraging.update_parameters(...)``
reaches no subclass. So Lightning's two static methods themselves are given a first look at their
arguments (``sharded_static_methods``, once, when a ZeroStrategy first sets up a callback): an
average kept as shards (a ``ShardedAverage``) is averaged or copied from as shards, and anything else
goes to Lightning's own code, unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_zero.checkpoint.directory import CURRENT_MODEL_STATE
from lightning_zero.checkpoint.sharded import SHARD_KEY_PREFIXES
from lightning_zero.engine import ZeroEngine
from lightning_zero.engine.optimizer.averaged_shards import AveragedShards, AvgFn, Buffers, MultiAvgFn

try:
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # Lightning before 2.6 has no WeightAveraging callback
    WeightAveraging = None


class ShardedAverage:
    """Stands in for a weight-averaging callback's full copy: an ``AveragedModel``
    (``averaged_model=True``: ``state_dict`` keys under ``module.``, and ``n_averaged``) or, for
    SWA, a copy of the module. The average itself is an ``AveragedShards`` made by ``start``.

    Its ``state_dict`` is what the strategy saves: shard entries (``model/<param>`` this rank's
    chunk as a DTensor, ``buffer/<key>``) for sharded directories, full tensors on rank 0 for
    ``state_dict_type="full"`` (a collective, as Lightning calls it on every rank).
    """

    def __init__(
        self,
        strategy: Any,
        device: Optional[torch.device],
        buffers: Buffers,
        averaged_model: bool,
        avg_fn: Optional[AvgFn] = None,
        multi_avg_fn: Optional[MultiAvgFn] = None,
    ) -> None:
        if avg_fn is not None and multi_avg_fn is not None:
            raise ValueError("Only one of `avg_fn` and `multi_avg_fn` can be given (as for torch's AveragedModel).")
        self.strategy, self.device, self.buffers = strategy, device, buffers
        self.avg_fn, self.multi_avg_fn = avg_fn, multi_avg_fn
        self.prefix = "module." if averaged_model else ""
        self.counts = averaged_model
        self.n_averaged = torch.tensor(0, dtype=torch.long)
        """Models averaged so far (``AveragedModel``'s; SWA counts in the callback itself)."""
        self.engine: Optional[ZeroEngine] = None
        self._shards: Optional[AveragedShards] = None

    def __getstate__(self) -> dict[str, Any]:
        # a Trainer pickled after `fit` carries the options, not this process's chunks
        return {**self.__dict__, "engine": None, "_shards": None}

    def start(self, engine: Optional[ZeroEngine]) -> None:
        """Make the average, from the current weights, beside ``engine``'s chunks."""
        if engine is None:
            raise RuntimeError("Weight averaging under ZeroStrategy needs the strategy's engine; start it at `on_fit_start`.")
        self.close()
        self.engine = engine
        self._shards = engine.average_weights(self.device, self.buffers)

    @property
    def shards(self) -> AveragedShards:
        if self._shards is None:
            raise RuntimeError(
                "The weight average under ZeroStrategy is made at `on_fit_start`; it was used before that, or after a pickle."
            )
        return self._shards

    def close(self) -> None:
        """Drop the average (its memory, and its place in the engine's ``memory_report``)."""
        if self._shards is not None and self.engine is not None:
            self.engine.averages.discard(self._shards)
        self.engine, self._shards = None, None

    def to(self, *args: Any, **kwargs: Any) -> "ShardedAverage":
        """SWA moves its copy to its ``device``; the chunks were made there (``device``) already."""
        return self

    # ---- what the callbacks call -----------------------------------------------------------------
    def parameters(self) -> Any:
        """Code iterating a full copy's parameters (SWA's static methods do so for any average not
        kept as shards) would average nothing here, so it fails saying what reaches the shards."""
        raise RuntimeError(
            "The parameters of a weight average lightning-zero keeps as shards were iterated; no full copy exists."
            " HINT: update and copy the average through the callback's `update_parameters`/`transfer_weights`"
            " (by `super()`, by class name or on the instance), which reach the shards."
        )

    def update_parameters(self, model: Any) -> None:
        """``AveragedModel.update_parameters(model)`` (``model``'s chunks are the engine's)."""
        self.shards.update(self.n_averaged, self.avg_fn, self.multi_avg_fn)
        self.n_averaged += 1

    def state_dict(self) -> dict[str, Any]:
        shards = self.shards
        if self.strategy.state_dict_type == "sharded":  # the strategy's own checkpointing: the DCP mesh
            weights = self.strategy._checkpointing.module_shards(shards.module, self.engine, shards)
        else:
            weights = shards.full_state_dict(keep=self.strategy.is_global_zero)
        state = {self.prefix + key: value for key, value in weights.items()}
        if self.counts:
            state["n_averaged"] = self.n_averaged.clone()
        return state

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        weights = {key[len(self.prefix) :]: v for key, v in state.items() if key.startswith(self.prefix) and key != "n_averaged"}
        self.load_weights(weights, strict)
        if self.counts and "n_averaged" in state:
            self.n_averaged.copy_(state["n_averaged"])

    def load_weights(self, state: Mapping[str, Tensor], strict: bool = True) -> None:
        """The average from ``state``: shard entries (this rank's chunks) or a full ``state_dict``."""
        params, buffers, chunked = _split_weights(state, self.shards)
        self.shards.load(params, buffers, chunked, strict)

    def load_training_weights(self, state: Mapping[str, Tensor]) -> None:
        """The module's training weights from ``state``: shard entries or a full ``state_dict``."""
        params, buffers, chunked = _split_weights(state, self.shards)
        if chunked:
            self.shards.load_training_chunks(params, buffers)
        else:
            assert self.engine is not None
            self.engine.load_full_state_dict(self.shards.module, state)


def _split_weights(state: Mapping[str, Tensor], shards: AveragedShards) -> tuple[dict[str, Tensor], dict[str, Tensor], bool]:
    """(parameters by name, buffers by key, whether the parameters are this rank's chunks): a
    sharded checkpoint's entries (``model/<param>``, ``buffer/<key>``) or a ``state_dict`` (whose
    tied aliases are skipped)."""
    if state and all(key.startswith(SHARD_KEY_PREFIXES) for key in state):
        params = {key[len("model/") :]: v for key, v in state.items() if key.startswith("model/")}
        buffers = {key[len("buffer/") :]: v for key, v in state.items() if key.startswith("buffer/")}
        return params, buffers, True
    params = {key: v for key, v in state.items() if key in shards.chunks}
    return params, {key: v for key, v in state.items() if key not in params}, False


# ---- the methods replaced on the callbacks ---------------------------------------------------------
def _averaging_setup(callback: Any, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
    _close(callback)
    callback._average_model = None
    if stage == "fit":
        buffers = Buffers.AVERAGED if callback._use_buffers else Buffers.COPIED
        callback._average_model = ShardedAverage(
            trainer.strategy, callback._device, buffers, averaged_model=True, **callback._kwargs
        )


def _swa_setup(callback: Any, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
    _close(callback)
    callback._average_model = None
    if stage == "fit":
        callback._average_model = ShardedAverage(trainer.strategy, callback._device, Buffers.NOT_KEPT, averaged_model=False)


def _close(callback: Any) -> None:
    if isinstance(callback._average_model, ShardedAverage):
        callback._average_model.close()


def _start(callback: Any, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
    callback._average_model.start(trainer.strategy.engine)
    _lightning_class(callback).on_fit_start(callback, trainer, pl_module)  # SWA's checks; a no-op for WeightAveraging


def _swap(callback: Any, pl_module: "pl.LightningModule") -> None:
    callback._average_model.shards.swap()


def _copy_in(callback: Any, pl_module: "pl.LightningModule") -> None:
    callback._average_model.shards.copy_to_training()


def _averaging_load(callback: Any, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict[str, Any]) -> None:
    """``WeightAveraging.on_load_checkpoint``, with both weights loaded into chunks."""
    average = callback._average_model
    if average is None:
        _lightning_class(callback).on_load_checkpoint(callback, trainer, pl_module, checkpoint)  # Lightning's warning
    elif CURRENT_MODEL_STATE in checkpoint and "averaging_state" in checkpoint:
        rank_zero_info("Found current_model_state in the checkpoint. This will be used to initialize the model.")
        average_state = {"module." + key: value for key, value in checkpoint["state_dict"].items()}
        average.load_state_dict({**average_state, **checkpoint["averaging_state"]})
        average.load_training_weights(checkpoint[CURRENT_MODEL_STATE])
    else:
        rank_zero_warn(
            "The checkpoint was not created with WeightAveraging. Both the current and the average model will be"
            " initialized with state_dict."
        )
        average.load_weights(checkpoint["state_dict"], strict=False)


def _swa_update(average: ShardedAverage, model: Any, n_averaged: Tensor, avg_fn: AvgFn) -> None:
    """``StochasticWeightAveraging.update_parameters``: its ``avg_fn`` on the parameters' chunks."""
    average.shards.update(n_averaged, avg_fn)
    n_averaged += 1


def _swa_transfer(average: ShardedAverage, pl_module: Any) -> None:
    """``StochasticWeightAveraging.transfer_weights`` from the average into the module."""
    average.shards.copy_to_training()


def _swa_transfer_into(src: Any, average: ShardedAverage) -> None:
    raise RuntimeError(
        "StochasticWeightAveraging.transfer_weights(module, average) was called with the average lightning-zero keeps"
        " as shards as its destination; only the average's own updates (`update_parameters`) write it. HINT: to"
        " restart the average from the current weights, let the callback make it again at `on_fit_start`."
    )


_SHARDED_STATICS = {"update_parameters": (_swa_update, None), "transfer_weights": (_swa_transfer, _swa_transfer_into)}
"""SWA's static methods -> (what they do when their first argument is a ``ShardedAverage``, and when
their second is)."""


def sharded_static_methods() -> None:
    """Give ``StochasticWeightAveraging.update_parameters``/``transfer_weights`` a first look at their
    arguments (see the module's docstring). Idempotent; Lightning's code runs for any other argument."""
    for name, (first_sharded, second_sharded) in _SHARDED_STATICS.items():
        lightning_own = StochasticWeightAveraging.__dict__[name].__func__
        if getattr(lightning_own, "_lightning_zero_original", None) is not None:
            continue
        setattr(StochasticWeightAveraging, name, staticmethod(_dispatching(lightning_own, first_sharded, second_sharded)))


def _dispatching(lightning_own: Callable[..., Any], first_sharded: Callable[..., Any], second_sharded: Optional[Callable[..., Any]]) -> Callable[..., Any]:
    def dispatching(*args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], ShardedAverage):
            return first_sharded(*args, **kwargs)
        if second_sharded is not None and len(args) > 1 and isinstance(args[1], ShardedAverage):
            return second_sharded(*args, **kwargs)
        return lightning_own(*args, **kwargs)

    dispatching.__name__, dispatching.__qualname__, dispatching.__doc__ = lightning_own.__name__, lightning_own.__qualname__, lightning_own.__doc__
    dispatching._lightning_zero_original = lightning_own  # type: ignore[attr-defined]
    return dispatching


REPLACED: list[tuple[Optional[type], dict[str, Callable[..., Any]]]] = [
    (
        WeightAveraging,
        {
            "setup": _averaging_setup,
            "on_fit_start": _start,
            "_swap_models": _swap,
            "_copy_average_to_current": _copy_in,
            "on_load_checkpoint": _averaging_load,
        },
    ),
    (
        StochasticWeightAveraging,
        {"setup": _swa_setup, "on_fit_start": _start},  # and its static methods: `sharded_static_methods`
    ),
]
"""Each callback class, and its methods replaced by functions of (callback, *the method's arguments)."""


def shard_weight_averaging(trainer: "pl.Trainer") -> None:
    """Give the Trainer's weight-averaging callbacks sharded storage; before their ``setup``, where
    Lightning's would copy the whole module. Idempotent: every run of the Trainer calls it.

    Each callback's class becomes a subclass of its own in which the replaced methods sit between
    the user's class and Lightning's (``sharded_class``): a subclass's own override of one of them
    (counting calls, say) still runs, and its ``super()`` call reaches the sharded version. SWA's
    static methods reach it by class name too (``sharded_static_methods``)."""
    for callback in trainer.callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            sharded_static_methods()
        for cls, methods in REPLACED:
            if cls is not None and isinstance(callback, cls) and type(callback) not in _SHARDED_CLASSES.values():
                callback.__class__ = sharded_class(type(callback), cls, methods)


_SHARDED_CLASSES: dict[type, type] = {}
"""A callback's own class -> the class it gets under ZeRO (made once per class)."""


def sharded_class(own: type, lightning: type, methods: Mapping[str, Callable[..., Any]]) -> type:
    """``own`` (a subclass of Lightning's ``lightning``, or that class itself) with ``methods`` in a
    class between the two in the method resolution order: own → (Lightning's subclasses such as
    ``EMAWeightAveraging``) → the sharded methods → ``lightning``. Its instances pickle and copy as
    ``own``'s (the strategy gives the copy sharded storage again at its next setup)."""
    if own not in _SHARDED_CLASSES:
        sharded = type(f"Sharded{lightning.__name__}", (lightning,), {name: _as_method(f) for name, f in methods.items()})
        bases = (sharded,) if own is lightning else (own, sharded)
        _SHARDED_CLASSES[own] = type(
            own.__name__, bases, {"__module__": own.__module__, "__qualname__": own.__qualname__, "__reduce_ex__": _reduce_as_own}
        )
    return _SHARDED_CLASSES[own]


def _as_method(function: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return function(self, *args, **kwargs)

    method.__name__ = function.__name__
    return method


def _reduce_as_own(self: Any, protocol: Any) -> Any:
    own = next(own for own, made in _SHARDED_CLASSES.items() if made is type(self))
    state = self.__getstate__() if hasattr(self, "__getstate__") else self.__dict__  # Python 3.11+ / before
    return (_new_instance_of, (own,), state)


def _new_instance_of(cls: type) -> Any:
    return cls.__new__(cls)


def _lightning_class(callback: Any) -> type:
    """Lightning's class whose methods ``callback``'s sharded ones stand in for."""
    return next(cls for cls, _ in REPLACED if cls is not None and isinstance(callback, cls))


__all__ = ["ShardedAverage", "shard_weight_averaging"]
