#!/usr/bin/env bash
# The compose stack for real, on one machine posing as three hosts (run as root from anywhere):
#
#   peers/compose_check.sh
#
#   1. builds the image (BuildKit); without a reachable image registry the base image is made from
#      Debian packages (debootstrap + docker import), without the torch index a local torch wheel is used,
#      and the host's CA bundle reaches pip as a build secret;
#   2. `docker compose up -d` (or docker-compose 1.29): two coordinators and the monitor, with
#      PUBLIC_IP = this host's address on a private "internet" (a bridge in its own network namespace);
#   3. two volunteers on two other hosts (network namespaces on that bridge, no other route) run the
#      README's volunteer command from this checkout's .venv with the --initial-peers coordinator-a printed;
#      they must train together (steps advance, peers 2/2);
#   4. restarts coordinator-a as a new container (compose up --force-recreate, as after an image update:
#      only its volume carries over): same peer id, the volunteers keep stepping;
#   5. the compose `trainer` service joins through the restarted coordinator-a alone, downloads the run's
#      state and trains with them (3/3); the monitor and every healthcheck agree;
#   6. a volunteer started with the documented `docker run` (host network) joins too (4/4);
#   7. tears everything down (trainers: SIGTERM must end them with exit 0 and no child left; containers,
#      network, volumes, namespaces), also on failure.
# Prints a PASS/FAIL line per check and a summary; exit 0 only if all passed. Logs: runs/compose_check/.
#
# Environment: BASE_IMAGE (skip the registry/debootstrap choice), REBUILD_BASE=1 (redo the debootstrap
# image), TORCH_INDEX_URL, LIONCUB_VENV (default ./.venv), CHECK_SUBNET (default 10.78.0),
# CHECK_TIMEOUT_S (per wait, default 240), IMAGE_EXTRAS (build argument EXTRAS, default none),
# CHECK_TASK (default byte-gpt: digits needs scikit-learn, which the image's core install leaves out).
set -eEuo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PROJECT=lioncubcheck
RUN_ID=compose-check
IMAGE=lioncub-p2p:latest            # what docker-compose.yml's services run
NET=${CHECK_SUBNET:-10.78.0}
PUBLIC_IP=$NET.1
NS_INET=lcc-inet
VOLUNTEERS=(lcc-vol1 lcc-vol2)
VENV=${LIONCUB_VENV:-$ROOT/.venv}
WAIT_S=${CHECK_TIMEOUT_S:-240}
TORCH_VERSION=2.13.0
TASK=${CHECK_TASK:-byte-gpt}         # a built-in task the core install (the image) can train
BOUNDS="--steps 1000000 --max-seconds 1200"   # the check stops them; these bound a run left behind
TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
LOGS=$ROOT/runs/compose_check
T0=$(date +%s)

RESULTS=()
FAILED=0
TRAINER_PIDS=()
CREATED_WHEELS=""
STACK_UP=0
DOCKER_RUN_NAME=lcc-docker-run-volunteer   # container and volume of the documented `docker run` volunteer

