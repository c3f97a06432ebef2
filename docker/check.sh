#!/usr/bin/env bash
# Build and run pagoda's images with podman, end to end, and print a PASS/FAIL summary.
#
#   bash docker/check.sh              # as root, from anywhere; exit status 0 only if every check passed
#   KEEP_IMAGES=0 bash docker/check.sh   # also remove the images it built (the next run builds cold)
#
# 1. base        PYTHON_IMAGE (default: localhost/debian-py:bookworm, made by docker/make-base.sh when
#                missing; set PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm where Docker Hub is reachable)
# 2. cpu build   Dockerfile.cpu -> localhost/pagoda:cpu; torch's CPU wheel from TORCH_INDEX_URL, or,
#                when that index is unreachable, the local wheel pip's find-links has (linked into
#                docker/wheels/); reports the build time and the image size
# 3. image       non-root user, volumes, no C compiler in the runtime stage, the model inside
# 4. run         `podman run` with MODEL / PAGODA_ARGS: HEALTHCHECK green (`podman healthcheck run`),
#                the openai SDK through the mapped port (chat, streaming, a JSON schema), /metrics, the C
#                CPU kernels loaded
# 5. compose     podman-compose --profile cpu: pagoda-cpu and Prometheus (built from Debian's package
#                as localhost/prometheus:debian); Prometheus's targets API says pagoda is up and a
#                pagoda: series has samples; the CUDA service is neither built nor started
# 6. cuda build  Dockerfile as far as this host allows: without a registry, its PyTorch base is absent;
#                then the same Dockerfile on a stand-in base (Debian + torch's CPU build), built and run
# Grafana's image cannot be fetched here: tests/test_docker.py checks its provisioning and dashboard
# against the metrics a live server exports (in the default test tier).
#
# Containers, compose volumes and networks it makes are removed on exit, and so are dangling images (the
# images a rebuild left untagged, and the build stages no tagged image stands on): each run would otherwise
# leave gigabytes on a disk shared with everything else. The tagged images stay (KEEP_IMAGES=1, the
# default), each build's dependency stage tagged beside its image (IMAGE-deps), so the next run rebuilds
# from their cache.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
BASE=${PYTHON_IMAGE:-localhost/debian-py:bookworm}
IMAGE=localhost/pagoda:cpu
PROM_IMAGE=localhost/prometheus:debian
CUDA_IMAGE=localhost/pagoda:cuda
STANDIN_BASE=localhost/pytorch-standin:cpu
STANDIN_IMAGE=localhost/pagoda:cuda-standin
KEEP_IMAGES=${KEEP_IMAGES:-1}
NAME=pagoda-check-$$
PROJECT=pagodacheck$$
PORT=${CHECK_PORT:-18080}
PAGODA_PORT=$((PORT + 1))
PROMETHEUS_PORT=$((PORT + 2))
OUT=$(mktemp -d /tmp/pagoda-docker-check.XXXXXX)

# podman's settings for this host (shared/containers.md), for every podman call including
# podman-compose's: runc with cgroupfs (crun fails on these hybrid cgroups), ulimits under the hard
# limit (the defaults are refused with EPERM), and the docker image format (OCI drops HEALTHCHECK).
cat > "$OUT/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
EOF
export CONTAINERS_CONF=$OUT/containers.conf BUILDAH_FORMAT=docker

