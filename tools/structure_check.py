"""Structure limits of the package (run by ``make lint``): sizes a reader can hold and a one-way import graph.

Checks every tracked ``.py`` file of ``alignopsd/``, ``kernels/``, ``engine/`` and ``bench/`` (tests are exempt):

* files of at most ``--max-file`` lines (500);
* functions of at most ``--max-func`` lines (80), decorator included; a ``@triton.jit`` kernel is exempt
  (splitting a kernel body costs registers and launches);
* no import cycle between the project's own modules (lazy imports inside functions count: a cycle is a cycle);
* no module imports another module's ``_private`` name;
* imports between the engine's subpackages point down the layers (:data:`ENGINE_LAYERS`, the order docs/DESIGN.md
  writes): a module may import its own layer (no cycle, see above) and the layers below, never one above. Lazy imports
  inside functions count, and so do imports under ``if TYPE_CHECKING:``: a type named from an upper layer is a
  dependency on it all the same (the step owns the types it is handed). A subpackage missing from the table is a
  finding too, so a new one is placed on purpose. The engine's own top-level modules (``__main__``) sit above all.
* nothing in ``alignopsd/``, ``kernels/`` or ``engine/`` imports the labelled testing module (:data:`TESTING`; the
  benchmarks may): what tests and checks use stays off a run's path;
* nothing in ``engine/`` probes a generation backend, a policy backend, an environment or an estimator's output
  with ``getattr``/``hasattr``/``isinstance``: what the engine reads is declared on the protocol or type
  (:func:`probes`; the objects are recognised by the names the engine gives them, ``PROBED_NAMES``).

Prints each finding and exits 1 when there is one, 0 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

# folder -> import name (setup.py's package_dir)
PACKAGES = {"alignopsd": "alignopsd", "kernels": "alignopsd.kernels", "engine": "alignopsd.engine", "bench": "bench"}

ENGINE = "alignopsd.engine"
TESTING = "alignopsd.testing"  # loop references and kernel routing switches for tests and benchmarks, never for a run
# The engine's subpackages, one layer per row, from the bottom; imports only point down (or within a row).
ENGINE_LAYERS: tuple[tuple[str, ...], ...] = (
    ("infra", "parallel"),  # write failures, caches; processes, devices, collectives
    ("checkpoint", "observe"),  # files a run writes and trusts; metrics, profiler, progress, audit, report, strict
    ("models", "envs", "tokens"),  # embedded models; environments; token layout (positions, padding)
    ("config",),  # the run's schema (it names the environments), pre-flight and architecture checks
    ("policy", "generation"),  # backends behind their protocols, row scoring
    ("step",),  # one step; owns the type of what it is handed (Components)
    ("run",),  # the composition root: trainer loop, components builder, resume, preemption, lock
    ("lab",),  # what a step and a run cost, measured and estimated (profile --cost, plan, memory, the estimate)
    ("commands",),  # the CLI
)
LAYER_OF = {sub: i for i, row in enumerate(ENGINE_LAYERS) for sub in row}


def module_name(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    rest = parts[1:-1] if parts[-1] == "__init__" else parts[1:]
    return ".".join([PACKAGES[parts[0]], *rest])


def tracked_files(root: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=root, capture_output=True, text=True, check=True).stdout
    return [Path(p) for p in out.split() if Path(p).parts[0] in PACKAGES]


def is_triton_kernel(node: ast.AST) -> bool:
    for dec in getattr(node, "decorator_list", []):
        target = dec.func if isinstance(dec, ast.Call) else dec
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def jitted_names(tree: ast.AST) -> set[str]:
    """Functions compiled by a ``triton.jit(f)`` call instead of the decorator, or handed to the kernels'
    ``launch(f, grid, ...)`` or ``launch_tuned(f, ...)`` (which jit them)."""
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Name):
            continue
        name = ast.unparse(node.func)
        if name in ("triton.jit", "jit") or name.split(".")[-1] in ("launch", "launch_tuned"):
            out.add(node.args[0].id)
    return out


def long_functions(tree: ast.AST, limit: int) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length) of every function over ``limit`` lines (Triton kernels exempt)."""
    found = []
    jitted = jitted_names(tree)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                kernel = is_triton_kernel(child) or child.name in jitted
                if not isinstance(child, ast.ClassDef) and not kernel:
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    length = child.end_lineno - first + 1
                    if length > limit:
                        found.append((name, first, length))
                visit(child, name + ".")

    visit(tree, "")
    return found


# the names the engine gives a generation backend, a policy backend, an environment (or its manager) and an
# estimator's output (or its parts); ``x`` and ``a.b.x`` both count
PROBED_NAMES = frozenset(
    {"generator", "backend", "inner", "policy", "env", "env_manager", "est_out", "estimator_output", "credit"}
)
PROBES = ("getattr", "hasattr", "isinstance")