say() { printf '[%4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
record() {  # record PASS|FAIL "check" "detail"
    RESULTS+=("$(printf '%-4s  %-34s %s' "$1" "$2" "$3")")
    say "$1 $2: $3"
    [ "$1" = PASS ] || FAILED=1
}
die() { record FAIL "$1" "$2"; exit 1; }

# -- tools -------------------------------------------------------------------------------------------
pick_docker() {  # a docker CLI that builds with BuildKit: buildx, or a pre-23 CLI with DOCKER_BUILDKIT=1
    local candidate
    for candidate in $(type -ap docker); do
        if "$candidate" buildx version > /dev/null 2>&1; then DOCKER=$candidate; return 0; fi
        local major
        major=$("$candidate" version --format '{{.Client.Version}}' 2> /dev/null | cut -d. -f1 || true)
        if [[ "$major" =~ ^[0-9]+$ ]] && [ "$major" -lt 23 ]; then DOCKER=$candidate; return 0; fi
    done
    return 1
}
pick_compose() {
    if docker compose version > /dev/null 2>&1; then COMPOSE=(docker compose)
    elif command -v docker-compose > /dev/null; then COMPOSE=(docker-compose)
    else return 1; fi
}
compose() {
    env RUN_ID="$RUN_ID" PUBLIC_IP="$PUBLIC_IP" TRAINER_ARGS="${TRAINER_ARGS:-}" \
        "${COMPOSE[@]}" -p "$PROJECT" -f "$ROOT/docker-compose.yml" --profile trainer "$@"
}
container() { compose ps -q "$1" 2> /dev/null | head -1; }
health() { "$DOCKER" inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$1" 2> /dev/null || echo gone; }

wait_until() {  # wait_until SECONDS "what" command...: poll every second
    local limit=$1 what=$2; shift 2
    local deadline=$(( $(date +%s) + limit ))
    until "$@"; do
        if [ "$(date +%s)" -ge "$deadline" ]; then say "timed out after ${limit}s waiting for $what"; return 1; fi
        sleep 1
    done
}

# -- metrics of the trainers (JSON lines: step, peers, group) -----------------------------------------
last_metric() {  # last_metric FILE FIELD -> value of FIELD in the last complete line, or -1
    "$VENV/bin/python" - "$1" "$2" << 'EOF'
import json, sys
value = -1
try:
    for line in open(sys.argv[1]):
        try:
            value = json.loads(line)[sys.argv[2]]
        except (ValueError, KeyError):
            pass
except FileNotFoundError:
    pass
print(value)
EOF
}
trainer_log() { echo "$LOGS/$1.jsonl"; }
volunteers_alive() {  # a volunteer that exited ends the wait at once (its log says why)
    local i
    for i in "${!TRAINER_PIDS[@]}"; do
        kill -0 "${TRAINER_PIDS[$i]}" 2> /dev/null \
            || die "volunteer ${VOLUNTEERS[$i]}" "exited: $(grep -v '^ ' "$LOGS/${VOLUNTEERS[$i]}.log" | tail -2 | tr '\n' ' ')"
    done
}
steps_at_least() {  # steps_at_least MIN ns...: every volunteer's last step >= MIN
    local min=$1 ns; shift
    volunteers_alive
    for ns in "$@"; do [ "$(last_metric "$(trainer_log "$ns")" step)" -ge "$min" ] || return 1; done
}
peers_at_least() {  # peers_at_least N ns...: every volunteer's last round counted >= N peers
    local n=$1 ns; shift
    volunteers_alive
    for ns in "$@"; do [ "$(last_metric "$(trainer_log "$ns")" peers)" -ge "$n" ] || return 1; done
}
min_step() {
    local ns lowest=-1 s
    for ns in "${VOLUNTEERS[@]}"; do
        s=$(last_metric "$(trainer_log "$ns")" step)
        if [ "$lowest" -lt 0 ] || [ "$s" -lt "$lowest" ]; then lowest=$s; fi
    done
    echo "$lowest"
}

# -- teardown (also on failure or Ctrl+C) ----------------------------------------------------------------
teardown() {
    local code=$?
    set +eE
    trap - EXIT INT TERM ERR
    say "tearing down"
    local pid codes="" stragglers=""
    # SIGTERM to each trainer only (as kill, docker stop and systemd do): it must leave and stop its children
    for pid in "${TRAINER_PIDS[@]}"; do kill -TERM "$pid" 2> /dev/null; done
    for pid in "${TRAINER_PIDS[@]}"; do
        for _ in $(seq 60); do kill -0 -- "-$pid" 2> /dev/null || break; sleep 0.5; done
        kill -0 -- "-$pid" 2> /dev/null && stragglers+=" $pid"
        kill -KILL -- "-$pid" 2> /dev/null
        wait "$pid" 2> /dev/null; codes+=" $?"
    done
    if [ "${#TRAINER_PIDS[@]}" -gt 0 ]; then
        if [ -z "$stragglers" ] && [ -z "${codes// 0/}" ]; then
            record PASS "volunteers leave" "SIGTERM: exit codes$codes, no child process left"
        else record FAIL "volunteers leave" "SIGTERM: exit codes$codes; still running after 30 s:${stragglers:- none}"; fi
    fi
    # containers get SIGTERM from `docker stop` / `compose stop`: each must leave and exit 0 in its grace time
    local stopped="" exits=""
    if [ -n "${DOCKER:-}" ] && "$DOCKER" inspect "$DOCKER_RUN_NAME" > /dev/null 2>&1; then
        "$DOCKER" stop -t 30 "$DOCKER_RUN_NAME" > /dev/null 2>&1
        "$DOCKER" logs -t "$DOCKER_RUN_NAME" > "$LOGS/docker-run-volunteer.log" 2>&1
        stopped+=" $DOCKER_RUN_NAME=$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$DOCKER_RUN_NAME")"
        "$DOCKER" rm -f "$DOCKER_RUN_NAME" > /dev/null 2>&1
    fi
    [ -n "${DOCKER:-}" ] && "$DOCKER" volume rm "$DOCKER_RUN_NAME" > /dev/null 2>&1
    if [ "$STACK_UP" = 1 ]; then
        compose stop --timeout 30 > "$LOGS/compose-stop.log" 2>&1
        for service in coordinator-a coordinator-b monitor trainer; do
            local id; id=$(container "$service")
            [ -n "$id" ] || continue
            "$DOCKER" logs -t "$id" > "$LOGS/$service.log" 2>&1
            stopped+=" $service=$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$id")"
        done
        compose down -v --remove-orphans --timeout 20 > "$LOGS/compose-down.log" 2>&1
    fi
    # every peer here is honest: a reducer "caught" (allreduce/auditing.py's warning) is a false accusation
    local accused
    accused=$(cat "$LOGS"/lcc-vol*.log "$LOGS"/trainer.log "$LOGS"/docker-run-volunteer.log 2> /dev/null \
              | grep -E 'reducer [A-Za-z0-9]+ caught \(' || true)
    if [ -n "$(ls "$LOGS"/lcc-vol*.log 2> /dev/null)" ]; then
        if [ -z "$accused" ]; then record PASS "no honest peer accused" "no 'reducer ... caught' in any trainer's log"
        else record FAIL "no honest peer accused" "$(wc -l <<< "$accused") accusations, e.g. $(head -1 <<< "$accused" | sed -E 's/.*(reducer .*)/\1/' | cut -c1-160)"; fi
    fi
    if [ -n "$stopped" ]; then
        exits=$(tr ' ' '\n' <<< "$stopped" | grep -v '=0$' | tr '\n' ' ' || true)
        if [ -z "${exits// /}" ]; then record PASS "containers stop" "exit codes:$stopped"
        else record FAIL "containers stop" "exit codes:$stopped"; fi
    fi
    for ns in "${VOLUNTEERS[@]}" "$NS_INET"; do ip netns del "$ns" 2> /dev/null; done
    ip link del lcc-host 2> /dev/null
    [ -n "$CREATED_WHEELS" ] && rm -rf "$CREATED_WHEELS"

    # what must be gone is gone
    local left=""
    for pid in "${TRAINER_PIDS[@]}"; do kill -0 -- "-$pid" 2> /dev/null && left+=" trainer-group-$pid"; done
    if [ -n "${DOCKER:-}" ] && [ "$STACK_UP" = 1 ]; then
        left+=$("$DOCKER" ps -aq --filter "label=com.docker.compose.project=$PROJECT" | sed 's/^/ container-/' | tr '\n' ' ')
        left+=$("$DOCKER" volume ls -q --filter "label=com.docker.compose.project=$PROJECT" | sed 's/^/ volume-/' | tr '\n' ' ')
    fi
    "$DOCKER" ps -aq --filter "name=^$DOCKER_RUN_NAME\$" | grep -q . && left+=" container-$DOCKER_RUN_NAME"
    "$DOCKER" volume ls -q --filter "name=^$DOCKER_RUN_NAME\$" | grep -q . && left+=" volume-$DOCKER_RUN_NAME"
    left+=$(ip netns list | awk '/^lcc-/{print " netns-"$1}' | tr '\n' ' ')
    if [ -z "${left// /}" ]; then record PASS "teardown" "no trainer, container, volume or namespace left"
    else record FAIL "teardown" "left behind:$left"; fi

    echo
    echo "== compose check summary ($(( $(date +%s) - T0 )) s; logs in $LOGS) =="
    printf '%s\n' "${RESULTS[@]}"
    if [ "$FAILED" = 0 ] && [ "$code" = 0 ]; then echo "PASS"; exit 0; fi
    echo "FAIL"
    exit 1
}

