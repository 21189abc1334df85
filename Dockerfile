# weightd's image, for those with a container builder. `make image` builds
# the same image without one (internal/imagebuild): same binary path,
# entrypoint, environment and labels, on the same glibc (Debian 12's).
#
#   docker build \
#     --build-arg VERSION=$(git describe --tags --always --dirty) \
#     --build-arg COMMIT=$(git rev-parse --short HEAD) \
#     -t ghcr.io/weightd/weightd:$(git describe --tags --always --dirty) .
#
# Both architectures: docker buildx build --platform linux/amd64,linux/arm64
# (the build stage then runs under emulation for the other one: cgo rules
# out a plain GOARCH cross-compile).

# Debian 12, as the runtime base: a binary linked against a newer glibc than
# the runtime's would not start.
ARG GO_IMAGE=golang:1.26.8-bookworm

FROM ${GO_IMAGE} AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
# cmd/weightd imports only cmd/ and pkg/.
COPY cmd cmd
COPY pkg pkg
ARG VERSION=dev
ARG COMMIT=dev
# cgo: go-nvml dlopens the driver's libnvidia-ml.so.1. The flags are the
# Makefile's (NVML's deprecated functions are called on purpose).
ENV CGO_ENABLED=1 CGO_CFLAGS="-O2 -g -Wno-deprecated-declarations"
RUN go build -trimpath -ldflags "-X main.version=${VERSION} -X main.commit=${COMMIT}" \
      -o /out/weightd ./cmd/weightd

# distroless/base-debian12 rather than debian:12-slim: it holds what the
# binary needs and nothing else (glibc with libm, libdl, libpthread and
# librt, which libnvidia-ml.so.1 names when go-nvml dlopens it; CA
# certificates for Hugging Face and registries over TLS; /etc/passwd with
# root; /tmp with mode 1777), no shell or package manager, so less to patch
# and to scan. Its default user is root, which the DaemonSet runs as (the
# :nonroot tag would not do). The NVIDIA container runtime mounts
# libnvidia-ml.so.1 into its /usr/lib/<multiarch> directory, on the
# loader's default path. Nothing is written outside the mounted volumes and
# /tmp, so it runs with a read-only root filesystem.
FROM gcr.io/distroless/base-debian12
ARG VERSION=dev
ARG COMMIT=dev
LABEL org.opencontainers.image.title="weightd" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${COMMIT}" \
      org.opencontainers.image.source="https://github.com/weightd/weightd"
COPY --from=build /out/weightd /usr/local/bin/weightd
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /
# The DaemonSet passes `agent ...` as args; its probes and the examples'
# init containers run `weightd status` and `weightd fetch ...`.
ENTRYPOINT ["weightd"]
