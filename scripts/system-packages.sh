#!/usr/bin/env bash
# The Debian packages the test suite and `make serve` need, installed when missing.
# One list, used by `make test`, `make serve` and `.ci/run`, so the three cannot drift.
# As root it runs apt-get; otherwise it names the packages and the command, and fails.
set -euo pipefail

# package:command-it-provides
PACKAGES=(
  "make:make"
  "redis-server:redis-server"
  "chromium:chromium"  # the dashboard's browser test (Playwright drives it)
  "etcd-server:etcd"  # --discovery etcd:// (its tests start one on loopback)
  "nats-server:nats-server"  # --event-plane nats:// (likewise)
  "iproute2:ip"  # the multi-host test's network namespaces
)

missing=()
for entry in "${PACKAGES[@]}"; do
  command -v "${entry#*:}" >/dev/null 2>&1 || missing+=("${entry%%:*}")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "tokenmill needs these system packages: ${missing[*]}" >&2
  echo "install them with: sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
echo "installing system packages: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq || echo "apt-get update failed; trying the cached package lists" >&2
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
