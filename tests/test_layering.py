"""The package's imports only go down (docs/architecture.md, "Layers"): read from the source with
`ast` — every `import MaxText...` wherever it stands (a function-level import counts, so none can
hide a cycle), plus the family plug-ins named in the family table (MaxText/models/families.py:
imported by name by the registry, their key declarations by the schema) — and refused when a
module imports a package of a higher layer, when packages or modules import each other in a
cycle, when a module takes another module's private (`_name`) names, or when a tool (TOOLS) reaches
the trainer's package `MaxText.train`, directly or through what it imports."""
import ast
import os
from collections import defaultdict

from conftest import ROOT

# bottom first; a module may import its own layer and the layers below it
LAYERS = [
    ("backend",),                             # the hot path's platform choice, library compat
    ("config",),                              # the one schema, loading, the CLI parser
    ("storage",),                             # paths local or on an object store (gs://, s3://)
    ("data", "metrics", "kernels"),
    ("checkpoint",),
    ("runtime",),                             # the process: exit codes, run dir, preemption, ...
    ("sharding",),
    ("layers",),
    ("models",),
    ("decoding", "losses", "resolve"),        # decoding API; losses/log-probs; the model a run uses
    ("methods",),                             # the training methods' objectives, keyed by name
    ("train",),                               # the trainer
    ("quantization",),                        # weight quantization (RTN, GPTQ, calibration)
    ("checkpoint_conversion", "launch", "logit_check", "inference", "decode", "evaluate",
     "refit", "inspect", "quantize", "lmeval", "serve"),                                 # entry
    ("rl", "repair", "dpo", "distill"),       # GRPO; LoRA repair; DPO; distillation: drive the trainer
]
LAYER_OF = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}
# the tools: none of them imports the trainer's package, not even through another module
TOOLS = ("checkpoint_conversion", "decode", "inference", "inspect", "launch", "lmeval",
         "logit_check", "quantization", "quantize", "refit", "serve")


def is_schema_part(module: str) -> bool:
  """The family table and each family's key declarations (`MaxText/models/<family>/keys.py`) live
  in the models folder but are parts of the one schema: the config package imports them (by the
  table's names) to compose `Config`, so they sit in its layer and may import only it."""
  parts = module.split(".")
  return module == "MaxText.models.families" or (
      len(parts) == 4 and parts[1] == "models" and parts[3] == "keys")


def package(module: str) -> str:
  if is_schema_part(module):
    return "config"
  return module.split(".")[1] if module.count(".") else module


def modules() -> dict[str, str]:
  """MaxText module name → file."""
  out = {}
  for dirpath, _, files in os.walk(os.path.join(ROOT, "MaxText")):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        out[name.removesuffix(".__init__")] = path
  return out


def imports(mods: dict[str, str]) -> list[tuple[str, str, list[str]]]:
  """(importer, imported module, names taken from it) for every MaxText import in every module."""
  edges = []
  for name, path in mods.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        edges += [(name, a.name, []) for a in node.names if a.name.startswith("MaxText.")]
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("MaxText"):
        for a in node.names:   # `from MaxText.layers import stack` imports the module .stack
          sub = f"{node.module}.{a.name}"
          edges.append((name, sub, []) if sub in mods else (name, node.module, [a.name]))
      elif (isinstance(node, ast.AnnAssign) and name == "MaxText.models.families"
            and getattr(node.target, "id", None) == "FAMILY_MODULES"):
        for v in node.value.values:   # plug-ins, imported by name: the registry their family, the
          edges.append(("MaxText.models.registry", v.value, []))   # schema their keys (if any)
          keys = v.value.rsplit(".", 1)[0] + ".keys"
          if keys in mods:
            edges.append(("MaxText.config.schema", keys, []))
  return edges


