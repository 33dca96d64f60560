"""The real host, end to end: scripts/hosts/rapid_mlx/e2e.py serving the default checkpoint.

Runs only in the host's environment (scripts/hosts/rapid_mlx/env.sh; scripts/hosts/rapid_mlx/run.sh builds it
and runs this test there, .ci/hosts runs that on a schedule); every other environment skips it.
Extra arguments for the script, e.g. `--source /path/to/checkout`, come from $HOST_E2E_ARGS.
"""

from __future__ import annotations

import pytest

from scripts.hosts.common.pytest_run import host_installed, run_host_e2e

pytestmark = pytest.mark.skipif(
    not host_installed("rapid_mlx"),
    reason="rapid_mlx is not installed in this environment; scripts/hosts/rapid_mlx/run.sh builds its environment and runs this test there",
)


def test_rapid_mlx_answers_equal_compass_compat_generate():
    run_host_e2e("rapid_mlx")
