# syntax=docker/dockerfile:1
# Prometheus from Debian's package, for hosts that cannot pull prom/prometheus (docker/check.sh
# builds it on the local base; compose takes it through PROMETHEUS_IMAGE). It behaves as the
# official image does where compose relies on it: the binary is the ENTRYPOINT, compose's
# `command:` gives the flags, it runs as nobody, and /prometheus holds the data.
#
#   docker build -f docker/prometheus.Dockerfile -t localhost/prometheus:debian docker
ARG DEBIAN_IMAGE=docker.io/library/debian:bookworm-slim
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus \
    && chown 65534:65534 /prometheus
# nobody, as in the official image
USER 65534:65534
WORKDIR /prometheus
VOLUME ["/prometheus"]
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
