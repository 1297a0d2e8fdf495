"""The package's import structure: one path from the public ops down to the launch, imports
that only point down, no cycles. Parsed from the source (no import side effects).

A new module must be placed in :data:`LAYERS` (the layer says what it may use). ``import
cudnorm`` stays cheap: the heavy modules are imported on first use.
"""

import ast
import os
import pathlib
import subprocess
import sys

import cudnorm

ROOT = pathlib.Path(cudnorm.__file__).parent

# Library modules, lowest first; a module may import modules of lower layers only.
LAYERS = [
    ("_entry", "_gpu_lock", "_lru", "_ops", "_patch_table", "_progress", "_sleep_timing", "_spec", "_version",
     "_warn", "reference"),  # no package imports
    ("_triton_launch",),  # what C++ needs to launch a compiled kernel; Python's launches through C++
    ("_ada_kernel", "_norm_kernel"),  # cudnorm's Triton kernels (C++ launches them: _triton_launch)
    ("_ada_rms", "_gated", "_settings", "_token_ada"),  # adaptive RMSNorm's formula and kernels; the gated
    # residual's; the per-token modulated norms' formula and kernels
    ("_candidates", "_policy", "_recording", "_runtime"),  # _candidates: the kernels a call may run
    ("_checks", "_graphs"),  # argument checks; graph IR, build and launch
    ("_dispatch", "_plan_store"),  # a call's spec and buffers; plans on disk
    ("_cache", "_decisions"),  # the plan of a spec: memory LRU -> plan store -> build; measured decisions
    ("_rows", "_token_entry"),  # row counts: exact plans or chunks; a per-token modulated norm's checks and
    # measured decision
    ("_call_plans",),  # a call's plan, memoised by its signature
    ("_ada_strategies", "_norm"),  # AdaLN strategies; LayerNorm/RMSNorm implementation
    ("_fused_add",),  # with a residual add
    ("ada_layer_norm", "ada_rms_norm", "layer_norm", "rms_norm"),  # public ops and their custom ops
    ("gated_ada_layer_norm",),  # a gated residual into the adaptive LayerNorm
    ("_diffusers_forwards", "_info", "_native", "_sharding", "modules", "warmup"),  # _diffusers_forwards: the
    # arithmetic of the diffusers classes and the forwards patch runs on diffusers' other AdaLN classes
    ("diffusers",),
    ("_diffusers_block_ops",),  # a norm and its modulation as one op, for the fused blocks
    ("_diffusers_block_forwards",),  # fused forwards of the newer diffusers blocks
    ("_diffusers_blocks",),  # whole diffusers blocks on cudnorm's fused modulation: the table
    ("patching",),
    ("__init__",),  # the package
]
# Front ends: built on the package (they may import it); nothing in the library imports them.
FRONT_ENDS = ("_self_check", "cli", "_bench")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """module -> package modules it imports (dotted names relative to the package; ``__init__``
    for the package itself), at any depth of the file (function-level imports count)."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        name = _module_name(path)
        package = name.split(".")[:-1]  # the package this module sits in
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[:len(package) - (node.level - 1)]
                targets = [base + node.module.split(".")] if node.module else [base + [a.name] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "cudnorm":
                targets = [node.module.split(".")[1:]]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "cudnorm"]
            else:
                continue
            for parts in targets:
                # the longest prefix that is a module or package of cudnorm (a name imported
                # from a package resolves to the package)
                while parts and not ((ROOT.joinpath(*parts).with_suffix(".py")).exists() or ROOT.joinpath(*parts).is_dir()):
                    parts = parts[:-1]
                target = ".".join(parts) if parts else "__init__"
                if ROOT.joinpath(*parts).is_dir() and parts:
                    target += ".__init__"
                if target != name:
                    found.add(target)
        graph[name] = found
    return graph


def _front_end(name: str) -> bool:
    return name.split(".")[0] in FRONT_ENDS


def test_every_library_module_has_a_layer():
    placed = [m for layer in LAYERS for m in layer]
    assert len(placed) == len(set(placed))
    library = {n for n in _imports() if "." not in n and not _front_end(n)}
    assert library == set(placed), ("place new modules in LAYERS, remove deleted ones: "
                                    f"{sorted(library ^ set(placed))}")


def test_imports_point_down():
    layer = {m: i for i, names in enumerate(LAYERS) for m in names}
    wrong = []
    for name, targets in _imports().items():
        for target in targets:
            if _front_end(name):
                continue  # front ends use the package and their own modules
            if _front_end(target):
                wrong.append(f"{name} -> {target} (a front end)")
            elif layer[target] >= layer[name]:
                wrong.append(f"{name} (layer {layer[name]}) -> {target} (layer {layer[target]})")
    assert not wrong, "imports that do not point down:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = _imports()
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a front end's own package imports its submodules, which import the package's helpers:
    # only cycles through the package roots' __init__ re-exports are tolerated there
    real = [c for c in cycles if not all(_front_end(p) for p in c.split(" -> "))]
    assert not real, "import cycles:\n" + "\n".join(real)


def _module_aliases(tree: ast.AST, package: str) -> dict[str, str]:
    """name -> dotted cudnorm module it is bound to in one file (``from . import x``,
    ``import cudnorm.x as y``, ``y = importlib.import_module("cudnorm.x")``)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full.startswith("cudnorm.") and ROOT.parent.joinpath(*full.split(".")).with_suffix(".py").exists():
                    aliases[alias.asname or alias.name] = full
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("cudnorm.")})
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
              and getattr(node.value.func, "attr", "") == "import_module"
              and isinstance(node.value.args[0], ast.Constant) and isinstance(node.targets[0], ast.Name)
              and str(node.value.args[0].value).startswith("cudnorm.")):
            aliases[node.targets[0].id] = node.value.args[0].value
    return aliases


