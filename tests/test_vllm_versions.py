"""`vllm_ext` across the vLLM releases it supports: 0.32 (the CPU wheel, run for real) to
0.34 (the CUDA wheel, read from its own sources).

What differs between them is decided in `vllm_ext.compat`, which imports nothing from vLLM;
the tests here read it from its file. Where a test needs vLLM's own code it uses the real
thing: vLLM 0.32 in the server's environment (`tests/vllm_server.py`, a subprocess, no
server started), or the methods and signatures of the 0.34 wheel's sources, downloaded once
(`pip download`, nothing installed) into an ignored directory of the repository.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from functools import cache
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from filelock import FileLock

from delta_sync.errors import DeltaSyncError

from helpers import REPO

pytestmark = pytest.mark.vllm

#: The newest CUDA release `vllm_ext` is checked against, by its sources.
VLLM_034 = "0.34.0"
#: Where its wheel is unpacked (ignored by git, as every `.venv-*` directory).
WHEEL_DIR = REPO / f".venv-vllm-{VLLM_034}-sources"


@cache
def compat() -> ModuleType:
    """`vllm_ext.compat`, loaded from its file: the package imports vLLM, which the test
    environment lacks."""
    spec = importlib.util.spec_from_file_location("vllm_ext_compat", REPO / "vllm_ext" / "compat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def vllm034() -> Path:
    """The `vllm` package directory of the vLLM 0.34 wheel (its Python sources only)."""
    package = WHEEL_DIR / "src" / "vllm"
    with FileLock(str(WHEEL_DIR) + ".lock"):
        if not (WHEEL_DIR / "src" / ".unpacked").is_file():
            download = subprocess.run(
                [sys.executable, "-m", "pip", "download", f"vllm=={VLLM_034}", "--no-deps", "-d", str(WHEEL_DIR)],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if download.returncode != 0:
                reason = f"cannot download vLLM {VLLM_034}'s wheel: {download.stderr[-500:]}"
                if os.environ.get("CI"):  # in CI these checks must run, not skip
                    pytest.fail(reason, pytrace=False)
                pytest.skip(reason)
            (wheel,) = WHEEL_DIR.glob(f"vllm-{VLLM_034}-*.whl")
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(
                    WHEEL_DIR / "src", [n for n in archive.namelist() if n.endswith((".py", "METADATA"))]
                )
            wheel.unlink()  # 240 MB; the sources are what the tests read
            (WHEEL_DIR / "src" / ".unpacked").write_text(VLLM_034)
    return package


@pytest.fixture(scope="session")
def vllm032() -> Path:
    """The `vllm` package directory of the real vLLM 0.32 the server tests run."""
    from vllm_server import vllm_python

    return Path(run_in_vllm("import vllm, os; print(os.path.dirname(vllm.__file__))", python=vllm_python()))


def run_in_vllm(*parts: str, python: Path | None = None) -> str:
    """Run the script `parts` make with vLLM 0.32's Python (the server's environment); the
    last line it prints."""
    if python is None:
        from vllm_server import vllm_python

        python = vllm_python()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    script = "\n".join(textwrap.dedent(part) for part in parts)
    result = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout.strip().splitlines()[-1]


def function_source(path: Path, name: str, class_name: str | None = None) -> ast.FunctionDef:
    """The definition of function `name` (a method of `class_name`) in a source file."""
    tree = ast.parse(path.read_text())
    body = tree.body
    if class_name is not None:
        body = next(node for node in body if isinstance(node, ast.ClassDef) and node.name == class_name).body
    return next(node for node in body if isinstance(node, ast.FunctionDef) and node.name == name)


def compiled(definitions: list[ast.FunctionDef], path: Path, namespace: dict) -> dict:
    """`definitions`, compiled from their own source into `namespace` (annotations unevaluated)."""
    module = ast.fix_missing_locations(ast.Module(body=definitions, type_ignores=[]))
    flags = __future__.annotations.compiler_flag
    exec(compile(module, str(path), "exec", flags=flags, dont_inherit=True), namespace)
    return namespace


# -- the supported range ------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.1", "0.34.0", "0.34.1.dev3+g1234abc"])
def test_supported_versions_pass(version):
    compat().check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "0.35.0rc1", "1.0.0", "0.22.0", "not-a-version"])
def test_a_vllm_outside_the_range_is_refused_naming_both(version):
    with pytest.raises(compat().UnsupportedVLLMError) as refused:
        compat().check_vllm_version(version)
    assert isinstance(refused.value, DeltaSyncError)
    assert version in str(refused.value) and compat().SUPPORTED_VLLM in str(refused.value)


@pytest.mark.slow
def test_the_engine_refuses_an_unsupported_vllm_when_it_is_constructed():
    """The real engine class, in the real vLLM 0.32's environment, told that another vLLM
    is installed: it refuses before the base class or the receiver is built."""
    answer = run_in_vllm(
        """
        import json, vllm
        from vllm_ext.engine import DeltaWeightTransferEngine
        from vllm_ext.compat import UnsupportedVLLMError
        installed = vllm.__version__
        vllm.__version__ = "0.35.0"
        try:
            DeltaWeightTransferEngine(None, None, None, None)
        except UnsupportedVLLMError as error:
            print(json.dumps({"installed": installed, "refused": str(error)}))
        """
    )
    result = json.loads(answer)
    assert result["installed"].startswith("0.32")
    assert "vLLM 0.35.0 is installed" in result["refused"] and ">=0.32,<0.35" in result["refused"]


@pytest.mark.slow
def test_both_wheels_are_in_the_range(vllm032, vllm034):
    for package in (vllm032, vllm034):
        (metadata,) = package.parent.glob("vllm*.dist-info/METADATA")
        version = next(
            line.split(": ", 1)[1] for line in metadata.read_text().splitlines() if line.startswith("Version")
        )
        compat().check_vllm_version(version)


# -- routes --------------------------------------------------------------------------------------

_ROUTE_METHODS = {"get", "post", "put", "delete", "patch", "websocket", "api_route", "add_api_route"}


def declared_routes(package: Path) -> set[tuple[str, str]]:
    """(method, path) of every route vLLM's entrypoints declare with a router or app
    decorator (`@router.post("/pause")`, `methods=[...]`, an `APIRouter(prefix=...)`)."""
    routes = set()
    for path in (package / "entrypoints").rglob("*.py"):
        tree = ast.parse(path.read_text())
        prefixes = {
            node.targets[0].id: keyword.value.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "APIRouter"
            and isinstance(node.targets[0], ast.Name)
            for keyword in node.value.keywords
            if keyword.arg == "prefix" and isinstance(keyword.value, ast.Constant)
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in _ROUTE_METHODS or not node.args:
                continue
            first = node.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("/")):
                continue
            methods = [node.func.attr.upper()]
            for keyword in node.keywords:
                if keyword.arg == "methods":
                    methods = ast.literal_eval(keyword.value)
            owner = getattr(node.func.value, "id", "")
            routes.update((method.upper(), prefixes.get(owner, "") + first.value) for method in methods)
    return routes


@pytest.mark.slow
def test_every_route_both_releases_declare_is_classified(vllm032, vllm034):
    """Each route of vLLM 0.32 and 0.34 is open as a status or inference route, or guarded
    by name; none is left to the middleware's default by oversight."""
    from vllm_server import vllm_ext_auth

    auth = vllm_ext_auth()
    releases = {"0.32": declared_routes(vllm032), "0.34": declared_routes(vllm034)}
    for release, routes in releases.items():
        assert ("POST", "/update_weights") in routes and ("GET", "/health") in routes, release
        unclassified = sorted(route for route in routes if auth.route_class(*route) is None)
        assert not unclassified, f"vLLM {release} routes no list names: {unclassified}"
    assert releases["0.34"] - releases["0.32"] >= {
        ("GET", "/v1/fault_tolerance/status"),
        ("POST", "/v1/decisions"),
        ("POST", "/checkpoint/prepare"),
        ("POST", "/checkpoint/restore"),
        ("GET", "/checkpoint/status"),
    }
    assert auth.route_class("GET", "/fault_tolerance/status") == "status"  # 0.32
    assert auth.route_class("GET", "/v1/fault_tolerance/status") == "status"  # 0.34
    assert auth.route_class("GET", "/checkpoint/status") == "status"
    assert auth.route_class("POST", "/v1/decisions") == "inference"
    for route in ("/checkpoint/prepare", "/checkpoint/restore", "/v1/fault_tolerance/apply", "/collective_rpc"):
        assert auth.route_class("POST", route) == "guarded", route


