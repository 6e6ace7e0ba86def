# Sourced by the device scripts, run from the repository root: `pf_env DIR...` installs
# the wheels carried in DIR... (no index, no dependencies) into /tmp/site-pf, maps
# `pagefleet.server` onto server/ through a symlink tree (pagefleet is not installed on
# the device), and exports PYTHONPATH (not the repository root: operator/ would shadow
# the stdlib's `operator`).
pf_env() {
  local wheels=() d
  for d in "$@"; do wheels+=("$d"/*.whl); done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site-pf "${wheels[@]}" || return 1
  mkdir -p /tmp/pf/pagefleet && ln -sfn "$PWD/server" /tmp/pf/pagefleet/server
  export PYTHONPATH=/tmp/site-pf:/tmp/pf PYTHONUNBUFFERED=1
}
