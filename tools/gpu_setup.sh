# Sourced by tools/gpu_bench_round*.sh on the device machine: fla-core from the carried wheel, k3compile
# installed in place, results folder $R under $OUT.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=/tmp/site
if [ ! -f /tmp/site/.k3_installed ]; then  # once per machine: jobs started side by side share the install
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || { echo "wheels failed"; exit 1; }
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
  touch /tmp/site/.k3_installed
fi
R=${R:-$OUT/r}; mkdir -p "$R"
# run_gpu_tests SECONDS FILE::K_EXPR ...: GPU tests one file at a time, each under its own time limit (a slow file
# does not hide the others' results), appended to $OUT/logs/tests.log; the caller defines say().
run_gpu_tests() {
  local each=$1 spec; shift; mkdir -p $OUT/logs
  for spec in "$@"; do
    timeout $each python3 -m pytest -q -m gpu -p no:cacheprovider "${spec%%::*}" -k "${spec##*::}" >> $OUT/logs/tests.log 2>&1
    say "tests $spec: exit $?"; tail -1 $OUT/logs/tests.log
  done
}
