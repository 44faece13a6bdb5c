"""The shape of the source tree (docs/architecture.md): which folder may import which, file and
function sizes, the KV-cache formula written once, and each engine option declared once.

Every `import` counts, including the lazy ones inside functions: a lazy import hides a dependency
from the top of the file, it does not remove it."""
import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvslim"
MAX_LINES = 400
MAX_FUNCTION_LINES = 60

# Folder (or top-level module) -> the folders and modules it may import. Lower layers first:
# base (errors, paths, device, dtypes) <- tokenizer, layers, attention <- quantization (beside layers:
# it builds on them) <- models <- formats <- parallel <- engine <- server; the KV-cache plan
# (kv_cache: groups, block arithmetic, KVCachePlan) sits on models, below the engine, the
# planner and parallel; surgery/train/eval use models/formats/tokenizer (and train's corpus
# streams); plan uses models; cli, demo and the package's __init__ (the public
# `from kvslim import LLM, SamplingParams`) use anything. The benchmarks and experiments are the
# lab's (lab/kvslim_lab, tests/test_lab_boundary.py), which kvslim never imports.
BASE = {"errors", "paths", "device", "dtypes"}
KERNELS = BASE | {"tokenizer", "layers", "attention", "kernels"}
ALLOWED = {
    "errors": set(),
    "paths": {"errors"},
    "device": {"errors"},
    "dtypes": {"errors"},          # every dtype name, alias, width and torch dtype
    "tokenizer": BASE,
    # kvslim's own C++ kernels (built on first use) and their packing, below every layer.
    "kernels": BASE,
    "layers": BASE | {"kernels"},
    "attention": BASE | {"kernels"},
    # Each quantization method's config parser, layer class and kernels; the layers build a
    # method's linears through the `LinearQuantization` interface they declare, so they do not
    # import it.
    "quantization": BASE | {"layers", "kernels"},
    "models": KERNELS | {"quantization"},
    "formats": KERNELS | {"quantization", "models"},
    # The engine allocates, the CLI checks, the planner prices one KVCachePlan.
    "kv_cache": BASE | {"attention", "models"},
    # Structured outputs: grammars over the tokenizer, masks for the sampler; tools: their
    # rendering, parsing and forcing grammar, for the server and LLM.chat.
    "structured": BASE | {"tokenizer", "reasoning"},
    # Reasoning (<think>...</think>) apart from the answer, for the server and LLM.chat; the
    # tools' registry names its conventions beside the tool-call formats.
    "reasoning": BASE,
    "tools": BASE | {"tokenizer", "structured", "reasoning"},
    # LoRA adapters: peft files read into slots beside the model's linears.
    "lora": BASE | {"kernels", "layers"},
    "engine": KERNELS | {"models", "formats", "parallel", "kv_cache", "structured", "tools",
                         "reasoning", "drafters", "lora"},
    # Tensor parallelism shards models (and prices a rank's share with the planner's formulas);
    # the engine runs its workers.
    "parallel": KERNELS | {"quantization", "models", "formats", "plan", "kv_cache"},
    "server": KERNELS | {"models", "formats", "engine", "structured", "tools", "reasoning",
                         "lora"},
    # Engine replicas on Ray behind one API server: each replica runs the server's engine loop,
    # the API server is the server's app over them, a replica's tensor-parallel ranks are the
    # engine's (only their launch is Ray's).
    "scaleout": KERNELS | {"models", "formats", "engine", "server", "lora"},
    # Corpus streams (tokenized windows) live in train/: calibration and perplexity read them.
    "surgery": KERNELS | {"quantization", "models", "formats", "train"},
    # Learned drafters (Medusa heads): modules and their files, on the model's hidden states.
    "drafters": KERNELS | {"models"},
    # Training a drafter distills the engine's own answers.
    "train": KERNELS | {"models", "formats", "drafters", "engine"},
    # Perplexity, and each layer's sensitivity to its KV setting (the KV budget compiler's).
    "eval": KERNELS | {"models", "formats", "train", "kv_cache"},
    "plan": BASE | {"models", "kv_cache"},
}
ANYTHING = {"cli", "demo", "__init__"}

