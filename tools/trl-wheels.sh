#!/usr/bin/env bash
# Download the wheels that tools/bench_vs_trl.py's TRL side needs beyond rlcore's runtime install (torch,
# transformers 5.17, accelerate through peft, pyarrow, huggingface-hub, pyyaml, jinja2 are there), for a machine
# without network. Run it where the package index is reachable:
#
#     tools/trl-wheels.sh DIR [PYTHON_VERSION]      # PYTHON_VERSION of the target machine, default this python's
#
# then on the target machine, either into the environment or into a folder of its own put on PYTHONPATH:
#
#     pip install --no-deps DIR/*.whl
#     pip install --no-deps --target /opt/trl-site DIR/*.whl && export PYTHONPATH=/opt/trl-site
#
# pandas and xxhash are compiled wheels (manylinux x86_64): they must match the target's Python version.
set -euo pipefail
dir=${1:?usage: tools/trl-wheels.sh DIR [PYTHON_VERSION]}
py=${2:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
# trl 1.16.0 -> datasets (-> multiprocess, xxhash, dill, pandas -> python-dateutil -> tzdata). accelerate: needed by
# trl too, already in rlcore's runtime install through peft; here in case the target lacks it.
wheels=(
  trl==1.16.0
  datasets==5.2.0
  multiprocess==0.70.19
  dill==0.4.1
  xxhash==4.1.0
  pandas==3.1.1
  python-dateutil==4.0.0
  tzdata==2026.6
  accelerate==1.15.0
)
python3 -m pip download --no-deps --only-binary=:all: --python-version "$py" \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir" "${wheels[@]}"
ls "$dir"