# ======================================================================================================
[ "$(id -u)" = 0 ] || { echo "compose_check: run as root (it creates network namespaces and talks to dockerd)"; exit 2; }
mkdir -p "$LOGS"
rm -f "$LOGS"/*.jsonl "$LOGS"/*.log
trap teardown EXIT
trap 'record FAIL "script" "line $LINENO failed: $BASH_COMMAND"' ERR
trap 'exit 130' INT TERM

pick_docker || die "docker CLI" "no docker CLI that builds with BuildKit: install docker-buildx, or docker.io (apt)"
"$DOCKER" info > /dev/null 2>&1 || die "docker daemon" "not reachable: start it (dockerd &) and rerun"
pick_compose || die "compose" "neither 'docker compose' nor docker-compose: apt-get install docker-compose"
[ -x "$VENV/bin/lioncub-train" ] || die "volunteer venv" "$VENV/bin/lioncub-train missing: set LIONCUB_VENV"
for ns in "$NS_INET" "${VOLUNTEERS[@]}"; do
    ! ip netns list | grep -qw "^$ns" || die "namespaces" "$ns exists (an earlier check?): ip netns del $ns"
done
! ip -4 addr | grep -q "inet $NET\." || die "address" "$NET.0/24 is in use here: set CHECK_SUBNET"
if [ -n "$(compose ps -q 2> /dev/null)" ]; then die "compose project" "$PROJECT is running: ${COMPOSE[*]} -p $PROJECT down -v"; fi
record PASS "tools" "$DOCKER ($("$DOCKER" version --format '{{.Server.Version}}') engine), ${COMPOSE[*]} $("${COMPOSE[@]}" version --short 2> /dev/null | head -1)"

# -- 1. image --------------------------------------------------------------------------------------------
if [ -z "${BASE_IMAGE:-}" ]; then
    if "$DOCKER" image inspect python:3.11-slim > /dev/null 2>&1 || timeout 60 "$DOCKER" pull -q python:3.11-slim > /dev/null 2>&1; then
        BASE_IMAGE=python:3.11-slim
        base_note="python:3.11-slim from a registry"
    else
        BASE_IMAGE=local/lioncub-base:bookworm
        if [ "${REBUILD_BASE:-0}" = 1 ] || ! "$DOCKER" image inspect "$BASE_IMAGE" > /dev/null 2>&1; then
            command -v debootstrap > /dev/null || die "base image" "no registry and no debootstrap: apt-get install debootstrap"
            # the Debian mirror apt uses here ("deb URI ..." lines or deb822 "URIs:"), comments left out
            mirror=$( (cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2> /dev/null || true) | grep -vE '^\s*#' \
                     | grep -E '^\s*(deb|URIs:)\s' | grep -oE 'https?://[^ ]+/debian/?(\s|$)' | grep -v security \
                     | head -1 | tr -d ' ' || true)
            suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
            rootfs=$(mktemp -d /var/tmp/lioncub-rootfs.XXXXXX)
            say "no image registry reachable: debootstrap $suite from ${mirror:-http://deb.debian.org/debian}"
            t_base=$(date +%s)
            debootstrap --variant=minbase --include=python3,python3-venv "$suite" "$rootfs" \
                "${mirror:-http://deb.debian.org/debian}" > "$LOGS/debootstrap.log" 2>&1 \
                || { rm -rf "$rootfs"; die "base image" "debootstrap failed, see $LOGS/debootstrap.log"; }
            tar -C "$rootfs" -c . | "$DOCKER" import - "$BASE_IMAGE" > /dev/null
            rm -rf "$rootfs"
            base_note="made with debootstrap + docker import in $(( $(date +%s) - t_base )) s"
        else
            base_note="debootstrap image made earlier (REBUILD_BASE=1 to redo)"
        fi
    fi
else
    base_note="given"
fi
record PASS "base image" "$BASE_IMAGE: $base_note"

if [ -n "$TORCH_INDEX_URL" ] && ! curl -sfI -m 15 "$TORCH_INDEX_URL/torch/" > /dev/null 2>&1; then
    # the torch index is out of reach: hand the build a CPU wheel that pip on this host can see
    wheel=""
    for candidate in "$ROOT"/docker-wheels/torch-"$TORCH_VERSION"*cp311*.whl \
            $(pip config list 2> /dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p" | sed "s|\$|/torch-$TORCH_VERSION+cpu-cp311-*.whl|"); do
        for file in $candidate; do [ -z "$wheel" ] && [ -f "$file" ] && wheel=$file; done
    done
    [ -n "$wheel" ] || die "torch wheel" "$TORCH_INDEX_URL unreachable and no torch-$TORCH_VERSION+cpu cp311 wheel here: put one in docker-wheels/"
    if [ ! -d "$ROOT/docker-wheels" ]; then
        mkdir "$ROOT/docker-wheels" && CREATED_WHEELS=$ROOT/docker-wheels
        ln "$wheel" "$ROOT/docker-wheels/" 2> /dev/null || cp "$wheel" "$ROOT/docker-wheels/"
    fi
    say "torch index unreachable: building with $(basename "$wheel") from docker-wheels/"
    TORCH_INDEX_URL=""
fi
cert=${PIP_CERT:-$(pip config get global.cert 2> /dev/null || true)}
[ -s "$cert" ] || cert=/etc/ssl/certs/ca-certificates.crt
secret=(); [ -s "$cert" ] && secret=(--secret "id=pip_cert,src=$cert")
say "building $IMAGE (log: $LOGS/build.log)"
t_build=$(date +%s)
if ! DOCKER_BUILDKIT=1 "$DOCKER" build --progress=plain -f peers/Dockerfile -t "$IMAGE" \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL" \
        --build-arg "EXTRAS=${IMAGE_EXTRAS:-}" "${secret[@]}" . > "$LOGS/build.log" 2>&1; then
    tail -20 "$LOGS/build.log"
    die "image build" "failed, see $LOGS/build.log"
fi
build_s=$(( $(date +%s) - t_build ))
# the image this replaced (now untagged) goes; the build cache keeps its layers
"$DOCKER" image prune -f --filter label=org.lioncub-p2p.image=peer > /dev/null 2>&1 || true
record PASS "image build" "$IMAGE in ${build_s} s ($(( $("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE") / 1000000 )) MB), base $BASE_IMAGE"

# -- 2. hosts: a private "internet" bridge; this host is $PUBLIC_IP on it, each volunteer has its own address
ip netns add "$NS_INET"
ip -n "$NS_INET" link set lo up
ip -n "$NS_INET" link add br0 type bridge
ip -n "$NS_INET" link set br0 up
ip link add lcc-host type veth peer name up0 netns "$NS_INET"
ip addr add "$PUBLIC_IP/24" dev lcc-host
ip link set lcc-host up
ip -n "$NS_INET" link set up0 master br0 up
i=2
for ns in "${VOLUNTEERS[@]}"; do
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "lcc-v$i" netns "$NS_INET" type veth peer name eth0 netns "$ns"
    ip -n "$ns" addr add "$NET.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$NS_INET" link set "lcc-v$i" master br0 up
    i=$((i + 1))
done

# -- 3. coordinators -----------------------------------------------------------------------------------
t_up=$(date +%s)
STACK_UP=1
compose up -d --no-build coordinator-a coordinator-b monitor > "$LOGS/compose-up.log" 2>&1 \
    || { cat "$LOGS/compose-up.log"; die "compose up" "failed"; }
A=$(container coordinator-a)
printed_peers() { "$DOCKER" logs "$A" 2>&1 | sed -n 's/^ *--initial-peers //p'; }
has_printed() { [ -n "$(printed_peers)" ]; }
wait_until "$WAIT_S" "coordinator-a to print its addresses" has_printed \
    || die "compose up" "coordinator-a printed no --initial-peers: $("$DOCKER" logs --tail 5 "$A" 2>&1 | tr '\n' ' ')"
INITIAL_PEERS=$(printed_peers | head -1)
ID_BEFORE=$(grep -oE '/p2p/[A-Za-z0-9]+' <<< "$INITIAL_PEERS" | head -1 | cut -d/ -f3)
all_healthy() { local s; for s in "$@"; do [ "$(health "$(container "$s")")" = healthy ] || return 1; done; }
wait_until "$WAIT_S" "coordinators and monitor healthy" all_healthy coordinator-a coordinator-b monitor \
    || die "healthchecks" "$(for s in coordinator-a coordinator-b monitor; do echo -n "$s=$(health "$(container "$s")") "; done)"
record PASS "compose up" "healthy in $(( $(date +%s) - t_up )) s; coordinator-a printed --initial-peers $INITIAL_PEERS"
for ns in "${VOLUNTEERS[@]}"; do
    ip netns exec "$ns" timeout 5 bash -c "exec 3<> /dev/tcp/$PUBLIC_IP/31337" \
        || die "hosts" "$ns cannot open a TCP connection to $PUBLIC_IP:31337 (the published port)"
    [ -z "$(ip -n "$ns" route show default)" ] || die "hosts" "$ns has a default route"
done
record PASS "hosts" "volunteers ${VOLUNTEERS[0]}=$NET.2, ${VOLUNTEERS[1]}=$NET.3 reach $PUBLIC_IP:31337; no other route"

# -- 4. two volunteers on two other hosts: the README's command + explicit listen address + bounds --------
t_join=$(date +%s)
for ns in "${VOLUNTEERS[@]}"; do
    # shellcheck disable=SC2086  # the printed addresses are separate words
    ip netns exec "$ns" setsid "$VENV/bin/lioncub-train" --run-id "$RUN_ID" --initial-peers $INITIAL_PEERS \
        --host-maddrs /ip4/0.0.0.0/tcp/0 --task "$TASK" --quiet $BOUNDS \
        --metrics-jsonl "$(trainer_log "$ns")" > "$LOGS/$ns.log" 2>&1 < /dev/null &
    TRAINER_PIDS+=($!)
done
wait_until "$WAIT_S" "a first step on both volunteers" steps_at_least 0 "${VOLUNTEERS[@]}" \
    || die "volunteers start" "no step: $(tail -3 "$LOGS/${VOLUNTEERS[0]}.log" | tr '\n' ' ')"
first_step_s=$(( $(date +%s) - t_join ))
wait_until "$WAIT_S" "peers 2/2 on both volunteers" peers_at_least 2 "${VOLUNTEERS[@]}" \
    || die "train together" "peers $(last_metric "$(trainer_log "${VOLUNTEERS[0]}")" peers) and $(last_metric "$(trainer_log "${VOLUNTEERS[1]}")" peers)"
together_s=$(( $(date +%s) - t_join ))
s0=$(min_step)
wait_until "$WAIT_S" "20 more steps together" steps_at_least $((s0 + 20)) "${VOLUNTEERS[@]}" \
    || die "train together" "steps stuck at $s0"
peers_at_least 2 "${VOLUNTEERS[@]}" || die "train together" "a volunteer fell out of the group"
record PASS "volunteers train together" "first step after ${first_step_s} s, peers 2/2 after ${together_s} s, step $(min_step)"

# -- 5. restart coordinator-a: same identity, the run goes on ---------------------------------------------
s_before=$(min_step)
t_restart=$(date +%s)
"$DOCKER" logs -t "$A" > "$LOGS/coordinator-a.before-restart.log" 2>&1
compose up -d --no-build --no-deps --force-recreate coordinator-a > "$LOGS/compose-restart.log" 2>&1 \
    || die "restart coordinator-a" "compose up --force-recreate failed"
A_OLD=$A
A=$(container coordinator-a)
[ "$A" != "$A_OLD" ] || die "restart coordinator-a" "the container was not recreated"
wait_until "$WAIT_S" "coordinator-a to come back" has_printed || die "restart coordinator-a" "it printed no new addresses"
ID_AFTER=$(printed_peers | tail -1 | grep -oE '/p2p/[A-Za-z0-9]+' | head -1 | cut -d/ -f3)
wait_until "$WAIT_S" "coordinator-a healthy again" all_healthy coordinator-a || die "restart coordinator-a" "not healthy"
back_s=$(( $(date +%s) - t_restart ))
[ "$ID_AFTER" = "$ID_BEFORE" ] || die "coordinator-a identity" "peer id changed: $ID_BEFORE -> $ID_AFTER"
record PASS "coordinator-a identity" "same peer id $ID_AFTER in a new container (back in ${back_s} s)"
wait_until "$WAIT_S" "volunteers stepping after the restart" steps_at_least $((s_before + 30)) "${VOLUNTEERS[@]}" \
    || die "run survives restart" "steps stuck at $(min_step)"
peers_at_least 2 "${VOLUNTEERS[@]}" || die "run survives restart" "a volunteer fell out of the group"
record PASS "run survives restart" "volunteers went on from step $s_before to $(min_step), peers 2/2"

# -- 6. the compose trainer joins through the restarted coordinator-a alone -------------------------------
TRAINER_ARGS="--task $TASK $BOUNDS" compose up -d --no-build --no-deps trainer > "$LOGS/compose-trainer.log" 2>&1 \
    || die "compose trainer" "compose up trainer failed: $(tail -3 "$LOGS/compose-trainer.log" | tr '\n' ' ')"
TR=$(container trainer)
trainer_start() {  # the step of its first metrics line: where it joined the run
    "$DOCKER" exec "$TR" head -1 /data/metrics.jsonl 2> /dev/null | sed -nE 's/.*"step": ([0-9]+).*/\1/p'
}
trainer_exited() { [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$TR" 2> /dev/null)" != true ]; }
started_or_dead() { [ -n "$(trainer_start)" ] || trainer_exited; }
wait_until "$WAIT_S" "the compose trainer to start" started_or_dead || true
[ -n "$(trainer_start)" ] || die "compose trainer" "did not start: $("$DOCKER" logs --tail 4 "$TR" 2>&1 | tr '\n' ' ')"
start_step=$(trainer_start)
[ "$start_step" -gt 0 ] || die "compose trainer" "started from step 0: it did not download the run's state"
wait_until "$WAIT_S" "peers 3/3 on both volunteers" peers_at_least 3 "${VOLUNTEERS[@]}" \
    || die "compose trainer" "volunteers see peers $(last_metric "$(trainer_log "${VOLUNTEERS[0]}")" peers)"