def problems(edges: list[tuple[str, str, list[str]]]) -> list[str]:
  out = []
  graph, packages = defaultdict(set), defaultdict(set)
  for src, dst, names in edges:
    graph[src].add(dst)
    ps, pd = package(src), package(dst)
    if ps != pd:
      packages[ps].add(pd)
      if LAYER_OF[ps] < LAYER_OF[pd]:
        out.append(f"upward import: {src} -> {dst} ({ps} is below {pd})")
    private = [n for n in names if n.startswith("_")]
    if private:
      out.append(f"{src} takes private names of {dst}: {private}")
  for what, g in (("package", packages), ("module", graph)):
    cycle = find_cycle(g)
    if cycle:
      out.append(f"{what} import cycle: {' -> '.join(cycle)}")
  return out


def tools_reaching_train(edges: list[tuple[str, str, list[str]]]) -> list[str]:
  """"tool module -> ... -> MaxText.train.x" for each module of TOOLS that imports the trainer's
  package, directly or through the modules it imports."""
  graph = defaultdict(set)
  for src, dst, _ in edges:
    graph[src].add(dst)
  out = []
  for start in sorted(m for m in graph if package(m) in TOOLS):
    paths, seen = [[start]], {start}
    while paths:                                   # breadth first: the shortest chain
      path = paths.pop(0)
      if package(path[-1]) == "train":
        out.append(" -> ".join(path))
        break
      for nxt in sorted(graph.get(path[-1], ())):
        if nxt not in seen:
          seen.add(nxt)
          paths.append(path + [nxt])
  return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}   # 1 on the current path, 2 done

  def visit(node, path):
    state[node] = 1
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [node, nxt] if nxt in path else path + [node, nxt]
      if nxt not in state:
        found = visit(nxt, path + [node])
        if found:
          return found
    state[node] = 2
    return None

  for start in sorted(graph):
    if start not in state:
      found = visit(start, [])
      if found:
        return found
  return None


def test_every_package_has_a_layer():
  assert {package(m) for m in modules() if m != "MaxText"} == set(LAYER_OF)


def test_imports_only_go_down_and_have_no_cycle():
  edges = imports(modules())
  assert len(edges) > 100 and any(dst.startswith("MaxText.models.llama") for _, dst, _ in edges)
  assert problems(edges) == []


def test_the_tools_import_nothing_from_the_trainer():
  edges = imports(modules())
  assert {package(src) for src, _, _ in edges} >= set(TOOLS)   # every tool is looked at
  assert tools_reaching_train(edges) == []


def test_the_tool_check_catches_a_tool_reaching_the_trainer():
  edges = [("MaxText.decode", "MaxText.inference", []),
           ("MaxText.inference", "MaxText.resolve.lora_base", []),
           ("MaxText.resolve.lora_base", "MaxText.train.state", []),          # through resolve
           ("MaxText.launch.xpk", "MaxText.train.step", []),                 # directly
           ("MaxText.evaluate", "MaxText.train.evaluation", [])]             # not a tool here
  assert tools_reaching_train(edges) == [
      "MaxText.decode -> MaxText.inference -> MaxText.resolve.lora_base -> MaxText.train.state",
      "MaxText.inference -> MaxText.resolve.lora_base -> MaxText.train.state",
      "MaxText.launch.xpk -> MaxText.train.step"]
  assert tools_reaching_train(edges[:2]) == []


def test_the_checker_catches_what_it_refuses():
  bad = [("MaxText.checkpoint.manifest", "MaxText.runtime.faults", []),             # upward
         ("MaxText.kernels.a", "MaxText.kernels.b", ["_Cfg"]),                     # private name
         ("MaxText.kernels.b", "MaxText.kernels.a", []),                           # module cycle
         ("MaxText.data.x", "MaxText.metrics.y", []), ("MaxText.metrics.y", "MaxText.data.z", [])]
  found = problems(bad)
  assert any(p.startswith("upward import: MaxText.checkpoint.manifest") for p in found)
  assert any("private names" in p and "_Cfg" in p for p in found)
  assert any(p.startswith("package import cycle") and "data" in p for p in found)
  assert any(p.startswith("module import cycle") and "kernels.a" in p for p in found)
  assert problems(bad[3:4]) == []                                           # one edge down: fine


