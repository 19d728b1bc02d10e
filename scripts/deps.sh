#!/usr/bin/env bash
# Installs the Debian 12 packages infersweep builds and tests with (idempotent; needs root).
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev nlohmann-json3-dev libcli11-dev libyaml-cpp-dev
  libgtest-dev libgmock-dev
  libsqlite3-dev sqlite3 libre2-dev libssl-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  prometheus-cpp-dev prometheus
  zlib1g-dev
  python3 python3-yaml curl openssl
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "# installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
