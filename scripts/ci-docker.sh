#!/usr/bin/env bash
# CI's image and compose check (run by .ci/run after `make test`), on a machine with no image registry:
#   1. a Docker engine: Debian's docker.io, started by hand with its state in a temporary folder;
#   2. a base image: debootstrap of Debian bookworm (Python 3.11 and its venv module), imported;
#   3. the chunkattn image from the Dockerfile, with the host's CPU torch wheel served on loopback: no compiler,
#      ninja or pip in it, no triton;
#   4. that image run alone: its HEALTHCHECK turns healthy, Info and chunkattn_build_info say backend native
#      (the kernels prebuilt in the builder stage), a verified bench passes, SIGTERM stops it with exit 0;
#   5. the compose stack's servers, Envoy and Prometheus (deploy/ci/compose.ci.yml: local images), traffic
#      through Envoy verified and spread over both replicas, Prometheus scraping all three.
# A trap stops what it started (by PID) and removes what it made: containers, the engine and its state,
# docker0 and compose's bridges, the engine's iptables chains and rules, ip_forward as it was. It refuses to
# run beside another Docker engine.
# Where the engine cannot start this fails and says why, unless CHUNKATTN_SKIP_DOCKER=1. Prints build time
# and image size.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${CHUNKATTN_SKIP_DOCKER:-0}" = 1 ]; then
    echo "ci-docker: skipped (CHUNKATTN_SKIP_DOCKER=1)"
    exit 0
fi
fail() { echo "ci-docker: FAILED: $*" >&2; exit 1; }
say() { echo "ci-docker: $*"; }
free_port() { .venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
[ "$(id -u)" = 0 ] || fail "needs root (to install and start a Docker engine); set CHUNKATTN_SKIP_DOCKER=1 to skip"
command -v apt-get >/dev/null || fail "needs Debian's apt-get for docker.io and debootstrap; CHUNKATTN_SKIP_DOCKER=1 skips"

CLI=.venv/bin/chunkattn
[ -x "$CLI" ] || fail "run make install (or make test) first: $CLI is missing"
# The tools first: a fresh machine has no iptables, and the snapshot below reads it (a missing command there
# ended an earlier CI run with exit 127).
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null || ! command -v docker-compose >/dev/null \
    || ! command -v iptables >/dev/null || ! command -v ip >/dev/null || ! command -v curl >/dev/null; then
    say "installing Debian's docker.io, docker-compose, debootstrap, iptables, iproute2 and curl"
    log=$(mktemp /tmp/chunkattn-ci-apt.XXXXXX)
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        docker.io docker-compose debootstrap iptables iproute2 nftables curl; } >"$log" 2>&1 \
        || fail "apt-get could not install docker.io (see below); CHUNKATTN_SKIP_DOCKER=1 skips this step
$(tail -20 "$log")"
    rm -f "$log"