def probes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) of each ``getattr``/``hasattr``/``isinstance`` whose first argument is one of
    ``PROBED_NAMES`` (a plain name or an attribute ending in one)."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES):
            continue
        if not node.args:
            continue
        first = node.args[0]
        last = first.id if isinstance(first, ast.Name) else first.attr if isinstance(first, ast.Attribute) else None
        if last in PROBED_NAMES:
            found.append((node.lineno, ast.unparse(node)))
    return found


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``from ... import`` statement names."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def is_module_file(root: Path, module: str, alias: str) -> bool:
    """Whether ``module.alias`` is a module on disk (e.g. the compiled extension ``alignopsd._C``)."""
    head, *rest = module.split(".")
    folder = {v: k for k, v in PACKAGES.items()}.get(module, "/".join([head, *rest]))
    return any((root / folder).glob(f"{alias}.*")) or (root / folder / alias).is_dir()


def imports_of(tree: ast.AST, name: str, is_package: bool, modules: set[str], root: Path) -> tuple[set[str], list]:
    """(project modules imported, [(line, module, private name)] of private names taken from other modules)."""
    deps: set[str] = set()
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            target = resolve(name, is_package, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:  # ``from pkg import module``
                    deps.add(sub)
                elif target in modules:
                    deps.add(target)
                    private_name = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private_name and target != name and not is_module_file(root, target, alias.name):
                        private.append((node.lineno, target, alias.name))
    deps.discard(name)
    return deps, private


def engine_layer(module: str, modules: set[str]) -> tuple[str | None, int | None]:
    """(subpackage, layer) of an engine module: (None, None) outside the engine; the engine package and its own
    top-level modules (``__main__``) are above every layer; a subpackage missing from :data:`ENGINE_LAYERS` has
    layer None."""
    parts = module.split(".")
    if module != ENGINE and not module.startswith(ENGINE + "."):
        return None, None
    top_module = len(parts) == 3 and not any(m.startswith(module + ".") for m in modules)
    if len(parts) == 2 or top_module:
        return "", len(ENGINE_LAYERS)
    return parts[2], LAYER_OF.get(parts[2])


def layer_findings(tree: ast.AST, name: str, path: Path, modules: set[str]) -> list[str]:
    """One line per import of ``name`` that points up the engine's layers (or into a subpackage with no layer)."""
    sub, layer = engine_layer(name, modules)
    if sub is None:
        return []
    if layer is None:
        return [f"{path}: engine/{sub}/ is in no layer (add it to ENGINE_LAYERS and to docs/DESIGN.md's layer order)"]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, path.name == "__init__.py", node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            tsub, tlayer = engine_layer(target, modules)
            if tsub is None or tsub == sub or tlayer is None or tlayer <= layer:
                continue
            out.append(
                f"{path}:{node.lineno} imports {target}: engine/{tsub}/ is above engine/{sub}/ in the layer order "
                "(move the shared part down, or pass it in)"
            )
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-file", type=int, default=500)
    ap.add_argument("--max-func", type=int, default=80)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    args = ap.parse_args(argv)
    root = Path(args.root)
    files = tracked_files(root)
    names = {module_name(f): f for f in files}
    modules = set(names)
    findings: list[str] = []
    graph: dict[str, set[str]] = {}
    for name, path in sorted(names.items()):
        src = (root / path).read_text()
        lines = src.count("\n") + (0 if src.endswith("\n") else 1)
        if lines > args.max_file:
            findings.append(f"{path}: {lines} lines (limit {args.max_file})")
        tree = ast.parse(src, filename=str(path))
        for func, first, length in long_functions(tree, args.max_func):
            findings.append(f"{path}:{first} {func}: {length} lines (limit {args.max_func})")
        graph[name], private = imports_of(tree, name, path.name == "__init__.py", modules, root)
        for line, target, alias in private:
            findings.append(f"{path}:{line} imports the private name {alias} from {target}")
        findings.extend(layer_findings(tree, name, path, modules))
        if path.parts[0] == "engine":
            for line, call in probes(tree):
                findings.append(f"{path}:{line} probes a contracted object ({call}): declare the member instead")
    for name, deps in sorted(graph.items()):
        if TESTING in deps and name != TESTING and not name.startswith("bench"):
            findings.append(f"{names[name]}: imports {TESTING}, which only tests and benchmarks may use")
    for comp in cycles(graph):
        findings.append("import cycle: " + " <-> ".join(comp))
    for f in findings:
        print(f)
    print(f"structure check: {len(files)} files, {len(findings)} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