# The one rule between family folders (docs/architecture.md, "Layers"): a family may build on
# another family's model and Hugging Face maps — only on those listed here, which the docs name —
# and never in a loop. Qwen3-Next's decoder is the llama lineage's with its own mixers and MoE;
# its map reads llama's and Qwen3-MoE's rows.
BUILDS_ON = {"qwen3_next": {"llama"}}


def family_folders() -> list[str]:
  models = os.path.join(ROOT, "MaxText", "models")
  return sorted(d for d in os.listdir(models) if os.path.isfile(os.path.join(models, d,
                                                                             "__init__.py")))


def family_import_problems(edges: list[tuple[str, str, list[str]]], folders: list[str],
                           builds_on: dict[str, set[str]]) -> list[str]:
  """Each import from one family folder into another that `builds_on` does not allow, and a loop
  between family folders (the whole folder: `from MaxText.models import llama` counts)."""
  def family(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "models" and parts[2] in folders else None
  out, graph = [], defaultdict(set)
  for src, dst, _ in edges:
    a, b = family(src), family(dst)
    if a and b and a != b:
      graph[a].add(b)
      if b not in builds_on.get(a, set()):
        out.append(f"family folder {a} imports family {b} ({src} -> {dst}), which it is not "
                   f"declared to build on (BUILDS_ON, docs/architecture.md)")
  cycle = find_cycle(graph)
  if cycle:
    out.append(f"family import cycle: {' -> '.join(cycle)}")
  return out


def test_a_family_folder_holds_all_it_owns_and_builds_only_on_the_families_the_docs_name():
  """A folder of MaxText/models/ is one family (its family.py listed in the registry) and holds
  every Hugging Face map its FAMILY lists; a family folder imports another only where BUILDS_ON
  (and docs/architecture.md, in the same words) says it builds on it, never in a loop."""
  from MaxText.models import registry
  folders = family_folders()
  assert {f"MaxText.models.{d}.family" for d in folders} == set(registry.FAMILY_MODULES.values())
  for name in registry.FAMILY_MODULES:
    for model_type, hf_map in registry.get_family(name).hf_maps.items():
      assert hf_map.__name__.startswith(f"MaxText.models.{name}."), (name, model_type, hf_map)
  edges = imports(modules())
  assert family_import_problems(edges, folders, BUILDS_ON) == []
  # each allowance is used (else it goes) and stated in the docs
  used = {(s.split(".")[2], d.split(".")[2]) for s, d, _ in edges
          if s.startswith("MaxText.models.") and d.startswith("MaxText.models.")
          and len(s.split(".")) > 2 and len(d.split(".")) > 2}
  with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
    docs = " ".join(f.read().split())
  for family, bases in BUILDS_ON.items():
    for base in bases:
      assert (family, base) in used, (family, base)
      assert f"`{family}` builds on `{base}`" in docs, (family, base)


def test_the_family_check_catches_an_undeclared_import_and_a_loop():
  folders = ["gemma4", "llama", "qwen3_next"]
  ok = [("MaxText.models.qwen3_next.model", "MaxText.models.llama.model", []),
        ("MaxText.models.qwen3_next.hf_map", "MaxText.models.llama.qwen3_moe_hf_map", [])]
  assert family_import_problems(ok, folders, BUILDS_ON) == []
  back = [("MaxText.models.llama.model", "MaxText.models.qwen3_next", [])]   # the folder itself
  found = family_import_problems(ok + back, folders, BUILDS_ON)
  assert any("family folder llama imports family qwen3_next" in p for p in found), found
  assert any(p.startswith("family import cycle") for p in found), found
  other = [("MaxText.models.gemma4.model", "MaxText.models.llama.model", [])]
  assert family_import_problems(other, folders, BUILDS_ON) == [
      "family folder gemma4 imports family llama (MaxText.models.gemma4.model -> "
      "MaxText.models.llama.model), which it is not declared to build on (BUILDS_ON, "
      "docs/architecture.md)"]
