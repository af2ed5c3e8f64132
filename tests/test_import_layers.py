"""The package's import graph, read from the source with ``ast``: no circles anywhere in
``src/lightning_zero``, no Lightning under ``engine/`` or ``checkpoint/``, and the engine's
sub-packages importing one way only (``lightning_zero/engine/__init__.py`` draws the map). And one
rule about calls: only ``engine/comm/streams.py`` touches a device's streams and events (see [Note:
the stream layer]), since what bypasses it is invisible to the schedule explorer.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING``, since a circle a
type checker follows is still two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Optional

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "lightning_zero"

ENGINE = f"{PACKAGE}.engine"
ENGINE_LAYERS = [{"parameters", "gradients"}, {"buckets"}, {"offload"}, {"optimizer"}, {"comm"}, {"shards"}]
"""Top to bottom: a sub-package imports only those in a lower layer (and itself)."""
ENGINE_BASE = {"config", "device_roles", "zero_plus_plus"}
"""Engine modules beside the sub-packages that any of them may import; they import nothing of the engine
but each other."""
FRAMEWORK_FREE = (f"{PACKAGE}.engine", f"{PACKAGE}.checkpoint")
LIGHTNING = ("lightning", "pytorch_lightning")


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root``, by dotted name (a package by its ``__init__``)."""
    names = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """What ``name`` imports: for ``from X import Y``, module ``X.Y`` where there is one, else ``X``.
    Names outside ``modules`` are kept as written (``lightning``, ``torch.nn``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node.module, node.level)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return found


def _absolute(name: str, is_package: bool, module: Optional[str], level: int) -> str:
    if not level:
        return module or ""
    parts = name.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (level - 1)]
    return ".".join([*anchor, module] if module else anchor)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = module_names(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one that imports itself
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start] & graph.keys())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt] & graph.keys()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


def framework_imports(graph: dict[str, set[str]], packages: Iterable[str]) -> list[str]:
    """``module -> lightning...`` for every import of Lightning by a module of ``packages``."""
    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        if any(module == p or module.startswith(p + ".") for p in packages)
        for target in sorted(targets)
        if target.split(".")[0] in LIGHTNING
    ]


def _engine_part(module: str) -> Optional[str]:
    """The engine sub-package or top-level engine module that ``module`` belongs to."""
    if not module.startswith(ENGINE + "."):
        return None
    return module[len(ENGINE) + 1 :].split(".")[0]


def _layer(part: str) -> Optional[int]:
    return next((i for i, layer in enumerate(ENGINE_LAYERS) if part in layer), None)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the engine's declared direction: a sub-package importing one at its own layer
    or above, or the facade (any other engine module or the package itself); a base module
    importing anything of the engine but the other base modules."""
    wrong = []
    for module, targets in sorted(graph.items()):
        part = _engine_part(module)
        if part is None:
            continue
        for target in sorted(targets):
            if target != ENGINE and _engine_part(target) is None:
                continue  # outside the engine
            to = _engine_part(target) if target != ENGINE else None
            if part in ENGINE_BASE:
                allowed = to in ENGINE_BASE
            elif _layer(part) is not None:
                allowed = to == part or to in ENGINE_BASE or (_layer(to) is not None and _layer(to) > _layer(part))
            else:
                allowed = True  # the facade composes the parts
            if not allowed:
                wrong.append(f"{module} -> {target}")
    return wrong


def test_every_engine_module_is_placed():
    """A new sub-package or top-level engine module must be given its place in the map."""
    parts = {_engine_part(m) for m in module_names(SRC, ENGINE)} - {None}
    facade = {"engine", "full_weights", "host_step_overlap", "memory", "optimizers"}
    placed = set().union(*ENGINE_LAYERS) | ENGINE_BASE | facade
    assert parts <= placed, f"engine parts without a place in ENGINE_LAYERS / ENGINE_BASE: {sorted(parts - placed)}"