# -- a failed finish ----------------------------------------------------------------------------


class FailingEngine:
    """A plain fake of the delta engine as the worker sees it (the real one needs a served
    model): its finish raises after the receiver rolled back, or failed to."""

    def __init__(self, intact: bool) -> None:
        self.loader = SimpleNamespace(intact=intact)
        self.targets_reset = 0

    def finish_weight_update(self) -> None:
        raise RuntimeError("the load failed; the receiver rolled back")

    def reset_weight_update_target(self) -> None:
        self.targets_reset += 1


def vllm_worker(package: Path, *, direct_reload: bool = False) -> type:
    """A class with the weight-update methods of the wheel's own `Worker`
    (`vllm/v1/worker/gpu_worker.py`), compiled from its source; what they call outside the
    session (vLLM's config context, LoRA state, draft models) is stubbed."""
    path = package / "v1" / "worker" / "gpu_worker.py"
    names = ["finish_weight_update", "_end_weight_update", "has_incomplete_weight_update"]
    tree = ast.parse(path.read_text())
    worker = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Worker")
    methods = [node for node in worker.body if isinstance(node, ast.FunctionDef) and node.name in names]
    namespace = compiled(
        methods,
        path,
        {
            "set_current_vllm_config": lambda config: contextlib.nullcontext(),
            "direct_reload_enabled": lambda: direct_reload,
            "restore_quantized_lm_heads": lambda model, refresh: None,
        },
    )
    members = {name: namespace[name] for name in names if name in namespace}

    def init(self, engine: FailingEngine) -> None:
        self.weight_transfer_engine = engine
        self.vllm_config = None
        self.model_runner = SimpleNamespace(reset_lora_state=lambda: None)
        self._weight_update_active = True  # as start_weight_update leaves it
        self._weight_update_is_draft = False
        self._weight_update_kv_cache_loan = contextlib.ExitStack()
        if "has_incomplete_weight_update" in members:  # 0.34: start marks the weights
            self._incomplete_weight_updates = {False}

    members.update(
        __init__=init,
        _check_weight_transfer_engine=lambda self: None,
        get_draft_model=lambda self: None,
    )
    return type("Worker", (), members)


