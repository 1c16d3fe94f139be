"""The package's layering (docs/architecture.md): each package imports only from layers below
it, and the config and the planner's core import no torch.

Read from the source with `ast`, so lazy imports inside functions count too. `__main__.py`
files are entry points (`python -m shardwise.train` hands over to the CLI) and sit above
everything.
"""

import ast
from pathlib import Path

import shardwise

PACKAGE = Path(shardwise.__file__).parent

# Lowest first; every unit is one package (or a top-level module). The pure core holds the model
# description and the layout rules; models/ holds each family's torch-free spec beside its torch
# side, so config/ (which validates a run against a family's traits) sits above it; the planner is
# pure and sits under the runtime, so train's auto-resolution can call it; runtime/ is the process
# machinery (launch, heartbeats, pools) the parallelisms in distributed/ run on; checkpoint/ reads
# the pipeline's parts and sits under train, infer and convert, which all read checkpoints.
LAYERS = [
    {"core"},
    {"models"},
    {"config"},
    {"data", "compile", "planner", "generation"},
    {"runtime"},
    {"distributed"},
    {"observe"},
    {"checkpoint"},
    {"train"},
    {"infer"},
    {"convert"},
    {"cli"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
TORCH_FREE = {"core", "config", "planner"}


def unit_of(module: str) -> str:
    """`shardwise.planner.search` -> "planner"; `shardwise.convert` -> "convert"."""
    return module.split(".")[1]


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def imports_of(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def package_modules():
    """(path, module) of every module but the entry points and `shardwise/__init__.py`."""
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if path.name != "__main__.py" and module != "shardwise":
            yield path, module


def test_every_package_is_placed_in_a_layer():
    units = {unit_of(module) for _, module in package_modules()}
    assert units <= set(RANK), f"place these in LAYERS: {sorted(units - set(RANK))}"


def test_packages_import_only_from_layers_below():
    wrong = []
    for path, module in package_modules():
        own = unit_of(module)
        for target in imports_of(path):
            if not target.startswith("shardwise."):
                continue
            other = unit_of(target)
            if other != own and RANK[other] >= RANK[own]:
                wrong.append(f"{module} imports {target} ({own} is layer {RANK[own]}, {other} layer {RANK[other]})")
    assert not wrong, "\n".join(wrong)


def module_graph() -> dict[str, set[str]]:
    """Module -> the shardwise modules it imports (`from shardwise.x import y` counts as
    importing `shardwise.x.y` when that is a module)."""
    modules = dict((module, path) for path, module in package_modules())
    graph = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[module] = {target for target in targets if target in modules and target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    assert cycles(module_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_config_and_planner_core_import_no_torch():
    wrong = [f"{module} imports {target}" for path, module in package_modules() if unit_of(module) in TORCH_FREE
             for target in imports_of(path) if target.split(".")[0] == "torch"]
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_sees_a_wrong_import(tmp_path):
    """The check itself: an import from a higher layer is reported (so the tests above can fail)."""
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from shardwise.train.trainer import train\n")
    targets = imports_of(module)
    assert targets == ["shardwise.train.trainer"]
    assert RANK[unit_of(targets[0])] > RANK[unit_of("shardwise.distributed.dims")]