wait_until "$WAIT_S" "the compose trainer healthy" all_healthy trainer || die "compose trainer" "not healthy: $(health "$TR")"
record PASS "compose trainer joins" "through coordinator-a only: downloaded step $start_step, peers 3/3, healthy"

monitor_line=$("$DOCKER" exec "$(container monitor)" tail -1 /data/monitor.jsonl)
monitor_ok() {
    "$DOCKER" exec "$(container monitor)" tail -1 /data/monitor.jsonl \
        | "$VENV/bin/python" -c 'import json,sys; r=json.loads(sys.stdin.read()); sys.exit(not (r["peers_alive"]>=3 and r["global_step"]>0))'
}
wait_until 60 "the monitor to count 3 peers" monitor_ok || die "monitor" "last line: $monitor_line"
monitor_line=$("$DOCKER" exec "$(container monitor)" tail -1 /data/monitor.jsonl)
record PASS "monitor" "$(sed -E 's/.*"peers_alive": ([0-9]+).*"global_step": ([0-9]+).*/peers alive \1, global step \2/' <<< "$monitor_line")"
# -- 7. a volunteer with the documented `docker run` (host network, as on a volunteer's own machine); no --task:
#       it adopts the run's from the manifest ------------------------------------------------------------------
"$DOCKER" run -d --name "$DOCKER_RUN_NAME" --network host --init -v "$DOCKER_RUN_NAME:/data" "$IMAGE" \
    lioncub-train --run-id "$RUN_ID" --initial-peers $INITIAL_PEERS --identity-path /data/identity.key \
    --checkpoint-dir /data/checkpoints --quiet --metrics-jsonl /data/metrics.jsonl $BOUNDS > /dev/null \
    || die "docker run volunteer" "docker run failed"
docker_run_step() {
    "$DOCKER" exec "$DOCKER_RUN_NAME" tail -1 /data/metrics.jsonl 2> /dev/null | sed -nE 's/.*"step": ([0-9]+).*/\1/p'
}
docker_run_started() { [ -n "$(docker_run_step)" ]; }
wait_until "$WAIT_S" "the docker run volunteer to step" docker_run_started \
    || die "docker run volunteer" "no step: $("$DOCKER" logs --tail 3 "$DOCKER_RUN_NAME" 2>&1 | tr '\n' ' ')"
wait_until "$WAIT_S" "peers 4/4 on both volunteers" peers_at_least 4 "${VOLUNTEERS[@]}" \
    || die "docker run volunteer" "volunteers see peers $(last_metric "$(trainer_log "${VOLUNTEERS[0]}")" peers)"
record PASS "docker run volunteer" "joined with the printed --initial-peers at step $(docker_run_step), peers 4/4"

all_healthy coordinator-a coordinator-b monitor trainer || die "healthchecks" "not all healthy at the end"
record PASS "healthchecks" "coordinator-a coordinator-b monitor trainer: healthy"
