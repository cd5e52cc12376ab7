"""The package's layering, read from its source: the modules that define what the ops compute import no
module that implements them (nothing that loads the extensions or makes a custom call)."""
import ast
import pathlib
import sys

import jaxmlp

PACKAGE = pathlib.Path(jaxmlp.__file__).parent
DEFINITIONS = ("reference", "reference_moe", "plan", "activations", "_checks", "_groups", "fp8.recipe",
               "fp8.quantize", "fp8.tensorwise", "fp8.blockwise")
IMPLEMENTATIONS = {"_library", "_gemm_path", "mlp", "gemm", "dispatch", "fp8.mlp", "fp8.cuda", "backend"}


def imports(module: str) -> set[str]:
  """The jaxmlp modules `module` imports itself: relative imports, as the package writes them, and absolute
  ones (`import jaxmlp.x`, `from jaxmlp import x`, `from jaxmlp.x import y`)."""
  path = PACKAGE.joinpath(*module.split("."))
  path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
  package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
  names = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.level:
      base = package[:len(package) - node.level + 1]
      target = ".".join([*base, node.module] if node.module else base)
      names += [target] if node.module else []
      names += [f"{target}.{a.name}".lstrip(".") for a in node.names]
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jaxmlp":
      target = node.module.removeprefix("jaxmlp").lstrip(".")
      names += [target] + [f"{target}.{a.name}".lstrip(".") for a in node.names]
    elif isinstance(node, ast.Import):
      names += [a.name.removeprefix("jaxmlp.") for a in node.names if a.name.startswith("jaxmlp.")]
  return {n for n in names if n and (PACKAGE.joinpath(*n.split(".")).with_suffix(".py").exists()
                                     or PACKAGE.joinpath(*n.split(".")).is_dir())}


def reachable(module: str) -> set[str]:
  seen, todo = set(), [module]
  while todo:
    for m in imports(todo.pop()) - seen:
      seen.add(m)
      todo.append(m)
  return seen


def test_definitions_import_no_implementation():
  for module in DEFINITIONS:
    assert not reachable(module) & IMPLEMENTATIONS, (module, reachable(module) & IMPLEMENTATIONS)


def test_the_check_sees_imports(tmp_path, monkeypatch):
  """It finds what the implementations import (it would pass on a parser that finds nothing), absolute
  imports of jaxmlp's modules too."""
  assert {"_library", "reference", "fp8.mlp"} <= reachable("mlp")
  assert "fp8.cuda" in reachable("fp8.mlp") and "_groups" in reachable("reference")
  package = tmp_path / "jaxmlp"
  (package / "fp8").mkdir(parents=True)
  for name in ("_library.py", "mlp.py", "fp8/cuda.py", "fp8/__init__.py"):
    (package / name).write_text("")
  (package / "probe.py").write_text("import jaxmlp.mlp\nfrom jaxmlp import _library\nfrom jaxmlp.fp8 import cuda\n")
  monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
  assert imports("probe") == {"mlp", "_library", "fp8", "fp8.cuda"}


def test_the_extension_names_every_activation_and_code():
  """The handlers' codes come from the extension by name (ffi/codes.h): every activation jaxmlp defines, and
  every GEMM op and dtype the calls pass, has its member there."""
  from jaxmlp import _cpu, activations
  assert list(_cpu.Act.__members__) == list(activations.NAMES)
  assert set(_cpu.GemmOp.__members__) == {"nn", "nt", "tn", "tn_padded"}
  assert set(_cpu.DType.__members__) == {"float32", "bfloat16", "float16"}