def test_attributes_read_from_package_modules_exist():
    """``module.name`` reads of cudnorm modules in the package, tests, benchmarks and examples
    resolve: a function moved to another module breaks its old callers here, on the CPU, not
    in a GPU-only benchmark (``_bench.host_overhead`` read ``ada_layer_norm._gain`` after it
    had moved to ``_ada_strategies``)."""
    import importlib  # noqa: PLC0415

    repo = ROOT.parent
    missing = []
    for folder in ("cudnorm", "tests", "benchmarks", "examples"):
        for path in sorted(repo.joinpath(folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            package = ".".join(path.relative_to(repo).with_suffix("").parts[:-1])
            aliases = _module_aliases(tree, package)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                        and isinstance(node.value, ast.Name) and node.value.id in aliases):
                    module = importlib.import_module(aliases[node.value.id])
                    if not hasattr(module, node.attr):
                        missing.append(f"{path.relative_to(repo)}:{node.lineno} {aliases[node.value.id]}.{node.attr}")
    assert not missing, "attributes that do not exist:\n" + "\n".join(missing)


# Imported on first use, never by ``import cudnorm`` or the CLI's parser: DTensor (over a
# second, with sympy), the cuDNN frontend, plotting, the model libraries of cudnorm.patch and
# the benchmarks, the notebook runner, torch.compile's stack.
HEAVY = ("torch.distributed.tensor", "sympy", "cudnn", "matplotlib", "transformers", "diffusers", "nbformat",
         "nbclient", "torch._dynamo", "torch._inductor")
_PROBE = """
import json, sys
import torch
before = set(sys.modules)
import cudnorm, cudnorm.cli
loaded = [m for m in json.loads(sys.argv[1]) if m in sys.modules and m not in before]
from torch.distributed.tensor import DTensor
rules = DTensor._op_dispatcher.sharding_propagator.op_to_schema_info
print(json.dumps({"loaded": loaded, "ruled": torch.ops.cudnorm.layer_norm_fwd.default in rules}))
"""


def test_import_leaves_heavy_modules_unimported():
    """``import cudnorm`` (and the CLI) adds none of :data:`HEAVY` to what ``import torch``
    loads; importing
    ``torch.distributed.tensor`` afterwards registers the ops' sharding rules (a fresh
    interpreter: this one has imported them all)."""
    import json  # noqa: PLC0415

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT.parent), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(HEAVY)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["loaded"] == [], f"import cudnorm imported {result['loaded']}"
    assert result["ruled"], "importing torch.distributed.tensor did not register cudnorm's sharding rules"
