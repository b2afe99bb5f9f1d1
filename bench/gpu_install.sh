# Sourced by the bench/run_*.sh scripts on the GPU machine: installs our package (the working
# tree, or TR_SRC: e.g. a wheel that pins a build) plus lark, which the GPU image lacks (carried
# as a wheel in .whl/), into /tmp/trsite, next to SGLang's /tmp/site (../shared/gpu/).
# SKIP_INSTALL=1: already installed by an earlier command on this machine (or a parallel one).
if [ -n "${SKIP_INSTALL:-}" ]; then
  export PYTHONPATH=/tmp/site:/tmp/trsite PYTHONUNBUFFERED=1
  return 0
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/trsite .whl/lark-*.whl || return 1
python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/trsite \
  "${TR_SRC:-.}" || return 1
export PYTHONPATH=/tmp/site:/tmp/trsite PYTHONUNBUFFERED=1