RESULTS=()
FAILED=0
result() { # result PASS|FAIL|INFO NAME DETAIL
    RESULTS+=("$(printf '%-4s  %-22s %s' "$1" "$2" "$3")")
    [ "$1" = FAIL ] && FAILED=1
    echo "== $1 $2: $3"
}
compose() {
    PYTHON_IMAGE=$BASE TORCH_INDEX_URL=$TORCH_INDEX_URL PROMETHEUS_IMAGE=$PROM_IMAGE \
        PAGODA_PORT=$PAGODA_PORT PROMETHEUS_PORT=$PROMETHEUS_PORT PAGODA_ARGS="--max-model-len 2048" \
        "$COMPOSE" -p "$PROJECT" --profile cpu "$@"
}
cleanup() {
    podman rm -f -v -t 5 "$NAME" "$NAME-cuda" >/dev/null 2>&1
    [ -n "${COMPOSE:-}" ] && compose down -v -t 5 >/dev/null 2>&1
    if [ "$KEEP_IMAGES" = 0 ]; then
        podman rmi -f "$IMAGE" "$IMAGE-deps" "$PROM_IMAGE" "$CUDA_IMAGE" "$STANDIN_IMAGE" "$STANDIN_IMAGE-deps" \
            "$STANDIN_BASE" >/dev/null 2>&1
    fi
    podman image prune -f >/dev/null 2>&1
    rm -rf "$OUT"
}
trap cleanup EXIT
summary() {
    echo
    echo "==================== docker/check.sh summary ($(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null)) ===================="
    printf '%s\n' "${RESULTS[@]}"
    if [ "$FAILED" = 0 ]; then echo "RESULT: PASS"; else echo "RESULT: FAIL"; fi
    exit "$FAILED"
}
# wait_for SECONDS COMMAND...: run COMMAND every 2 s until it succeeds
wait_for() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -ge $deadline ] && return 1
        sleep 2
    done
}

echo "podman: $(podman --version)   host: $(nproc) cores"
# Free disk where podman keeps its images: a full disk fails a build midway ("no space left on device")
free_gb=$(df -P --block-size=1G "$(podman info --format '{{.Store.GraphRoot}}' 2>/dev/null || echo /)" | awk 'NR == 2 {print $4}')
result INFO disk "${free_gb:-?} GB free for images (the builds need about 10)"
for tool in podman "$PY"; do
    command -v "$tool" >/dev/null || { result FAIL prerequisites "$tool not found"; summary; }
done
COMPOSE=$(command -v podman-compose || echo "$(dirname "$PY")/podman-compose")
[ -x "$COMPOSE" ] || COMPOSE=""

# ---- 1. base
if podman image exists "$BASE"; then
    result PASS base "$BASE present"
elif [ "$BASE" = localhost/debian-py:bookworm ]; then
    start=$SECONDS
    if bash docker/make-base.sh "$BASE"; then result PASS base "made $BASE in $((SECONDS - start)) s"
    else result FAIL base "docker/make-base.sh failed"; summary; fi
else
    podman pull "$BASE" || { result FAIL base "cannot pull $BASE"; summary; }
    result PASS base "pulled $BASE"
fi

# ---- 2. cpu build
TORCH_INDEX_URL=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
if [ -n "$TORCH_INDEX_URL" ] && ! "$PY" -c "import urllib.request as u; u.urlopen('$TORCH_INDEX_URL', timeout=5)" 2>/dev/null; then
    # The index is unreachable: take the wheel from pip's find-links (the local copy of the same build).
    links=$(pip config list 2>/dev/null | sed -nE "s/^[^=]*find-links='(.*)'$/\1/p" | head -n1)
    wheel=$(ls "$links"/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -n1)
    if [ -z "$wheel" ]; then result FAIL "cpu build" "$TORCH_INDEX_URL unreachable and no local torch 2.13.0+cpu wheel"; summary; fi
    ln -f "$wheel" docker/wheels/ 2>/dev/null || cp "$wheel" docker/wheels/
    echo "torch: $TORCH_INDEX_URL unreachable; using $wheel through docker/wheels/"
    TORCH_INDEX_URL=