def failed_finish(worker_class: type, intact: bool) -> object:
    worker = worker_class(FailingEngine(intact))
    with pytest.raises(RuntimeError, match="the load failed"):
        worker.finish_weight_update()
    return worker


@pytest.mark.slow
@pytest.mark.parametrize("direct_reload", [False, True])
def test_a_failed_finish_on_034_ends_the_session_and_clears_the_mark(vllm034, direct_reload):
    """vLLM 0.34's own finish, failing: alone it leaves the worker marked incomplete (and,
    outside its direct reload mode, the session open); wrapped by `vllm_ext`, the session
    ends, the KV cache lent to it is returned, and the mark is cleared when the model is intact."""
    vllm_class = vllm_worker(vllm034, direct_reload=direct_reload)
    plain = failed_finish(vllm_class, intact=True)
    assert plain.has_incomplete_weight_update()
    assert plain._weight_update_active is not direct_reload

    wrapped = type("Wrapped", (vllm_class,), {})
    wrapped.finish_weight_update = compat().ending_session_on_failure(vllm_class.finish_weight_update)
    worker = failed_finish(wrapped, intact=True)
    assert not worker._weight_update_active and not worker.has_incomplete_weight_update()
    assert worker.weight_transfer_engine.targets_reset == 1  # once: by vLLM's own end, or ours

    # A rollback that failed too: the weights may be anything, and vLLM keeps saying so.
    worker = failed_finish(wrapped, intact=False)
    assert not worker._weight_update_active and worker.has_incomplete_weight_update()


