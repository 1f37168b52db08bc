"""A stand-in for an accelerator's tensors on a machine without one.

CUDA refuses most operations whose tensors live on different devices ("Expected all
tensors to be on the same device"); CPU tensors never do, so on CPU a forgotten `.to(device)`
goes unseen. [`OnDevice`] is a CPU tensor that refuses the same way: any torch operation
that meets it together with a plain host tensor (of at least one dimension: CUDA, too, takes
host scalars) raises, `copy_` excepted, while `.cpu()`, `.to("cpu")` and `.to(other.device)` of a plain tensor
give what the same calls give on CUDA. Tests of device placement run on it and, where CUDA is
present, on CUDA itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

#: What [`OnDevice`] tensors report as their device (the real one is the CPU).
FAKE_DEVICE = torch.device("cuda", 0)


def _targets(args: tuple, kwargs: dict) -> torch.device | None:
    """The device a `Tensor.to(...)` call names, if any."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (str, torch.device)):
            return torch.device(value)
        if isinstance(value, torch.Tensor):
            return value.device
    return None


#: The function `tensor.device` reaches `__torch_function__` as (method wrappers compare equal).
_DEVICE_GETTER = torch.Tensor.device.__get__


class OnDevice(torch.Tensor):
    """A CPU tensor that behaves, for device checks, like one on `FAKE_DEVICE`."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GETTER:
            return FAKE_DEVICE
        target = _targets(args, kwargs) if func is torch.Tensor.to else None
        if target is not None and target.type == FAKE_DEVICE.type:
            return _onto_device(args, kwargs)
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and target is not None and target.type == "cpu"):
            with torch._C.DisableTorchFunctionSubclass():
                result = func(*args, **kwargs)
                if result is args[0]:
                    result = result.clone()  # a real device-to-host copy is a new tensor
            return result.as_subclass(torch.Tensor)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # copy_ is the one operation CUDA runs across devices (it is the copy between them).
        if (
            func is not torch.Tensor.copy_
            and any(isinstance(t, cls) for t in tensors)
            and any(not isinstance(t, cls) and t.dim() > 0 for t in tensors)
        ):
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"{FAKE_DEVICE} and cpu! ({getattr(func, '__name__', func)})"
            )
        return super().__torch_function__(func, types, args, kwargs)


def _onto_device(args: tuple, kwargs: dict) -> OnDevice:
    """`Tensor.to(...)` onto the fake device: the same dtype and copy options, no device."""
    rest = tuple(a for a in args[1:] if not isinstance(a, (str, torch.device, torch.Tensor)))
    options = {k: v for k, v in kwargs.items() if k != "device"}
    with torch._C.DisableTorchFunctionSubclass():
        moved = torch.Tensor.to(args[0], *rest, **options)
    return moved.as_subclass(OnDevice)


class _ToFakeDevice(TorchFunctionMode):
    """Lets a plain tensor move to the fake device (`.to("cuda")`, `.to(param.device)`),
    which a subclass alone cannot intercept: no [`OnDevice`] takes part in that call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and not isinstance(args[0], OnDevice):
            target = _targets(args, kwargs)
            if target is not None and target.type == FAKE_DEVICE.type:
                return _onto_device(args, kwargs)
        return func(*args, **kwargs)


@contextmanager
def fake_device() -> Iterator[None]:
    """While active, plain tensors moved to `FAKE_DEVICE` become [`OnDevice`] tensors."""
    with _ToFakeDevice():
        yield


def on_device(tensor: torch.Tensor) -> OnDevice:
    """`tensor` as an [`OnDevice`] tensor (sharing its storage)."""
    return tensor.as_subclass(OnDevice)


def move_module(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter of `module` made an [`OnDevice`] parameter, in place."""
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            sub._parameters[name] = torch.nn.Parameter(on_device(param.detach()), requires_grad=param.requires_grad)
    return module
