"""The Triton kernel tests (test_quant_triton.py) in a fresh process of their own, where the Triton interpreter is
set up before anything else imports Triton (see conftest.py). On a GPU, scripts/gpu_check.sh runs that file with
QARL_TRITON_ALONE=1 as well."""

import os
import subprocess
import sys
from pathlib import Path


def test_triton_kernels_equal_the_references_under_the_interpreter():
    here = Path(__file__).parent
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "test_quant_triton.py")],
                         cwd=here.parent, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "QARL_TRITON_ALONE": "1"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout, out.stdout[-2000:]
