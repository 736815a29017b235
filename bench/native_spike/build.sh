#!/bin/sh
# Direct build against the CPython headers (no setuptools).
set -e
cd "$(dirname "$0")"
PY=${PYTHON:-python}
INC=$($PY -c 'import sysconfig;print(sysconfig.get_paths()["include"])')
SUF=$($PY -c 'import sysconfig;print(sysconfig.get_config_var("EXT_SUFFIX"))')
gcc -O2 -fPIC -shared -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers \
    -I"$INC" kvcore.c -o "kvcore$SUF"
echo "built kvcore$SUF"