fi
start=$SECONDS
cpu_args=(--network host -f Dockerfile.cpu --build-arg PYTHON_IMAGE="$BASE" --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL")
if podman build "${cpu_args[@]}" -t "$IMAGE" . >"$OUT/build.log" 2>&1; then
    podman build "${cpu_args[@]}" --target deps -t "$IMAGE-deps" . >>"$OUT/build.log" 2>&1  # from cache: a tag
    size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
    result PASS "cpu build" "$IMAGE in $((SECONDS - start)) s ($(grep -c '^--> Using cache' "$OUT/build.log") steps from cache), $((size / 1000000)) MB"
    podman history --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE" | cut -c1-150 | head -n 16
else
    tail -n 40 "$OUT/build.log"
    result FAIL "cpu build" "podman build failed (log above)"
    summary
fi

# ---- 3. the image's configuration and contents
user=$(podman image inspect --format '{{.Config.User}}' "$IMAGE")
volumes=$(podman image inspect --format '{{range $k, $v := .Config.Volumes}}{{$k}} {{end}}' "$IMAGE")
health=$(podman image inspect --format '{{.Config.Healthcheck.Test}}' "$IMAGE")
inside=$(podman run --rm --entrypoint /bin/sh "$IMAGE" -c \
    'id -u; command -v gcc cc c++ || echo no-compiler; ls /opt/pagoda/cache/models/SmolLM2-135M-Instruct; ls /opt/pagoda/cache/kernels' 2>&1)
echo "$inside"
if [ "$user" = 1000:1000 ] && [[ $volumes == *huggingface* && $volumes == */models* ]] && [[ $health == *health* ]] &&
    grep -qx no-compiler <<<"$inside" && grep -q model.safetensors <<<"$inside" && grep -q '^cpu_ops-.*\.so$' <<<"$inside"; then
    result PASS image "user $user, volumes: $volumes, no C compiler, model and C kernels inside"
else
    result FAIL image "user=$user volumes=[$volumes] healthcheck=[$health] contents: $(tr '\n' ' ' <<<"$inside")"
fi

# ---- 4. run it
start=$SECONDS
podman run -d --name "$NAME" -p "127.0.0.1:$PORT:8000" -e PAGODA_ARGS="--max-model-len 2048 --served-model-name smol" \
    "$IMAGE" >/dev/null 2>>"$OUT/podman.log"  # podman's complaints: no systemd for healthcheck timers
if wait_for 240 podman healthcheck run "$NAME"; then
    result PASS healthcheck "\`podman healthcheck run\` healthy after $((SECONDS - start)) s"
else
    podman logs "$NAME" 2>&1 | tail -n 30
    result FAIL healthcheck "not healthy within 240 s"
fi
if "$PY" docker/check_live.py server "http://127.0.0.1:$PORT" smol; then
    result PASS "openai sdk" "chat, stream, json_schema, PAGODA_ARGS applied, /metrics (docker/check_live.py)"
else
    result FAIL "openai sdk" "docker/check_live.py server failed (above)"
fi
if podman logs "$NAME" 2>&1 | grep -q "CPU kernels unavailable"; then
    result FAIL "cpu kernels" "the container fell back to the torch path: $(podman logs "$NAME" 2>&1 | grep 'CPU kernels unavailable')"
else
    result PASS "cpu kernels" "the build-time C kernels loaded (no fallback warning in the log)"
fi
podman rm -f -v -t 5 "$NAME" >/dev/null 2>>"$OUT/podman.log"

# ---- 5. compose: pagoda-cpu + Prometheus
if [ -z "$COMPOSE" ]; then
    result FAIL compose "podman-compose not found (pip install podman-compose)"
else
    if ! podman image exists "$PROM_IMAGE"; then
        mkdir -p "$OUT/prom" && cp docker/prometheus.Dockerfile "$OUT/prom/Dockerfile"
        podman build --network host --build-arg DEBIAN_IMAGE="$BASE" -t "$PROM_IMAGE" "$OUT/prom" >"$OUT/prom.log" 2>&1 ||
            { tail -n 20 "$OUT/prom.log"; result FAIL compose "building $PROM_IMAGE failed"; }
    fi
    mkdir -p models
    start=$SECONDS
    # --build: compose builds pagoda-cpu itself (from the cache of step 2); Grafana is left out (no registry)
    if compose up -d --build pagoda-cpu prometheus >"$OUT/compose.log" 2>&1; then
        services=$(podman ps --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}}' | sort | tr '\n' ' ')
        echo "compose up: $services($((SECONDS - start)) s)"
        if [[ $services == *pagoda-gpu* ]] || podman image exists "$CUDA_IMAGE"; then
            result FAIL "compose profiles" "the CUDA service was started or built: $services"
        else
            result PASS "compose profiles" "--profile cpu started: $services; pagoda:cuda neither built nor started"
        fi
        if "$PY" docker/check_live.py prometheus "http://127.0.0.1:$PAGODA_PORT" "http://127.0.0.1:$PROMETHEUS_PORT"; then
            result PASS prometheus "target pagoda up; pagoda: series with samples (docker/check_live.py)"
        else
            compose logs >"$OUT/compose-logs.txt" 2>&1
            tail -n 40 "$OUT/compose-logs.txt"
            result FAIL prometheus "docker/check_live.py prometheus failed (above)"
        fi
    else
        tail -n 40 "$OUT/compose.log"
        result FAIL compose "podman-compose up failed (log above)"
    fi
    compose down -v -t 5 >/dev/null 2>&1
