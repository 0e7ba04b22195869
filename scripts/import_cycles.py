"""No import cycles among embedq's modules, package ``__init__`` modules included (issue 38).

import-linter's ``acyclic_siblings`` contract (pyproject.toml) finds cycles between the children of each package; a
cycle through a package's own ``__init__`` (``embedq.backends`` → ``embedq.backends.dense`` → ``embedq.backends``)
is no sibling's, so this check walks the whole module graph. It uses grimp, import-linter's graph: function-local
and TYPE_CHECKING imports count. Exit status 1, with each cycle's imports, when there is one.
"""

from __future__ import annotations

import sys

import grimp


def cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    inside = set(modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & inside) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
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
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def main() -> int:
    package = sys.argv[1] if len(sys.argv) > 1 else "embedq"
    graph = grimp.build_graph(package, cache_dir=None)
    found = cycles(graph, package)
    for component in found:
        print(f"import cycle among {', '.join(component)}:")
        members = set(component)
        for importer in component:
            for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
                for detail in graph.get_import_details(importer=importer, imported=imported):
                    print(f"  {importer}:{detail['line_number']} {detail['line_contents']}")
    if not found:
        print(f"no import cycles in {package}")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