def source_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def role(path: Path) -> str:
    """The folder a file belongs to, or the module's name for a file at the package's top."""
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def kvslim_imports(path: Path, runtime_only: bool = False) -> set[str]:
    """Every kvslim module the file imports, at the top or inside a function (runtime_only:
    leaving out the imports under `if TYPE_CHECKING:`, which name types and never run)."""
    rel = path.relative_to(SRC)
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test).endswith("TYPE_CHECKING")
                   for child in node.body for n in ast.walk(child)} if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:                              # relative: resolve against the package
                package = ["kvslim", *rel.parts[:-1]][:len(rel.parts) - node.level + 1]
                module = ".".join(package + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "kvslim":                      # from kvslim import errors
                found.update(f"kvslim.{alias.name}" for alias in node.names)
            else:
                found.add(module)
    return {m for m in found if m.startswith("kvslim.")}


def import_edges() -> list[tuple[str, str, str, str]]:
    """(file, imported module, importer's role, imported role) across roles."""
    edges = []
    for path in source_files():
        src = role(path)
        for module in kvslim_imports(path):
            dst = module.split(".")[1]
            if dst != src:
                edges.append((str(path.relative_to(SRC)), module, src, dst))
    return edges


def test_every_role_is_in_the_table():
    roles = {role(p) for p in source_files()}
    assert roles <= set(ALLOWED) | ANYTHING, sorted(roles - set(ALLOWED) - ANYTHING)


def module_name(path: Path) -> str:
    parts = ["kvslim", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph (a list of nodes, the first repeated at its end), or None."""
    state: dict[str, int] = {}                    # 1: on the current path, 2: done
    for root in sorted(graph):
        path, stack = [], [(root, iter(sorted(graph[root])))] if root not in state else []
        if stack:
            state[root] = 1
            path.append(root)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                path.pop()
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_the_table_has_no_circles():
    assert find_circle({src: set(dsts) for src, dsts in ALLOWED.items()}) is None


def test_no_module_imports_itself_through_others():
    """No circle of modules, lazy imports and those for type checkers (`if TYPE_CHECKING:`)
    included: two files that import each other are one role cut in the wrong place (an import
    names the deepest kvslim module it reaches)."""
    modules = {module_name(p): p for p in source_files()}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for module in kvslim_imports(path):
            while module not in modules:
                module = module.rpartition(".")[0]
            deps.add(module)
        graph[name] = deps - {name}
    assert find_circle(graph) is None, " -> ".join(find_circle(graph))


def test_imports_follow_the_layering():
    bad = [f"{file}: {src} -> {dst} ({module})" for file, module, src, dst in import_edges()
           if src not in ANYTHING and dst not in ALLOWED[src]]
    assert not bad, "imports against the table in tests/test_architecture.py:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(SRC)))
def test_file_length(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(SRC)}: {lines} lines (at most {MAX_LINES})"


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(("kvslim", *parts))


def test_nothing_imports_benchmarks():
    """benchmarks/ at the repository root holds scripts run by hand (docs/architecture.md): the
    package and its tests never import them."""
    tests = Path(__file__).resolve().parent
    bad = []
    for path in [*source_files(), *sorted(tests.rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path}: {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not bad, bad


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(SRC)))
def test_functions_fit_a_screen(path):
    assert not long_functions(path), f"{path.relative_to(SRC)}: {long_functions(path)}"


def kv_formula_sites() -> list[str]:
    """Products (in code, not prose) that multiply a layer count by a head_dim: the per-token
    K/V formula. MLA's latent layout (kv_lora_rank + qk_rope_head_dim) does not match."""
    sites = []
    for path in source_files():
        tree = ast.parse(path.read_text(), str(path))
        inner = {id(child) for node in ast.walk(tree) if isinstance(node, ast.BinOp)
                 for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and id(node) not in inner:
                names = {n.attr if isinstance(n, ast.Attribute) else n.id
                         for n in ast.walk(node) if isinstance(n, (ast.Attribute, ast.Name))}
                has_mult = any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)
                               for n in ast.walk(node))
                if has_mult and "head_dim" in names and any("layers" in n for n in names):
                    sites.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    return sites


def test_kv_formula_is_written_once():
    sites = kv_formula_sites()
    assert len(sites) == 1 and sites[0].startswith("models/config.py:"), sites


# Other commands that name one of their own settings like an engine option (training's dtype
# and device, a GGUF export's tensor type, `kvslim info`'s and the planner's dtype vocabularies,
# the conversion's tensor-parallel warning): not a second declaration of the engine's option.
OTHER_MEANINGS = {("cli/train_cmds.py", "--device"), ("cli/surgery_cmds.py", "--device"),
                  ("cli/surgery_cmds.py", "--tensor-parallel-size")}


def hand_written_flags(flags: set[str]) -> list[str]:
    """`add_argument("--flag", ...)` literals for any of `flags`."""
    found = []
    for path in source_files():
        rel = str(path.relative_to(SRC))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"):
                found += [f"{rel}:{node.lineno}: {arg.value}" for arg in node.args
                          if isinstance(arg, ast.Constant) and arg.value in flags
                          and (rel, arg.value) not in OTHER_MEANINGS]
    return found


def test_each_engine_option_is_declared_once():
    """An engine option is one field of EngineConfig (engine/config.py): its flag is generated
    from the field (cli/engine_args.py), never written by hand, and LLM passes its keywords on
    instead of listing the options again."""
    from kvslim.cli.engine_args import flag_fields, flag_of
    hand = hand_written_flags({flag_of(f) for f in flag_fields()})
    assert not hand, "engine flags written by hand:\n" + "\n".join(hand)
    llm = next(node for node in ast.walk(ast.parse((SRC / "engine" / "llm.py").read_text()))
               if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    assert [a.arg for a in llm.args.args] == ["self", "model"] and llm.args.kwarg is not None
    assert not llm.args.kwonlyargs


def test_the_dtype_names_are_written_once():
    """Every dtype spelling (float and KV-cache names, their aliases, the planner's short names)
    is one table, dtypes.py: no other file of the package spells an fp8 dtype, and every
    command's --dtype is the engine option's flag (with the command's own default, choices or
    help), not a flag of its own."""
    sites = [f"{path.relative_to(SRC)}:{node.lineno}" for path in source_files()
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and re.search(r"\bfp8|float8", node.value) and not is_docstring(path, node)]
    assert {s.split(":")[0] for s in sites} == {"dtypes.py"}, sites
    assert not hand_written_flags({"--dtype"})


def is_docstring(path: Path, node: ast.Constant) -> bool:
    """Whether `node` is a module's, class's or function's docstring (prose, not a spelling)."""
    tree = _trees.setdefault(path, ast.parse(path.read_text(), str(path)))
    return any(isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
               and n.body and isinstance(n.body[0], ast.Expr)
               and n.body[0].value.lineno == node.lineno
               and n.body[0].value.col_offset == node.col_offset for n in ast.walk(tree))


_trees: dict[Path, ast.Module] = {}


# Where a model family may be named: models/ (the families themselves), the GGUF format's
# tables (formats/gguf/) and the published configs the planner knows by name.
FAMILY_PLACES = ("models/", "formats/gguf/", "plan/published.py")


def test_code_outside_models_names_no_family():
    """Code outside models/ asks a family's attributes (`family_of(config)`, the roles in
    models/families.py) instead of naming an architecture or importing a family's file."""
    families = {p.stem for p in (SRC / "models").glob("*.py")} - {
        "__init__", "base", "config", "families", "causal_lm", "hf_fields", "shape_only"}
    bad = []
    for path in source_files():
        rel = str(path.relative_to(SRC))
        if rel.startswith(FAMILY_PLACES):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"\w+ForCausalLM", node.value):
                bad.append(f"{rel}:{node.lineno}: {node.value}")
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
                bad += [f"{rel}:{node.lineno}: imports {n}" for n in names
                        if n.startswith("kvslim.models.") and n.split(".")[2] in families]
    assert not bad, bad


def test_the_engine_sets_no_attribute_of_its_collaborators():
    """Features plug into the runner, sampler and speculative decoder when they are built
    (engine/model_runner.py's RunnerFeatures), never by setting their attributes afterwards."""
    tree = ast.parse((SRC / "engine" / "llm_engine.py").read_text())
    sets = [f"{node.lineno}: {ast.unparse(target)}" for node in ast.walk(tree)
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute)]
    assert not sets, sets


FAMILY_WORD = re.compile(r"(?i)(?<![\w.])(llama(?![.\-_ ]?cpp|-server|-bench|-quantize|"
                         r"-perplexity|-batched|_cpp)|mistral|qwen\d?|gemma\d?|phi-?3|mixtral|"
                         r"deepseek)")


def test_family_words_stay_in_few_files():
    """A family's name in code (identifiers and strings, not docstrings) outside models/ and
    the GGUF format's tables: at most 10 files (today: help texts naming real models, the
    embedded models' names, HF's "llama3" RoPE type, Gemma's norm layer, the planner's
    published configs)."""
    files = set()
    for path in source_files():
        rel = str(path.relative_to(SRC))
        if rel.startswith(("models/", "formats/gguf/")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            text = (node.value if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and not is_docstring(path, node) else
                    node.id if isinstance(node, ast.Name) else
                    node.attr if isinstance(node, ast.Attribute) else
                    node.name if isinstance(node, ast.alias) else None)
            if text and FAMILY_WORD.search(text):
                files.add(rel)
    assert len(files) <= 10, sorted(files)