fi
result INFO grafana "no image reachable here; provisioning and dashboard checked statically by tests/test_docker.py"

# ---- 6. the CUDA image, as far as this host goes
# a) as written: its base, PyTorch's CUDA runtime image, comes from a registry
if podman build --network host -f Dockerfile -t "$CUDA_IMAGE" . >"$OUT/cuda.log" 2>&1; then
    result PASS "cuda build" "built $CUDA_IMAGE"
else
    step=$(grep -m1 -E '^\[[0-9]+/[0-9]+\] STEP' "$OUT/cuda.log" | cut -c1-90)
    why=$(grep -m1 -iE 'error' "$OUT/cuda.log" | cut -c1-200)
    result INFO "cuda build" "stopped at its first step, \"$step\": $why"
fi
# b) on a stand-in base: the local Debian base with torch's CPU build where PyTorch's image has its
# CUDA build. Every other step of the Dockerfile runs as it would on a Docker host (the venv over the
# base's torch, the pinned dependencies, flash-attn-4's wheels, the model, gcc for Triton, the user),
# and the image it makes serves on the CPU.
printf '%s\n' 'ARG BASE' 'FROM ${BASE}' 'RUN --mount=type=bind,source=docker/wheels,target=/wheels \' \
    '    pip install --break-system-packages --no-cache-dir --find-links /wheels torch==2.13.0+cpu' \
    >"$OUT/standin.Dockerfile"
start=$SECONDS
if [ "${CUDA_STANDIN:-1}" = 0 ]; then
    result INFO "cuda stand-in" "skipped (CUDA_STANDIN=0)"
elif podman build --network host -f "$OUT/standin.Dockerfile" --build-arg BASE="$BASE" -t "$STANDIN_BASE" . \
    >"$OUT/standin.log" 2>&1 &&
    podman build --network host -f Dockerfile --build-arg PYTORCH_IMAGE="$STANDIN_BASE" -t "$STANDIN_IMAGE" . \
        >>"$OUT/standin.log" 2>&1; then
    podman build --network host -f Dockerfile --build-arg PYTORCH_IMAGE="$STANDIN_BASE" --target deps \
        -t "$STANDIN_IMAGE-deps" . >>"$OUT/standin.log" 2>&1
    size=$(podman image inspect --format '{{.Size}}' "$STANDIN_IMAGE")
    built="Dockerfile on $STANDIN_BASE built in $((SECONDS - start)) s ($((size / 1000000)) MB)"
    podman run -d --name "$NAME-cuda" -p "127.0.0.1:$((PORT + 3)):8000" -e PAGODA_ARGS="--served-model-name smol" \
        "$STANDIN_IMAGE" >/dev/null 2>>"$OUT/podman.log"
    if wait_for 240 podman healthcheck run "$NAME-cuda" &&
        "$PY" docker/check_live.py server "http://127.0.0.1:$((PORT + 3))" smol; then
        result PASS "cuda stand-in" "$built; served on the CPU, healthy, openai SDK checks pass"
    else
        podman logs "$NAME-cuda" 2>&1 | tail -n 30
        result FAIL "cuda stand-in" "$built, but the container failed the checks (above)"
    fi
    podman rm -f -v -t 5 "$NAME-cuda" >/dev/null 2>>"$OUT/podman.log"
else
    grep -E '^\[[0-9]+/[0-9]+\] STEP|rror' "$OUT/standin.log" | tail -n 20
    result FAIL "cuda stand-in" "building Dockerfile on $STANDIN_BASE failed (above)"
fi

summary
