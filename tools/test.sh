#!/usr/bin/env bash
# Install megalite with its test extra, build the fused-kernel extension in place, run the suite
# (arguments go to pytest: -m "not slow" is the fast unit run) on two pytest-xdist workers: each module's tests
# on one worker, and the tests that must not overlap each other on one (tests/conftest.py's SERIAL). pip builds
# in an isolated environment that cannot see torch, so the extension is built in a second step, once torch is
# installed; that step runs setup.py directly, which needs setuptools in this environment (a Python 3.12+ venv
# has none).
# pytest's exit code 5 (no tests collected) is a failure: a suite that ran nothing proves nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]" setuptools || exit 1
python setup.py -q build_ext --inplace || exit 1
export OMP_NUM_THREADS=1
python -m pytest -q -n 2 --dist loadscope tests "$@"
code=$?
if [ "$code" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
fi
exit "$code"
