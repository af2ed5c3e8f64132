#!/usr/bin/env bash
# One torch x Lightning combination, as CI's compatibility stage runs it (.ci/run: the oldest and the
# newest supported): lightning-zero with its `test` extra installed into a venv of its own next to
# exactly these two releases, then the GPT example on its default corpus (configs/zero3.yaml, 30 steps,
# 2 CPU processes) and the suite's smoke subset (`pytest -m smoke`: Trainer at stages 1-3 against DDP,
# Fabric, a checkpoint round trip with a reshard, gradient views, offload).
#
#   scripts/compat_matrix.sh 2.6.0 2.5.0             # install, then run
#   scripts/compat_matrix.sh --install 2.6.0 2.5.0   # install only (CI starts it while the main suite runs)
#   scripts/compat_matrix.sh --run 2.6.0 2.5.0       # run only, in the venv --install made
#
# The venv is .venv-compat/torch-TORCH_lightning-LIGHTNING (reused if it holds these releases). torch
# comes from this machine's disk where the release lies there (2.13.0 CPU, 2.14.1) and from PyPI
# otherwise: on Linux x86_64 a CUDA build (~2.6 GB for 2.6.0), which runs on the CPU. The last line
# printed is the matrix row: torch, Lightning, what ran, and the result.
#
# The packages install with uv (bootstrapped with pip into .venv-compat/uv/, given pip's own settings:
# `pip config list`'s indexes, find-links and constraints), or with pip where uv cannot be had. pip
# unpacks torch 2.6.0's CUDA wheels on one core: 207 s and 172 CPU-seconds, against uv's 26 s and 40
# (2026-12-06, 2-core VM), and CI's stage is CPU-bound. uv's cache (.venv-compat/uv-cache, shared by
# the venvs, hard-linked into them) lets a second install of the same releases skip the unpacking.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=all
case "${1:-}" in
  --install) mode=install; shift ;;
  --run) mode=run; shift ;;
esac
if [[ $# -ne 2 ]]; then
  echo "usage: scripts/compat_matrix.sh [--install|--run] TORCH_VERSION LIGHTNING_VERSION (e.g. 2.6.0 2.5.0)" >&2
  exit 2
fi
torch_version=$1
lightning_version=$2
venv=.venv-compat/torch-${torch_version}_lightning-${lightning_version}
python=$venv/bin/python
log=$venv.log

installed() {  # whether the venv holds exactly the asked releases
  [[ -x $python ]] && "$python" - "$torch_version" "$lightning_version" <<'EOF' 2>/dev/null
import importlib.metadata as m, sys
ok = m.version("torch").split("+")[0] == sys.argv[1] and m.version("lightning") == sys.argv[2]
sys.exit(0 if ok else 1)
EOF
}

uv=.venv-compat/uv/bin/uv

bootstrap_uv() {  # uv in a venv of its own; the two ends of CI install at once, so one makes it, under a lock
  mkdir -p .venv-compat
  (
    if command -v flock >/dev/null; then flock 9; fi
    [[ -x $uv ]] || { rm -rf .venv-compat/uv && python3 -m venv .venv-compat/uv && .venv-compat/uv/bin/pip install -q uv; }
  ) 9>.venv-compat/uv.lock
}

uv_settings() {  # pip's settings on this machine, one uv option per line (uv reads no pip.conf)
  python3 -m pip config list 2>/dev/null | python3 scripts/uv_options_from_pip.py
}

install_packages() {  # into $venv: torch and Lightning pinned in the same command as the extra, so a
  # dependency that wanted other releases would make the install fail here, never upgrade them
  local packages=("torch==$torch_version" "lightning==$lightning_version" -e ".[test]")
  python3 -m venv "$venv" || return
  if bootstrap_uv; then
    local settings=()
    mapfile -t settings < <(uv_settings)
    # unsafe-best-match: every index is looked at for every package, as pip does
    UV_CACHE_DIR=.venv-compat/uv-cache "$uv" pip install -q --python "$python" --index-strategy unsafe-best-match \
      ${settings[@]+"${settings[@]}"} "${packages[@]}"
  else
    echo "compat: uv could not be installed; pip installs instead"
    "$python" -m pip install -q --no-compile "${packages[@]}"
  fi
}

if [[ $mode != run ]]; then
  mkdir -p .venv-compat
  if ! installed; then
    start=$SECONDS
    rm -rf "$venv"
    install_packages >"$log" 2>&1 \
      || { tail -20 "$log" >&2; echo "compat: installing torch $torch_version + lightning $lightning_version failed (log: $log)" >&2; exit 1; }
    echo "compat: installed torch $torch_version + lightning $lightning_version in $((SECONDS - start)) s ($venv)"
  fi
fi
[[ $mode == install ]] && exit 0

if ! installed; then
  echo "compat: $venv does not hold torch $torch_version + lightning $lightning_version: run with --install first" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

start=$SECONDS
if ! (cd "$work" && "$OLDPWD/$python" "$OLDPWD/examples/train_gpt.py" fit --config "$OLDPWD/configs/zero3.yaml" \
      --trainer.max_steps=30 --trainer.enable_progress_bar=false >"$work/example.log" 2>&1); then
  tail -30 "$work/example.log" >&2
  echo "compat: torch $torch_version + lightning $lightning_version: the example failed" >&2
  exit 1
fi
grep -q '`Trainer.fit` stopped: `max_steps=30` reached' "$work/example.log" \
  || { tail -30 "$work/example.log" >&2; echo "compat: the example did not reach 30 steps" >&2; exit 1; }
example_s=$((SECONDS - start))

start=$SECONDS
status=passed
# one process (-n 0): CI runs both ends at once, which keeps both cores busy; two xdist workers per end
# would import torch and Lightning twice more (254 -> 196 CPU-seconds for the stage, 2026-12-06)
"$python" -m pytest -q -m smoke -n 0 -p no:cacheprovider || status=FAILED
smoke_s=$((SECONDS - start))

versions=$("$python" -c 'import torch, lightning; print(f"torch {torch.__version__} + lightning {lightning.__version__}")')
echo "compat: $versions: example (zero3, 30 steps) ${example_s} s; smoke subset ${smoke_s} s: $status"
[[ $status == passed ]]
