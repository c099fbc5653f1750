#!/usr/bin/env bash
# install-apt.sh COMMAND PACKAGE PURPOSE: Debian's PACKAGE, for the tests that need COMMAND (a real browser,
# a real Prometheus). `make test` runs it; a no-op once COMMAND is there. Without root or apt-get it installs
# nothing and says so, and those tests skip with the same reason (under CI=true they fail instead).
set -u
command_name=$1 package=$2 purpose=$3
if command -v "$command_name" >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-apt: $package not installed (needs root and apt-get); $purpose will be skipped"
    exit 0
fi
echo "install-apt: installing Debian's $package (once) for $purpose"
log=/tmp/install-apt-$package.log
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$package"; } >"$log" 2>&1; then
    echo "install-apt: apt-get failed (see $log); $purpose will be skipped"
fi
exit 0