def test_no_import_circles():
    found = circles(import_graph(SRC, PACKAGE))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_engine_and_checkpoint_import_no_lightning():
    found = framework_imports(import_graph(SRC, PACKAGE), FRAMEWORK_FREE)
    assert not found, "Lightning imported where the code must run without it:\n" + "\n".join(found)


def test_engine_sub_packages_import_one_way():
    found = layer_violations(import_graph(SRC, PACKAGE))
    assert not found, "imports against the engine's direction (see lightning_zero/engine/__init__.py):\n" + "\n".join(found)


STREAM_LAYER = f"{PACKAGE}.engine.comm.streams"
STREAM_APIS = {"Stream", "Event", "stream", "current_stream", "default_stream", "set_stream", "synchronize", "ExternalStream"}
"""``torch.cuda``'s stream and event API, which only the stream layer may use."""


def stream_calls_outside_the_layer(root: Path) -> list[str]:
    """Places in the engine, but for the stream layer, that use ``torch.cuda``'s stream or event API
    or ``record_stream``."""
    found = []
    for name, path in module_names(root, ENGINE).items():
        if name == STREAM_LAYER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Attribute):
                continue
            cuda_api = node.attr in STREAM_APIS and ast.unparse(node.value) == "torch.cuda"
            if cuda_api or node.attr == "record_stream":
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_stream_layer_touches_streams_and_events():
    found = stream_calls_outside_the_layer(SRC)
    assert not found, "stream or event calls outside engine/comm/streams.py (see [Note: the stream layer]):\n" + "\n".join(found)


@pytest.fixture
def broken_tree(tmp_path: Path) -> Path:
    """A package with each fault the checks look for, to show they find them."""
    files = {
        "__init__.py": "",
        "engine/__init__.py": "from lightning_zero.engine.engine import ZeroEngine\n",
        "engine/engine.py": "from lightning_zero.engine.comm import collectives\nclass ZeroEngine: ...\n",
        "engine/config.py": "",
        "engine/parameters/module_link.py": "",
        "engine/comm/__init__.py": "",
        "engine/comm/collectives.py": "from lightning_zero.engine.shards import partition\n",
        "engine/comm/streams.py": "import torch\ns = torch.cuda.Stream()\n",
        "engine/comm/copies.py": "import torch\ne = torch.cuda.Event()\nt.record_stream(s)\n",
        "engine/shards/__init__.py": "",
        "engine/shards/partition.py": "def f():\n    from lightning_zero.engine.buckets.bucket import Bucket\n",
        "engine/buckets/__init__.py": "",
        "engine/buckets/bucket.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_zero.engine.shards import partition\n"
            "from lightning_zero.engine import ZeroEngine\nimport lightning.pytorch as pl\n"
        ),
        "checkpoint/__init__.py": "",
        "checkpoint/io.py": "from lightning.fabric.plugins import TorchCheckpointIO\n",
    }
    for name, text in files.items():
        path = tmp_path / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_checks_find_each_fault(broken_tree: Path):
    graph = import_graph(broken_tree, PACKAGE)
    # partition <-> bucket, and bucket -> the package -> engine -> collectives -> partition
    assert circles(graph) == [
        [
            "lightning_zero.engine",
            "lightning_zero.engine.buckets.bucket",
            "lightning_zero.engine.comm.collectives",
            "lightning_zero.engine.engine",
            "lightning_zero.engine.shards.partition",
        ]
    ]
    assert framework_imports(graph, FRAMEWORK_FREE) == [
        "lightning_zero.checkpoint.io -> lightning.fabric.plugins",
        "lightning_zero.engine.buckets.bucket -> lightning.pytorch",
    ]
    assert stream_calls_outside_the_layer(broken_tree) == [
        "lightning_zero.engine.comm.copies:2: torch.cuda.Event",
        "lightning_zero.engine.comm.copies:3: t.record_stream",
    ]
    assert layer_violations(graph) == [
        "lightning_zero.engine.buckets.bucket -> lightning_zero.engine",
        "lightning_zero.engine.shards.partition -> lightning_zero.engine.buckets.bucket",
    ]