fi
export DOCKER_BUILDKIT=0  # the legacy builder: Debian's engine has no buildx
D=$(mktemp -d /tmp/chunkattn-ci-docker.XXXXXX)
DOCKER=/usr/bin/docker
COMPOSE="docker-compose -p chunkattn-ci -f docker-compose.yml -f deploy/ci/compose.ci.yml"
DOCKERD_PID="" WHEELS_PID="" FORWARD=$(cat /proc/sys/net/ipv4/ip_forward)
# What the machine had before, so that the clean-up removes only what this run made.
pgrep -x dockerd >/dev/null && fail "a Docker engine already runs here: this step starts its own and would share docker0
and iptables with it; stop it, or set CHUNKATTN_SKIP_DOCKER=1"
HAD_DOCKER0=$(ip link show docker0 >/dev/null 2>&1 && echo 1 || true)
BRIDGES_BEFORE=$(ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' || true)
FORWARD_POLICY=$(iptables -S FORWARD 2>/dev/null | sed -n 's/^-P FORWARD //p' || true)

cleanup() {
    set +e
    if [ -n "$DOCKERD_PID" ]; then
        DOCKER_HOST=unix://$D/sock $COMPOSE down -v --remove-orphans >/dev/null 2>&1
        $DOCKER -H unix://$D/sock rm -f chunkattn-ci-alone >/dev/null 2>&1
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$DOCKERD_PID" 2>/dev/null
    fi
    [ -n "$WHEELS_PID" ] && kill "$WHEELS_PID" 2>/dev/null
    pkill -f "containerd.*$D" 2>/dev/null
    [ -z "$HAD_DOCKER0" ] && ip link delete docker0 2>/dev/null
    for br in $(ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}'); do
        grep -qx "$br" <<<"$BRIDGES_BEFORE" || ip link delete "$br"
    done
    # The engine's iptables chains and rules (named DOCKER*, or on docker0 and compose's br-* bridges) go;
    # every other rule stays, those added meanwhile too.
    iptables-save 2>/dev/null | grep -v -E 'DOCKER|docker0|br-[0-9a-f]{12}' | iptables-restore 2>/dev/null
    [ -n "$FORWARD_POLICY" ] && iptables -P FORWARD "$FORWARD_POLICY"
    echo "$FORWARD" > /proc/sys/net/ipv4/ip_forward
    grep " $D/" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null
    rm -rf "$D"
}
trap cleanup EXIT

# 1. The engine.
dockerd --data-root "$D/data" --exec-root "$D/exec" --pidfile "$D/pid" -H "unix://$D/sock" >"$D/dockerd.log" 2>&1 &
DOCKERD_PID=$!
export DOCKER_HOST=unix://$D/sock
for _ in $(seq 100); do $DOCKER version >/dev/null 2>&1 && break; sleep 0.2; done
$DOCKER version >/dev/null 2>&1 || fail "the Docker engine did not start:
$(tail -20 "$D/dockerd.log")"
say "engine $($DOCKER version --format '{{.Server.Version}}') up"

# 2. The base image.
start=$(date +%s)
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$D/rootfs" \
    >"$D/debootstrap.log" 2>&1 || fail "debootstrap failed:
$(tail -20 "$D/debootstrap.log")"
# HTTPS here may go through an intercepting proxy whose CAs the host trusts: the image must trust them too.
cp /usr/local/share/ca-certificates/*.crt "$D/rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
chroot "$D/rootfs" update-ca-certificates >/dev/null 2>&1
rm -rf "$D/rootfs/var/cache/apt/archives/"*.deb "$D/rootfs/var/lib/apt/lists/"*
tar -C "$D/rootfs" -c . | $DOCKER import --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    - chunkattn-base:ci >/dev/null
rm -rf "$D/rootfs"
say "base image (debootstrap bookworm) in $(($(date +%s) - start)) s"

# 3. The image. The host's pip resolves torch==2.13.0 to its CPU wheel; the build takes it from loopback.
mkdir -p "$D/wheels"
.venv/bin/python -m pip download -q --no-deps --disable-pip-version-check -d "$D/wheels" torch==2.13.0 \
    || fail "pip could not fetch the torch wheel"
port=$(free_port)
.venv/bin/python -m http.server --bind 127.0.0.1 --directory "$D/wheels" "$port" >/dev/null 2>&1 &
WHEELS_PID=$!
start=$(date +%s)
$DOCKER build -q --network host -t chunkattn:ci --build-arg BASE=chunkattn-base:ci --build-arg TORCH_INDEX= \
    --build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$port/" . >"$D/build.log" 2>&1 \
    || fail "docker build failed:
$(tail -30 "$D/build.log")"
build_s=$(($(date +%s) - start))
size=$($DOCKER image inspect chunkattn:ci --format '{{.Size}}')
say "image chunkattn:ci built in ${build_s} s, $((size / 1000000)) MB"
found=$($DOCKER run --rm --entrypoint sh chunkattn:ci -c 'id -u; command -v gcc g++ cc c++ ninja pip pip3 apt-get || true')
[ "$found" = "10001
/usr/bin/apt-get" ] || [ "$found" = 10001 ] \
    || fail "the image should run as 10001 without a compiler, ninja or pip; found: $found"
# triton cannot run without a GPU: only the CUDA build (its torch requires it) has it.
if triton=$($DOCKER run --rm --entrypoint python chunkattn:ci -c 'import triton; print(triton.__file__)' 2>&1); then
    fail "the CPU image has triton: $triton"
fi
grep -q "No module named 'triton'" <<<"$triton" || fail "import triton failed, but not for want of triton: $triton"
native=$($DOCKER run --rm --entrypoint sh chunkattn:ci -c 'ls "$CHUNKATTN_NATIVE_DIR"' | tr '\n' ' ')
say "image: user 10001, no compiler, ninja, pip or triton; prebuilt kernels: $native"

# 4. The image alone: health, Info, a verified bench, SIGTERM.
grpc_port=$(free_port)
metrics_port=$(free_port)
$DOCKER run -d --name chunkattn-ci-alone --network host -e "CHUNKATTN_TARGET=127.0.0.1:$grpc_port" chunkattn:ci \
    --host 127.0.0.1 --port "$grpc_port" --metrics-port "$metrics_port" --num-blocks 512 >/dev/null
for _ in $(seq 120); do
    [ "$($DOCKER inspect -f '{{.State.Health.Status}}' chunkattn-ci-alone)" = healthy ] && break
    sleep 1
done
[ "$($DOCKER inspect -f '{{.State.Health.Status}}' chunkattn-ci-alone)" = healthy ] \
    || fail "the container's HEALTHCHECK never passed: $($DOCKER logs chunkattn-ci-alone 2>&1 | tail -20)"
info=$($CLI info --target "127.0.0.1:$grpc_port") || fail "Info: $info"
echo "$info"
grep -q "backend native on cpu" <<<"$info" || fail "the image should serve with its prebuilt native kernels: $info
$($DOCKER logs chunkattn-ci-alone 2>&1 | grep -i native)"
metrics=$(curl -sf "http://127.0.0.1:$metrics_port/metrics") || fail "no metrics on port $metrics_port"
grep -q '^chunkattn_build_info{.*backend="native"' <<<"$metrics" \
    || fail "chunkattn_build_info should say backend native: $(grep chunkattn_build_info <<<"$metrics")"
$CLI bench --target "127.0.0.1:$grpc_port" --sequences 8 --concurrency 2 --prompt-len 64 --output-len 8 \
    --verify 20 --progress none | tail -2
$DOCKER stop -t 30 chunkattn-ci-alone >/dev/null
code=$($DOCKER inspect -f '{{.State.ExitCode}}' chunkattn-ci-alone)
[ "$code" = 0 ] || fail "SIGTERM: the server exited $code: $($DOCKER logs chunkattn-ci-alone 2>&1 | tail -10)"
# Read the logs whole: `docker logs | grep -q` fails under pipefail when grep exits early (SIGPIPE).
logs=$($DOCKER logs chunkattn-ci-alone 2>&1)
grep -q "draining" <<<"$logs" || fail "SIGTERM did not reach the server (no drain): $(tail -10 <<<"$logs")"
say "image alone: healthy, Info and build_info say native, verified bench, SIGTERM -> drain, exit 0"

# 5. The compose stack: servers, Envoy, Prometheus.
$DOCKER build -q -t chunkattn-envoy:ci --build-arg BASE=chunkattn-base:ci --network host -f deploy/ci/envoy.Dockerfile \
    deploy/ci >"$D/envoy-build.log" 2>&1 || fail "Envoy's CI image: $(tail -20 "$D/envoy-build.log")"
$DOCKER build -q -t chunkattn-prometheus:ci --build-arg BASE=chunkattn-base:ci --network host \
    -f deploy/ci/prometheus.Dockerfile deploy/ci >"$D/prom-build.log" 2>&1 \
    || fail "Prometheus's CI image: $(tail -20 "$D/prom-build.log")"
start=$(date +%s)
$COMPOSE up -d --no-build server-1 server-2 envoy prometheus >"$D/compose.log" 2>&1 \
    || fail "docker-compose up: $(tail -20 "$D/compose.log")"
# Traffic only once Envoy routes to both replicas: a replica joining the ring moves the keys it takes over,
# and sessions already started on another replica would lose their KV (docs/deployment.md).
.venv/bin/python -c 'from chunkattn_server.tools.probe import wait_routable as w; w("127.0.0.1:50051", "http://127.0.0.1:9901", 2, 120)' \
    || fail "Envoy did not route to both replicas: $($COMPOSE logs --tail 20 2>&1)"
say "compose stack up in $(($(date +%s) - start)) s"
# What Envoy saw of its replicas (health checks, outlier ejections, ring changes, DNS), for a failure's message.
envoy_state() {
    curl -sf http://127.0.0.1:9901/stats | grep -E "^cluster\.chunkattn\.(health_check|outlier|membership|lb_|update|assignment)" \
        | grep -v ": 0$"
    curl -sf "http://127.0.0.1:9901/clusters" | grep -E "::(health_flags|rq_total|hostname)::"
    $COMPOSE logs --tail 15 server-1 server-2 2>&1
}
bench=$($CLI bench --target 127.0.0.1:50051 --sequences 24 --concurrency 4 --prompt-len 64 --output-len 8 \
    --verify 40 --progress none) || fail "bench through Envoy: $bench
Envoy and the replicas then:
$(envoy_state)"
grep -q " 0 mismatches" <<<"$bench" || fail "bench through Envoy did not verify: $bench"
served=""
for _ in $(seq 60); do  # Prometheus scrapes every 5 s: wait until it has seen both replicas' calls and Envoy
    served=$(curl -sf 'http://127.0.0.1:9090/api/v1/query' \
        --data-urlencode 'query=count(sum by (instance) (chunkattn_requests_total{rpc="Attend"}) > 0) + count(up{job="envoy"} == 1)' \
        | .venv/bin/python -c 'import json, sys; r = json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else 0)' \
        2>/dev/null || echo 0)
    [ "$served" = 3 ] && break
    sleep 1
done
[ "$served" = 3 ] || fail "Prometheus did not see both replicas serving and Envoy up (got $served of 3)"
say "compose: bench through Envoy verified; Prometheus saw both replicas serve and Envoy up"
$COMPOSE down -v >/dev/null 2>&1
say "passed (build ${build_s} s, image $((size / 1000000)) MB)"
