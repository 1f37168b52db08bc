"""Errors survive a process boundary: every public error class pickles with its message and
fields, so an error raised in a vLLM worker, a torch.distributed rank or a process pool
reaches the caller as itself rather than as a `TypeError` from `pickle.loads`."""

from __future__ import annotations

import inspect
import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest

from delta_sync import errors

#: A value for each keyword-only field the error classes take.
_FIELDS = {
    "held": 7,
    "base": 6,
    "wanted": 9,
    "url": "http://127.0.0.1:8000",
    "route": "/update_weights",
    "status": 409,
    "server_message": "base version mismatch",
}

ERROR_CLASSES = sorted(
    (
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == errors.__name__
    ),
    key=lambda cls: cls.__name__,
)


def _raised(cls: type[BaseException]) -> BaseException:
    """An instance of `cls` with a message and every keyword-only field it takes."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    fields = {p.name: _FIELDS[p.name] for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return cls(f"{cls.__name__}: file:///bucket/deltas/step_00000007.safetensors is at fault", **fields)


def _state(error: BaseException) -> tuple:
    return type(error), str(error), error.args, vars(error)


def test_every_public_error_class_is_found():
    assert {"DeltaSyncError", "BaseVersionError", "SnapshotMovedError", "ReplicaError"} <= {
        cls.__name__ for cls in ERROR_CLASSES
    }


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_an_error_pickles_with_its_message_and_fields(cls):
    error = _raised(cls)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert _state(pickle.loads(pickle.dumps(error, protocol=protocol))) == _state(error)


def _fail_in_a_worker(held: int) -> None:
    raise errors.BaseVersionError(f"delta against v{held - 1}, holding v{held}", held=held, base=held - 1)


def test_an_error_raised_in_another_process_reaches_the_caller_with_its_fields():
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        future = pool.submit(_fail_in_a_worker, 8)
        with pytest.raises(errors.BaseVersionError, match="holding v8") as raised:
            future.result(timeout=60)
    assert (raised.value.held, raised.value.base) == (8, 7)
