"""Shared test configuration: `cuda` tests run only where CUDA exists; tests are deterministic.

The tests sit by level -- ``unit/`` (one function or module, no model), ``integration/`` (switches on live tiny
models, the lab's scenarios), ``distributed/`` (several processes on gloo), ``cuda/`` (a GPU's own checks; a
``cuda``-marked test may also sit beside its CPU twin) -- and share helpers from this folder
(``_offload_helpers.py``, ``_packed_helpers.py``, ``_plan_helpers.py``, ``_moe_helpers.py``, ``_source_helpers.py``),
importable from every level.
"""

import getpass
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # the helpers above, from every level

# One inductor cache per ATEN_CPU_CAPABILITY, set before torch compiles anything: torch 2.13's cache key leaves the
# capability out, and a CPU kernel cached under the machine's best kernels (avx512) and reused under
# ATEN_CPU_CAPABILITY=avx2 computed NaN in a compiled LoRA layer's training step (a fresh cache under avx2: exact).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY') or 'native'}"))

# Under a capability below avx512 (another CPU's kernels), oneDNN is capped to match: torch 2.13 on a CPU with AMX
# otherwise still takes oneDNN's AMX brgemm path for bf16 attention and stops there ("pack_vnni2 is only supported when
# avx512 is supported"), which no CPU without avx512 would do. Set before torch loads oneDNN (it reads it once).
if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("default", "avx2"):
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: longer CPU test")
    config.addinivalue_line("markers", "inductor: compiles C++ kernels with torch.compile on the CPU (skipped where "
                                       "torch's inductor has no vector ISA to build them for)")
    config.addinivalue_line("markers", "exclusive: measures the GPU's copy engines against a target: needs the GPU "
                                       "to itself (run apart from parallel test workers)")


def _inductor_cpu_unusable() -> str | None:
    """Why torch.compile cannot build CPU kernels here, or None. Under ``ATEN_CPU_CAPABILITY=default`` inductor
    finds no vector ISA, yet its reductions and its CPU flex attention still emit vectorized C++ that does not
    build (torch 2.13): a limit of torch on that setting, not of the code these tests check."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
    except ImportError:
        return None
    if not pick_vec_isa():
        return (f"torch's inductor finds no CPU vector ISA (ATEN_CPU_CAPABILITY="
                f"{os.environ.get('ATEN_CPU_CAPABILITY', 'unset')}): its CPU kernels do not build")
    return None


def pytest_collection_modifyitems(config, items):
    if any("inductor" in item.keywords for item in items) and not torch.cuda.is_available():
        why = _inductor_cpu_unusable()
        if why:
            for item in items:
                if "inductor" in item.keywords:
                    item.add_marker(pytest.mark.skip(reason=why))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Tiny models gain nothing from intra-op threads; on a shared 2-core CPU they oversubscribe it (~10x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def interpreted():
    """``interpreted(script, timeout)``: run a check script of Triton kernels on CPU tensors (it sets
    ``TRITON_INTERPRET=1`` before importing triton) in a fresh process, and require that it printed ``ok``. Skipped
    where triton is not installed (CI; ``make mutants`` installs it)."""
    pytest.importorskip("triton")

    def run(script: str, timeout: int = 300) -> None:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]

    return run
