"""A test double: the delta worker extension with a model load that fails on request.

A load cannot be made to fail for real halfway through vLLM's `load_weights` (after it
wrote some tensors, before it wrote the rest), so this subclass of
`vllm_ext.DeltaWorkerExtension` adds one RPC that arms such a failure in the served model:
the next loads pass `calls_before` calls of `model.load_weights` through untouched, then in
the one after that hand vLLM's loader `tensors` tensors (which it writes) and raise; or
(`direct`) the loader's next direct writes into runtime tensors write `tensors` of them
and raise. The failure fires once; the receiver's rollback and the next update load
normally.

Start the server with `--worker-extension-cls load_fault_extension.LoadFaultExtension` and
this directory on its `PYTHONPATH`; arm a failure with
`POST /collective_rpc {"method": "delta_sync_fail_next_load", "kwargs": {...}}` and read
what it did with `{"method": "delta_sync_load_fault"}`. The product never imports this.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from vllm_ext import DeltaWorkerExtension

__all__ = ["LoadFaultExtension"]


class LoadFaultExtension(DeltaWorkerExtension):
    """`DeltaWorkerExtension` plus `delta_sync_fail_next_load` and `delta_sync_load_fault`."""

    def delta_sync_fail_next_load(
        self, calls_before: int = 0, tensors: int = 1, direct: bool = False
    ) -> dict[str, Any]:
        """Make a coming `model.load_weights` call (or, with `direct`, the loader's next
        direct writes into runtime tensors) fail after it has loaded some tensors.

        Args:
            calls_before: Calls of `load_weights` that go through untouched first (a load
                reloads whole tensors in one call, then writes patches in another).
            tensors: Tensors the failing call hands to vLLM's loader (or writes directly)
                before it raises.
            direct: Fail in `ModelLoader._write_direct` instead, after `tensors` writes.

        Returns:
            The fault's record (see `delta_sync_load_fault`).
        """
        loader = self._delta_engine().loader
        model = loader.model
        fault: dict[str, Any] = {
            "armed": True,
            "calls_passed": 0,
            "written": [],
            "changed_before_failure": [],
            "error": None,
        }
        self._delta_sync_fault = fault
        if direct:
            real_write_direct = type(loader)._write_direct.__get__(loader)

            def failing_write_direct(writes: list) -> None:
                del loader._write_direct  # once only: the rollback's writes go through
                fault["armed"] = False
                before = _plain_parameters(model)
                real_write_direct(writes[:tensors])
                fault["written"] = [patch.name for patch, _ in writes[:tensors]]
                _record_failure(model, before, fault)

            loader._write_direct = failing_write_direct
            return dict(fault)
        real_load_weights = type(model).load_weights.__get__(model)

        def failing_load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
            if fault["calls_passed"] < calls_before:
                fault["calls_passed"] += 1
                return real_load_weights(weights)
            del model.load_weights  # once only: the rollback's reload goes through
            fault["armed"] = False
            before = _plain_parameters(model)
            return real_load_weights(_then_fail(model, weights, tensors, before, fault))

        model.load_weights = failing_load_weights
        return dict(fault)

    def delta_sync_load_fault(self) -> dict[str, Any]:
        """What the armed fault did: `armed` (not fired yet), `calls_passed`, `written` (the
        checkpoint names vLLM's loader received in the failing call) and
        `changed_before_failure` (those of them whose runtime tensor held other values
        when the failure was raised than when the call began), and `error`, the message
        of the exception raised."""
        return dict(getattr(self, "_delta_sync_fault", {"armed": False}))


def _plain_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters that hold values (not the empty weights of repacked layers)."""
    return {
        name: param.detach().clone()
        for name, param in model.named_parameters()
        if param.numel() > 0 and param.device.type != "meta"
    }


def _then_fail(
    model: torch.nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    tensors: int,
    before: dict[str, torch.Tensor],
    fault: dict[str, Any],
) -> Iterator[tuple[str, torch.Tensor]]:
    for index, (name, tensor) in enumerate(weights):
        if index == tensors:
            break
        fault["written"].append(name)
        yield name, tensor
    _record_failure(model, before, fault)


def _record_failure(model: torch.nn.Module, before: dict[str, torch.Tensor], fault: dict[str, Any]) -> None:
    """Note which written tensors hold other values than before, then raise."""
    after = dict(model.named_parameters())
    fault["changed_before_failure"] = [
        name
        for name in fault["written"]
        if name in before
        and name in after
        and after[name].shape == before[name].shape
        and not torch.equal(after[name].detach(), before[name])
    ]
    fault["error"] = f"injected load failure (test double) after {len(fault['written'])} tensor(s)"
    raise RuntimeError(fault["error"])
