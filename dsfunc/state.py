"""The training state: an immutable pytree of tensors, with donation.

``TrainState`` is a frozen dataclass registered with optree from its field metadata: fields marked
``static`` are auxiliary data (the run's :class:`~dsfunc.program.Program`), every other field is a child. Mappings inside the
state are :class:`FrozenDict`, so ``state.params["x"] = t`` fails as loudly as ``state.params = t``.

``train_step`` donates its input: the returned state reuses the input's buffers and the input is marked
consumed; touching a consumed state raises :class:`DonatedStateError`.

With the optimizer offloaded a step may return while the host still writes the new masters and moments
(:mod:`dsfunc.zero.offload.executor`). Reading a field or flattening the state never waits for that: what
reads their values (the next step, a checkpoint, ``full_params``) waits first, visibly
(:meth:`dsfunc.run.RunContext.wait`, which a script reading ``params`` itself calls too).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

import optree
import torch

from dsfunc.errors import UsageError
from dsfunc.frozen import GLOBAL_NAMESPACE, FrozenDict

if TYPE_CHECKING:
    from dsfunc.program import Program
    from dsfunc.scaling import LossScaleState

T = TypeVar("T")


class DonatedStateError(UsageError):
    """A state that ``train_step`` consumed (donated) was used again."""


def static_field(**kwargs: Any) -> Any:
    """A dataclass field that is auxiliary pytree data (not a leaf, never checkpointed as a tensor)."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


def pytree_dataclass(cls: type[T]) -> type[T]:
    """Register a frozen dataclass with optree, children and aux data taken from field metadata."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    children = tuple(f.name for f in fields if not f.metadata.get("static"))
    statics = tuple(f.name for f in fields if f.metadata.get("static"))

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        get = object.__getattribute__
        return tuple(get(obj, n) for n in children), tuple(get(obj, n) for n in statics), children

    def unflatten(aux: tuple[Any, ...], values: Any) -> Any:
        return cls(**dict(zip(children, values)), **dict(zip(statics, aux)))

    optree.register_pytree_node(cls, flatten, unflatten, namespace=GLOBAL_NAMESPACE)
    return cls


@pytree_dataclass
@dataclasses.dataclass(frozen=True)
class Metrics:
    """What the last step measured, as 0-d tensors on the training device (reading one syncs the host)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    loss_scale: torch.Tensor
    lr: torch.Tensor
    skipped: torch.Tensor

    @classmethod
    def before_training(cls, loss_scale: torch.Tensor) -> Metrics:
        """Zeros (and the initial loss scale) on the scale's device, for a state no step has made yet."""
        zero = torch.zeros((), device=loss_scale.device)
        return cls(loss=zero.clone(), grad_norm=zero.clone(), loss_scale=loss_scale.clone(), lr=zero.clone(),
                   skipped=torch.zeros((), dtype=torch.int32, device=loss_scale.device))

    def to_dict(self) -> dict[str, float]:
        """Host copies of every metric (this waits for the step to finish)."""
        return {f.name: getattr(self, f.name).item() for f in dataclasses.fields(self)}


_DATA_FIELDS = ("step", "params", "opt_state", "scaler", "buffers", "rng", "metrics")


@pytree_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class TrainState:
    """Everything a training run needs, as a value.

    Leaves: ``step`` (optimizer steps taken, applied or skipped; int64 on the CPU), ``params`` (fp32
    master weights of this rank, one flat shard per unit, keyed by unit name), ``opt_state``,
    ``scaler`` (loss-scale state), ``buffers`` (BatchNorm statistics and frozen parameters, by name),
    ``rng`` (the dropout seed), ``metrics``. Static: ``program``, the model skeleton, sharding plan,
    parsed config and composed step. Use :func:`dsfunc.full_params` for a plain ``state_dict``.
    """

    step: torch.Tensor
    params: FrozenDict
    opt_state: Any
    scaler: LossScaleState
    buffers: FrozenDict
    rng: torch.Tensor
    metrics: Metrics
    program: Program = static_field()  # noqa: RUF009 - returns a dataclasses.field

    def __getattribute__(self, name: str) -> Any:
        if name in _DATA_FIELDS and object.__getattribute__(self, "__dict__").get("_donated"):
            raise DonatedStateError(
                f"this TrainState was donated to train_step and its buffers now belong to the state it "
                f"returned; reading .{name} would see overwritten data. Use the returned state "
                "(`state = dsfunc.train_step(state, batch)`), or pass donate=False to keep the input intact."
            )
        return object.__getattribute__(self, name)

    def replace(self, **changes: Any) -> TrainState:
        """A new state with the given fields replaced (mappings are frozen for you)."""
        self.check_usable()
        for key in ("params", "buffers"):
            if key in changes and not isinstance(changes[key], FrozenDict):
                changes[key] = FrozenDict(changes[key])
        return dataclasses.replace(self, **changes)

    @property
    def donated(self) -> bool:
        """True once ``train_step`` has consumed this state."""
        return bool(object.__getattribute__(self, "__dict__").get("_donated"))

    def check_usable(self) -> None:
        """Raise :class:`DonatedStateError` if this state was donated."""
        self.step  # noqa: B018 - the attribute access raises for a donated state

    def mark_donated(self) -> None:
        """Mark this state consumed; called by ``train_step`` after it reused the buffers."""
        object.__getattribute__(self, "__dict__")["_donated"] = True

    def __repr__(self) -> str:
        if self.donated:
            return "TrainState(<donated>)"
        n = sum(p.numel() for p in self.params.values())
        return f"TrainState(step={int(self.step)}, units={len(self.params)}, local_params={n})"


def _refuse_assignment(self: TrainState, name: str, value: Any) -> None:
    raise dataclasses.FrozenInstanceError(
        f"TrainState is immutable: cannot assign .{name}. Use state.replace({name}=...) to get a new state."
    )


TrainState.__setattr__ = _refuse_assignment  # type: ignore[method-assign,assignment]
