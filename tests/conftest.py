"""Shared fixtures: every backend the machine has, outputs poisoned, fresh random inputs; the default run's
subset and `--full`."""
import collections
import os

# Handlers fill outputs and scratch with NaN before computing: an unwritten element fails the tests.
os.environ.setdefault("JAXMLP_POISON_OUTPUTS", "1")
# The FP8 tests check the recipes' numerics at small shapes, where by default (when="faster") a call runs in
# bf16: they ask for FP8 at every shape, also in their subprocesses. test_fp8's policy tests set it back.
os.environ.setdefault("JAXMLP_FP8_WHEN", "always")

import jax

# Several CPU devices for the shard_map and expert-parallel tests (set before JAX starts its backends).
jax.config.update("jax_num_cpu_devices", 8)
# float32 products in XLA's own ops (jaxmlp.reference, the Flax models' dense layers) in full float32, as
# jaxmlp's handlers compute them: on a GPU XLA's default rounds them to TF32 (~5e-4 relative error), which
# the 1e-5 comparisons against float32 results would take for a defect. jaxmlp's own calls ignore this.
jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st

import numpy_reference as ref
from jaxmlp import _gemm_path, _library

# ---- The default run and --full ------------------------------------------------------------------------
# Plain `pytest` runs a representative subset, in a few minutes on a 2-CPU machine: every op, module,
# dtype, activation, recipe and error message at least once. `pytest --full` (CI) runs everything:
#  - tests marked `full` (the slowest end-to-end runs, and parameter cases that repeat what another case
#    covers), skipped otherwise with a reason that says so;
#  - every combination of a parameter matrix marked `matrix`, where the default run takes a subset in which
#    each parameter's every value appears at least once (`one_of_each`);
#  - hypothesis at each test's own max_examples, where the default run caps them at FAST_EXAMPLES.
# GPU tests (marker `gpu`) are left as they are: they run wherever a GPU is, with or without --full.
FAST_EXAMPLES = 8
FULL_ONLY = "not in the default subset: run with --full (pytest --full runs every test)"
settings.register_profile("full", settings.get_profile("default"))
settings.register_profile("fast", settings.get_profile("default"), max_examples=FAST_EXAMPLES)


def pytest_addoption(parser):
  parser.addoption("--full", action="store_true", default=False,
                   help="run every test: the whole parameter matrices, hypothesis at its full example counts, "
                        "the slow end-to-end runs (what CI runs); without it, a representative subset")


def pytest_configure(config):
  if not config.getoption("--hypothesis-profile", None):
    settings.load_profile("full" if config.getoption("--full") else "fast")


def pytest_report_header(config):
  if config.getoption("--full"):
    return "jaxmlp: --full: every test, every case, hypothesis at its full example counts"
  return "jaxmlp: the default subset (every feature, each parameter value once); pytest --full runs everything"


def one_of_each(items):
  """A subset of one test's parametrized items in which each parameter's every value appears at least once:
  greedily the item with the most values not yet seen (ties: the first collected)."""
  values = lambda item: {(k, repr(v)) for k, v in item.callspec.params.items()}
  unseen, chosen = set().union(*map(values, items)), []
  while unseen:
    best = max(items, key=lambda item: len(values(item) & unseen))
    chosen.append(best)
    unseen -= values(best)
  return chosen


def pytest_collection_modifyitems(config, items):
  if config.getoption("--full"):
    return
  skip = pytest.mark.skip(reason=FULL_ONLY)
  matrices = collections.defaultdict(list)
  for item in items:
    if item.get_closest_marker("gpu"):
      continue  # as they are: the GPU machines run them
    if item.get_closest_marker("full"):
      item.add_marker(skip)
    elif item.get_closest_marker("matrix") and hasattr(item, "callspec"):
      matrices[(item.path, item.originalname)].append(item)
  for group in matrices.values():
    kept = one_of_each(group)
    for item in group:
      if item not in kept:
        item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  """Without --full, a hypothesis test runs at most FAST_EXAMPLES examples, also where its @settings gives
  max_examples itself: for this item only (a GPU case keeps its count), through the attribute that @settings
  sets and hypothesis's own pytest plugin rewrites."""
  fn = getattr(item.obj, "__func__", item.obj)
  own = getattr(fn, "_hypothesis_internal_use_settings", None)
  if (item.config.getoption("--full") or item.get_closest_marker("gpu") or own is None
      or not getattr(fn, "is_hypothesis_test", False) or own.max_examples <= FAST_EXAMPLES):
    return (yield)
  fn._hypothesis_internal_use_settings = settings(own, max_examples=FAST_EXAMPLES)
  try:
    return (yield)
  finally:
    fn._hypothesis_internal_use_settings = own


def pytest_terminal_summary(terminalreporter):
  """The skipped tests counted by reason, so that a reader sees why at a glance."""
  reasons = collections.Counter()
  for report in terminalreporter.stats.get("skipped", []):
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reasons[reason.removeprefix("Skipped: ")] += 1
  if reasons:
    terminalreporter.section("skipped, by reason")
    for reason, n in reasons.most_common():
      terminalreporter.line(f"{n:5d}  {reason}")


TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}  # relative Frobenius error

# One group size for the fuzz tests, drawn from the whole int32 range as well as plausible ones: whatever
# group_sizes holds, no crash, results follow the clamping policy, and padding rows stay zero.
GROUP_SIZE = st.one_of(st.integers(-3, 40), st.sampled_from([-(2**31), -1, 2**31 - 1, 2**30]))