@pytest.mark.slow
def test_a_failed_finish_on_032_ends_the_session_as_before(vllm032):
    vllm_class = vllm_worker(vllm032)
    assert "has_incomplete_weight_update" not in vars(vllm_class)
    assert failed_finish(vllm_class, intact=True)._weight_update_active  # vLLM 0.32 alone: still open
    wrapped = type("Wrapped", (vllm_class,), {})
    wrapped.finish_weight_update = compat().ending_session_on_failure(vllm_class.finish_weight_update)
    worker = failed_finish(wrapped, intact=True)
    assert not worker._weight_update_active and worker.weight_transfer_engine.targets_reset == 1


# -- the signatures vllm_ext calls --------------------------------------------------------------


@pytest.mark.slow
def test_vllm_ext_calls_bind_to_both_releases_signatures(vllm032, vllm034):
    """`ModelLoader` calls the layerwise reload as `initialize_layerwise_reload(model)` and
    `finalize_layerwise_reload(model, model_config)`, its helpers for the layers it loads in
    place (`get_layerwise_info(layer)`, `_place_kernel_tensors(layer, info)`, ...), and the patch loader with
    `max_chunk_bytes` and `validate_unique_indices`: each binds to both releases' functions
    (0.34 added the keyword-only `defer_processing`, whose default keeps 0.32's behaviour)."""
    import inspect

    calls = {
        ("model_executor/model_loader/reload/layerwise.py", "initialize_layerwise_reload"): ((1,), {}),
        ("model_executor/model_loader/reload/layerwise.py", "finalize_layerwise_reload"): ((1, 2), {}),
        ("model_executor/model_loader/checkpoint_weight_patch.py", "load_checkpoint_weight_patches"): (
            (1, []),
            {"max_chunk_bytes": 1, "validate_unique_indices": False},
        ),
        # A layer loaded in place, outside the reload (gpt-oss's experts), and the loaders the
        # reload leaves wrapped.
        ("model_executor/model_loader/reload/layerwise.py", "get_layerwise_info"): ((1,), {}),
        ("model_executor/model_loader/reload/layerwise.py", "_place_kernel_tensors"): ((1, 2), {}),
        ("model_executor/model_loader/reload/layerwise.py", "_copy_and_restore_kernel_tensors"): ((1, 2), {}),
        ("model_executor/model_loader/reload/layerwise.py", "_get_original_loader"): ((1,), {}),
        ("model_executor/model_loader/reload/utils.py", "get_layer_params_buffers"): ((1,), {}),
    }
    keyword_only = {}
    for package in (vllm032, vllm034):
        for (file, name), (args, kwargs) in calls.items():
            definition = function_source(package / file, name)
            definition.body = [ast.Pass()]
            definition.decorator_list = []
            # Defaults name module constants: their values do not matter to binding.
            definition.args.defaults = [ast.Constant(None) for _ in definition.args.defaults]
            definition.args.kw_defaults = [
                None if d is None else ast.Constant(None) for d in definition.args.kw_defaults
            ]
            function = compiled([definition], package / file, {})[name]
            inspect.signature(function).bind(*args, **kwargs)  # raises TypeError if not
            keyword_only[package, name] = [
                p.name for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY
            ]
    assert "defer_processing" in keyword_only[vllm034, "initialize_layerwise_reload"]
    # 0.34's finalize also runs every module's post-load hook: a cost only a GPU can measure.
    finalize = ast.unparse(function_source(vllm034 / next(iter(calls))[0], "finalize_layerwise_reload"))
    assert "finalize_model_weights(model)" in finalize


# -- device memory -------------------------------------------------------------------------------

GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize(
    ("free", "chunk"),
    [(None, 512 * MiB), (100 * GiB, 512 * MiB), (GiB, 256 * MiB), (400 * MiB, 100 * MiB), (10 * MiB, 16 * MiB)],
)
def test_patch_chunks_are_bounded_by_the_free_device_memory(free, chunk):
    assert compat().patch_chunk_bytes(free) == chunk


