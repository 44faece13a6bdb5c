"""The product apart from the laboratory: kvslim (src/kvslim) never imports the lab
(lab/kvslim_lab: the benchmarks and experiments, `kvslim bench` and `kvslim experiment`), the
lab's files keep the package's sizes, neither tree nor benchmarks/ holds an import circle
(imports for type checkers included), and `import kvslim` stays light."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_architecture import MAX_FUNCTION_LINES, MAX_LINES, SRC, find_circle

ROOT = SRC.parents[1]
LAB = ROOT / "lab" / "kvslim_lab"
BENCHMARKS = ROOT / "benchmarks"
LLM_MODULES = 90          # kvslim modules `from kvslim import LLM` may load


def lab_files() -> list[Path]:
    return sorted(LAB.rglob("*.py"))


def imported(path: Path) -> set[str]:
    """Every absolute module name the file imports, anywhere in it (type checkers' too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def module_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules among `files` it imports (a name reaching into a module counts)."""
    graph = {}
    for name, path in files.items():
        deps = set()
        for module in imported(path):
            while module and module not in files:
                module = module.rpartition(".")[0]
            if module:
                deps.add(module)
        graph[name] = deps - {name}
    return graph


def lab_module(path: Path) -> str:
    rel = path.relative_to(LAB.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def test_kvslim_never_imports_the_lab():
    bad = [f"{p.relative_to(SRC)}: {m}" for p in sorted(SRC.rglob("*.py"))
           for m in imported(p) if m.split(".")[0] == "kvslim_lab"]
    assert not bad, bad


def test_no_circles_in_the_lab_or_benchmarks():
    lab = {lab_module(p): p for p in lab_files()}
    assert find_circle(module_graph(lab)) is None, find_circle(module_graph(lab))
    scripts = {p.stem: p for p in sorted(BENCHMARKS.glob("*.py"))}
    assert find_circle(module_graph(scripts)) is None, find_circle(module_graph(scripts))


def test_the_bench_folder_holds_the_bench_commands():
    """bench/ holds the `kvslim bench` subcommands and the pieces they are built from: every
    module in it is reached from the lab's cli/ through bench/'s own imports (a measurement
    only a study uses lives in that study's package under experiments/)."""
    bench = {lab_module(p): p for p in lab_files() if p.relative_to(LAB).parts[0] == "bench"}
    cli = [p for p in lab_files() if p.relative_to(LAB).parts[0] == "cli"]
    graph = module_graph(bench)
    reached = {m for p in cli for m in module_graph({**bench, "cli": p})["cli"]}
    todo = list(reached)
    while todo:
        for m in graph[todo.pop()] - reached:
            reached.add(m)
            todo.append(m)
    unused = sorted(set(bench) - reached - {"kvslim_lab.bench"})
    assert not unused, f"bench/ modules no `kvslim bench` command uses: {unused}"


@pytest.mark.parametrize("path", lab_files(), ids=lambda p: str(p.relative_to(LAB)))
def test_lab_files_fit(path):
    tree = ast.parse(path.read_text(), str(path))
    assert len(path.read_text().splitlines()) <= MAX_LINES
    long = [node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_importing_kvslim_is_light():
    """`import kvslim` needs no matplotlib and no lab; `from kvslim import LLM` loads at most
    LLM_MODULES of kvslim's modules (the engine's features load when an engine uses them)."""
    probe = ("import sys, json; import kvslim; plain = sorted(sys.modules); "
             "from kvslim import LLM; "
             "print(json.dumps([plain, sorted(m for m in sys.modules if m.split('.')[0] == "
             "'kvslim')]))")
    plain, loaded = json.loads(subprocess.run([sys.executable, "-c", probe], check=True,
                                              capture_output=True, text=True).stdout)
    assert not [m for m in plain if m.split(".")[0] in ("matplotlib", "kvslim_lab")]
    assert len(loaded) <= LLM_MODULES, (len(loaded), loaded)


def test_a_lab_command_without_the_lab_says_how_to_install_it(monkeypatch, capsys):
    from kvslim.cli import main
    monkeypatch.setattr(main, "entry_points", lambda group: [])
    assert main.main(["bench", "peers", "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "kvslim bench" in err and "pip install -e ./lab" in err


def test_a_broken_lab_costs_only_its_own_commands(monkeypatch, capsys):
    from types import SimpleNamespace

    from kvslim.cli import main
    broken = [SimpleNamespace(name="bench", value="kvslim_lab_missing.cli.bench_cmds")]
    monkeypatch.setattr(main, "entry_points", lambda group: broken)
    assert main.main(["memory", "--list"]) == 0
    assert main.main(["bench", "peers"]) == 2
    assert "pip install -e ./lab" in capsys.readouterr().err