def gpus():
  """This process's GPUs; none where JAX has no GPU backend."""
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


def cuda_reason(path):
  """Why a CUDA backend cannot be tested here, or None."""
  if _library._cuda is None:
    return _library.CUDA_BUILD_ERROR
  if not _library.cuda_devices():
    return "no CUDA device"
  if path == "grouped" and not _library.cuda_status().get("grouped_available"):
    return "cuBLASLt grouped GEMM unavailable: " + _library.cuda_status().get("grouped_reason", "")
  if path in ("cutlass", "fused") and not _library.cuda_status().get("cutlass_available"):
    return "CUTLASS engine unavailable: " + _library.cuda_status().get("cutlass_reason", "")
  if path == "tiled" and not _library.cuda_status().get("tiled_available"):
    return "tiled kernel unavailable: " + _library.cuda_status().get("tiled_reason", "")
  return None


BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda-grouped", id="cuda-grouped", marks=pytest.mark.gpu),
    pytest.param("cuda-cutlass", id="cuda-cutlass", marks=pytest.mark.gpu),
    pytest.param("cuda-fused", id="cuda-fused", marks=pytest.mark.gpu),
    pytest.param("cuda-tiled", id="cuda-tiled", marks=pytest.mark.gpu),
    pytest.param("cuda-fallback", id="cuda-fallback", marks=pytest.mark.gpu),
]
# float32 always runs on the fallback (`_gemm_path.unservable`): a float32-only test takes these.
float32_backends = pytest.mark.parametrize(
    "backend", [p for p in BACKENDS if p.values[0] in ("cpu", "cuda-fallback")], indirect=True)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
  """Runs the test's jaxmlp calls on one platform (and, on CUDA, one GEMM path).

  On the grouped, cutlass, fused or tiled path, a test none of whose calls took that path fails: it would test the
  fallback (or, with no custom call, nothing) under another name. Float32-only tests take
  `float32_backends`; `skip_unless_served` skips single cases."""
  name = request.param
  if name == "cpu":
    with jax.default_device(jax.devices("cpu")[0]):
      yield name
    return
  path = name.split("-")[1]
  reason = cuda_reason(path)
  if reason:
    pytest.skip(reason)
  monkeypatch.setenv("JAXMLP_GEMM_PATH", path)
  taken = []
  choose = _gemm_path.cuda_path

  def recorded(*args, **kwargs):
    taken.append(choose(*args, **kwargs))
    return taken[-1]

  monkeypatch.setattr(_gemm_path, "cuda_path", recorded)
  with jax.default_device(_library.cuda_devices()[0]):
    yield name
  report = getattr(request.node, "call_report", None)
  if report is not None and report.passed:
    assert path == "fallback" or path in taken, f"no call took the {path} path (took {set(taken)})"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  """Keeps the test's own outcome on the item, for the backend fixture's teardown."""
  report = yield
  if report.when == "call":
    item.call_report = report
  return report


def skip_unless_served(backend, dtype, *row_lengths, empty=False):
  """Skips a case the forced grouped, cutlass, fused or tiled path does not run, which cpu and cuda-fallback do:
  float32 or unaligned rows (the fallback serves them), or an empty problem (no custom call at all)."""
  if backend not in ("cuda-grouped", "cuda-cutlass", "cuda-fused", "cuda-tiled"):
    return
  why_not = "an empty problem makes no custom call" if empty else _gemm_path.unservable(dtype, *row_lengths)
  if why_not:
    pytest.skip(f"{why_not} (see cuda-fallback)")


@pytest.fixture
def rng(request):
  # Fresh inputs per test and per run; the seed is printed on failure, and JAXMLP_TEST_SEED=<seed>
  # replays it.
  seed = int(os.environ.get("JAXMLP_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
  request.node.user_properties.append(("seed", seed))
  print(f"seed={seed}")
  return np.random.default_rng(seed)


def max_error(got, want):
  """Largest elementwise error relative to the largest reference element: a few wrong elements, which
  rel_error's Frobenius norm averages away, show here (tests allow twice the dtype's TOLERANCE)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  if not got.size:
    return 0.0
  return np.abs(got - want).max() / max(np.abs(want).max(), np.finfo(np.float64).tiny)


def check_close(got, want, tol, name=""):
  """Frobenius and largest elementwise error against the reference: within tol and 2 tol."""
  assert rel_error(got, want) < tol and max_error(got, want) < 2 * tol, name


def engine_launches() -> dict:
  """The CUTLASS engine's kernels enqueued so far, by name (jaxmlp._cuda.cutlass_launches: host code, which
  every first run of a call executes)."""
  return dict(_library._cuda.cutlass_launches())


def launched(since: dict) -> dict:
  """The engine's kernels enqueued since engine_launches() gave `since`."""
  return {k: v - since[k] for k, v in engine_launches().items()}


def check_padding_rows_zero(m, sizes, *row_outputs):
  """Rows past the clamped total of sizes: zero output and zero gradient."""
  total = ref.clamp_sizes(sizes, m)[-1]
  for a in row_outputs:
    assert not np.asarray(a[total:], np.float64).any()


def rel_error(got, want):
  """The Frobenius norm of the error relative to the reference's (an all-zero reference asks for zeros)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  assert np.isfinite(got).all(), "non-finite values (an unwritten, poisoned element?)"
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), np.finfo(np.float64).tiny)