def test_the_free_figure_is_none_on_the_cpu():
    assert compat().free_device_bytes(None) is None
    assert compat().free_device_bytes(torch.device("cpu")) is None


def test_a_reload_that_may_not_fit_says_how_much_is_free():
    weights = [
        ("model.layers.0.mlp.down_proj.weight", torch.empty(GiB // 2, dtype=torch.uint8, device="meta")),
        ("model.layers.0.mlp.up_proj.weight", torch.empty(GiB // 2, dtype=torch.uint8, device="meta")),
        ("model.layers.1.mlp.up_proj.weight", torch.empty(GiB // 4, dtype=torch.uint8, device="meta")),
    ]
    largest = compat().layer_bytes(weights)
    assert largest == GiB  # the two tensors of layer 0's mlp
    assert compat().reload_headroom(None, largest) is None  # the CPU: nothing to judge
    assert compat().reload_headroom(3 * GiB, largest) is None
    message = compat().reload_headroom(GiB + GiB // 2, largest)
    assert "3.00 GiB" in message and "1.50 GiB is free" in message


@pytest.mark.slow
def test_the_reload_estimate_is_034s_own(vllm034):
    source = (vllm034 / "v1" / "worker" / "extensible_kv_cache.py").read_text()
    assert f"WEIGHT_UPDATE_PEAK_LAYER_FACTOR = {compat().RELOAD_PEAK_LAYER_FACTOR}\n" in source


@pytest.mark.slow
def test_the_loader_stages_and_chunks_patches_by_the_free_memory():
    """The real `ModelLoader` and vLLM 0.32's real patch loader, with three changed 8 MiB
    tensors (6 MiB of positions and values each): with nothing known of the device's memory
    (the CPU) one group is staged and one `load_weights` call made; with 64 MiB free
    (injected) the patches are staged in two groups and loaded in two calls."""
    answer = run_in_vllm(
        PROBE_MODELS,
        """
        calls = {}
        for free in (None, 64 << 20):
            model = Plain(3, 2048)
            loader = L.ModelLoader(model, None, shapes={n: tuple(p.shape) for n, p in model.named_parameters()})
            L.free_device_bytes = lambda device, free=free: free
            stage, groups = loader._stage, []
            loader._stage = lambda changes: groups.append(sorted(changes)) or stage(changes)
            loader.load_patches([
                WeightPatch(name, torch.full_like(p, 2.0), torch.arange(0, p.numel(), 7))
                for name, p in model.named_parameters()
            ])
            calls[str(free)] = {"load_weights": model.calls, "groups": groups}
            assert all(bool((p.view(-1)[::7] == 2.0).all()) for p in model.parameters())
        print(json.dumps(calls))
        """,
    )
    names = [f"layers.{i}.weight" for i in range(3)]
    assert json.loads(answer) == {
        "None": {"load_weights": 1, "groups": [names]},
        str(64 << 20): {"load_weights": 2, "groups": [names[:2], names[2:]]},
    }


def test_staging_groups_hold_at_most_a_share_of_the_free_memory():
    sizes = {"a": 6 * MiB, "b": 6 * MiB, "c": 6 * MiB, "huge": 100 * MiB, "d": MiB}
    assert compat().staging_groups(sizes, None) == [list(sizes)]
    assert compat().staging_groups(sizes, 64 * MiB) == [["a", "b"], ["c"], ["huge"], ["d"]]
    assert compat().staging_groups(sizes, 100 * GiB) == [list(sizes)]
    assert compat().staging_groups({}, 64 * MiB) == [[]]


# -- a tied lm_head ------------------------------------------------------------------------------

#: Tiny models for the loader, with vLLM 0.32's real `AutoWeightsLoader` as their `load_weights`.
PROBE_MODELS = """
import json
import torch
from torch import nn
from vllm.model_executor.models.utils import AutoWeightsLoader
from delta_sync.errors import ApplyError
from delta_sync.replica.receiver import WeightPatch
import vllm_ext.loader as L


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 8, dtype=torch.bfloat16)
        self.norm = nn.LayerNorm(8, dtype=torch.bfloat16)


class Tied(nn.Module):
    '''lm_head shares the embedding's weight. Its loader skips `lm_head.weight` without a word,
    as vLLM 0.34's AutoWeightsLoader skips a tied alias (which it finds on vLLM's own embedding
    class, whose construction needs a distributed group: here plain torch modules, so the skip
    is done before the real AutoWeightsLoader sees the names), and `skip` likewise.'''

    def __init__(self, skip=()):
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(8, 64, bias=False, dtype=torch.bfloat16)
        self.lm_head.weight = self.model.embed_tokens.weight
        self.skip = ["lm_head.", *skip]
        self.calls = 0

    def load_weights(self, weights):
        self.calls += 1
        kept = ((name, tensor) for name, tensor in weights if not name.startswith(tuple(self.skip)))
        return AutoWeightsLoader(self).load_weights(kept)


class Plain(nn.Module):
    def __init__(self, layers, width):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False, dtype=torch.bfloat16) for _ in range(layers))
        self.calls = 0

    def load_weights(self, weights):
        self.calls += 1
        return AutoWeightsLoader(self).load_weights(weights)
"""


@pytest.mark.slow
def test_a_change_sent_under_a_tied_alias_loads_into_the_embedding_and_a_skipped_name_fails_the_load():
    """vLLM's loaders skip a tied `lm_head.weight` (0.34 without a word, where 0.32 raised
    when the embedding was not loaded with it): the loader sends it as the embedding; and a
    name vLLM's loader reports it did not load fails the load (the receiver rolls back)."""
    answer = run_in_vllm(
        PROBE_MODELS,
        """
        model = Tied()
        shapes = {"model.embed_tokens.weight": (64, 8), "lm_head.weight": (64, 8), "model.norm.weight": (8,)}
        loader = L.ModelLoader(model, None, shapes=shapes)
        new = torch.randn(64, 8).to(torch.bfloat16)
        loader.load_patches([WeightPatch("lm_head.weight", new, None)])
        result = {"embedding_loaded": torch.equal(model.model.embed_tokens.weight, new)}
        result["lm_head_is_it"] = model.lm_head.weight is model.model.embed_tokens.weight
        result["aliases"] = loader._aliases

        skipping = Tied(skip=["model.norm."])  # a loader that drops a name without raising
        loader = L.ModelLoader(skipping, None, shapes=shapes)
        try:
            loader.load_patches([WeightPatch("model.norm.weight", torch.ones(8, dtype=torch.bfloat16), None)])
        except ApplyError as error:
            result["refused"] = str(error)
        result["intact"] = loader.intact
        print(json.dumps(result))
        """,
    )
    result = json.loads(answer)
    assert result["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert result["embedding_loaded"] and result["lm_head_is_it"]
    assert "did not load 1 changed tensor(s) sent to it: model.norm.weight" in result["refused"]
    assert result["intact"] is False


def test_tied_aliases_name_the_tensor_each_alias_shares():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(4, 2)
    model.head = torch.nn.Linear(2, 4, bias=False)
    model.head.weight = model.embed.weight
    model.norm = torch.nn.LayerNorm(2)
    assert compat().tied_aliases(model) == {"head.weight": "embed.weight"}
    runtime_of = {"embed.weight": "embed.weight", "norm.weight": "norm.weight"}
    assert compat().unconsumed(["embed.weight", "norm.weight"], {"embed.weight"}, runtime_of) == ["norm.weight"]
    assert compat().unconsumed(["norm.weight"], None, runtime_of) == []  # a loader that reports nothing
    assert compat().unconsumed(["experts.0.w1.weight"], set(), runtime_of) == []  # not known: not judged


@pytest.mark.slow
def test_034s_auto_weights_loader_no_longer_raises_on_a_skipped_alias(vllm032, vllm034):
    """Why the loader checks what vLLM reports loaded: the guard 0.32 had is gone in 0.34."""
    path = "model_executor/models/utils.py"
    assert "_check_skipped_aliases" in (vllm032 / path).read_text()
    assert "_check_skipped_aliases" not in (vllm034 / path).read_text()


# -- plain parameters on mixed devices -----------------------------------------------------------

DEVICES = [
    "cpu",
    # Refuses operands from another device as CUDA does; stands in for a GPU here.
    "meta",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_positions_and_values_are_taken_to_the_device_of_the_tensor_they_meet(device):
    """With `--cpu-offload-gb` plain parameters live on the host and on the GPU at once:
    positions and values staged on the host must go to the device of each tensor written."""
    flat = torch.zeros(16, dtype=torch.bfloat16, device=device)
    positions, values = torch.tensor([1, 5, 9], dtype=torch.int32), torch.tensor([1.0, 2.0, 3.0])
    if device == "meta":
        with pytest.raises(RuntimeError, match="same device"):
            flat.index_copy_(0, positions.long(), values.to(flat.dtype))  # what the loader did
    compat().write_positions(flat, positions, values, offset=2)
    if device != "meta":
        assert flat.cpu()[[3, 7, 11]].tolist() == [1.0, 2.0, 3.0] and flat.count_nonzero() == 3


def test_every_cuda_device_written_is_synchronised():
    devices = [torch.device("cuda", 1), torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)]
    assert compat().cuda_devices(devices) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert compat().synchronize_devices([torch.device("cpu"), torch.device("meta")]) == []


@pytest.mark.slow
def test_the_loader_writes_into_a_parameter_on_another_device_than_its_staging():
    """The real `ModelLoader`'s direct write, one parameter on the CPU and one elsewhere
    (`meta`, which refuses host operands as CUDA does): both writes go through."""
    answer = run_in_vllm(
        PROBE_MODELS,
        """
        model = Plain(2, 8)
        model.layers[1].to("meta")
        loader = L.ModelLoader(model, None, shapes={n: tuple(p.shape) for n, p in model.named_parameters()})
        assert loader.patch_device() is None  # not one CUDA device: the patches stay on the host
        writes = []
        for name, p in model.named_parameters():
            patch = WeightPatch(name, torch.full(tuple(p.shape), 3.0, dtype=torch.bfloat16), torch.tensor([0, 9, 63]))
            writes.append((patch, (patch.positions, torch.full((3,), 3.0, dtype=torch.bfloat16))))
        loader._write_direct(writes)
        print(json.dumps({"cpu": model.layers[0].weight.view(-1)[[0, 9, 63]].tolist()}))
        """,
    )
    assert json.loads(answer) == {"cpu": [3.0, 3.0, 3.0]}


# -- a pause that answers 503 --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_a_client_pausing_in_wait_or_abort_mode_retries_503s_until_it_resumes(run, server, mode):
    """vLLM 0.34 answers requests with a retryable 503 from `/pause?mode=wait|abort` until
    `/resume`. The trainer's client sends its load and cache reset during its own pause: a
    503 there is retried (on the fake vLLM of tests/fake_vllm.py, whose `/pause` is plain),
    the update completes and the server is resumed."""
    from delta_sync.control import Route
    from delta_sync.control.client import Replica

    server.add_fault(Route.FINISH, 503, count=1)
    server.add_fault(Route.RESET_PREFIX_CACHE, 503, count=1)
    client = Replica(server.url, pause_mode=mode, retry_seconds=10.0, timeout=30.0)
    try:
        assert client.update(run.root.as_uri()).version == run.version
    finally:
        client.close()
    calls = [(call.route, call.status) for call in server.calls if call.route != Route.COLLECTIVE_RPC]
    finish = calls.index((Route.FINISH, 503))
    assert calls[finish - 1] == (Route.PAUSE, 200)
    assert calls[finish + 1 :] == [
        (Route.FINISH, 200),
        (Route.RESET_PREFIX_CACHE, 503),
        (Route.RESET_PREFIX_CACHE, 200),
        (Route.RESUME, 200),
    ]
