#!/usr/bin/env bash
# Debian's chromium, for the test that renders `chunkattn bench --html` reports in a real browser
# (tests/test_bench_cli.py). `make test` runs this; it is a no-op once chromium is there. Without root or
# apt-get it installs nothing and says so, and that one test is skipped with the same reason.
set -u
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-chromium: not installed (needs root and apt-get); the HTML report's browser test will be skipped"
    exit 0
fi
echo "install-chromium: installing Debian's chromium (once) for the HTML report's browser test"
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } >/tmp/install-chromium.log 2>&1; then
    echo "install-chromium: apt-get failed (see /tmp/install-chromium.log); the browser test will be skipped"
fi
exit 0
