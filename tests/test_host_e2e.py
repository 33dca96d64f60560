"""The real hosts, end to end: scripts/hosts/<host>/e2e.py serving the default checkpoint.

Each host's case runs only in that host's environment (scripts/hosts/<host>/env.sh;
scripts/hosts/<host>/run.sh builds it and runs the case there: oMLX in .ci/run, the others in
.ci/hosts on a schedule); every other environment skips it. Extra arguments for the script, e.g.
`--source /path/to/checkout` or `--git-rev HEAD`, come from $HOST_E2E_ARGS.
"""

from __future__ import annotations

import pytest

from scripts.hosts.common.pytest_run import HOST_MODULES, host_installed, run_host_e2e


@pytest.mark.parametrize("host", sorted(HOST_MODULES))
def test_host_answers_equal_compass_compat_generate(host):
    if not host_installed(host):
        pytest.skip(
            f"{host} is not installed in this environment; scripts/hosts/{host}/run.sh builds its environment and runs this test there"
        )
    run_host_e2e(host)
