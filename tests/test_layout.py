"""The package's layering, read from its source: the modules that define what the ops compute import no
module that implements them (nothing that loads the extensions or makes a custom call)."""
import ast
import pathlib

import jaxmlp

PACKAGE = pathlib.Path(jaxmlp.__file__).parent
DEFINITIONS = ("reference", "reference_moe", "plan", "activations", "_checks", "_groups", "fp8.recipe",
               "fp8.quantize", "fp8.tensorwise", "fp8.blockwise")
IMPLEMENTATIONS = {"_library", "_gemm_path", "mlp", "gemm", "dispatch", "fp8.mlp", "fp8.cuda", "backend"}


def imports(module: str) -> set[str]:
  """The jaxmlp modules `module` imports itself (relative imports, as the package writes them)."""
  path = PACKAGE.joinpath(*module.split("."))
  path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
  package = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.level:
      base = package[:len(package) - node.level + 1]
      target = ".".join([*base, node.module] if node.module else base)
      names = [target] if node.module else []
      names += [f"{target}.{a.name}".lstrip(".") for a in node.names]
      found |= {n for n in names if PACKAGE.joinpath(*n.split(".")).with_suffix(".py").exists()
                or PACKAGE.joinpath(*n.split(".")).is_dir()}
  return found


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


def test_the_check_sees_imports():
  """It finds what the implementations import (it would pass on a parser that finds nothing)."""
  assert {"_library", "reference", "fp8.mlp"} <= reachable("mlp")
  assert "fp8.cuda" in reachable("fp8.mlp") and "_groups" in reachable("reference")


def test_the_extension_names_every_activation_and_code():
  """The handlers' codes come from the extension by name (ffi/codes.h): every activation jaxmlp defines, and
  every GEMM op and dtype the calls pass, has its member there."""
  from jaxmlp import _cpu, activations
  assert list(_cpu.Act.__members__) == list(activations.NAMES)
  assert set(_cpu.GemmOp.__members__) == {"nn", "nt", "tn", "tn_padded"}
  assert set(_cpu.DType.__members__) == {"float32", "bfloat16", "float16"}
