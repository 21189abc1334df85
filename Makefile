# weightd — the verbs people type. `make demo` runs the main job on an
# embedded origin; `make test` is what CI runs (.ci/run).

SHELL := /usr/bin/env bash
.SHELLFLAGS := -eu -o pipefail -c

GO      ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT  ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo dev)
LDFLAGS := -X main.version=$(VERSION) -X main.commit=$(COMMIT)
BIN     := bin/weightd
# go-nvml's cgo bindings call functions NVML marks deprecated; keep the build quiet.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations

# Flags for `weightd demo`, e.g. make demo DEMO_FLAGS="--size 4GiB --files 16".
DEMO_FLAGS ?=
# How long each fuzz target runs under `make fuzz`.
FUZZTIME ?= 20s
# golangci-lint, installed into .tools/ from the Go module proxy by `make lint`.
GOLANGCI_LINT_VERSION ?= v2.15.0
TOOLS := $(CURDIR)/.tools

.PHONY: build demo test test-deps kube-assets containerd2 helm promtool manifests lint bench fuzz metrics-doc clean image image-push

## build: bin/weightd, with the version and commit stamped in
build:
	$(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/weightd

## image: the container image without a Docker daemon (internal/imagebuild): weightd built as by make build, glibc, CA certificates; for amd64 and arm64 where Debian's cross toolchain is installed (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross), else the host's alone; writes the OCI layout tarball bin/weightd-image.tar (ctr -n k8s.io images import bin/weightd-image.tar) and prints its reference: IMAGE=ref names it (default ghcr.io/weightd/weightd:$(VERSION)), IMAGE_ARCH=amd64 picks the platforms, PUSH=1 pushes it too
image:
	$(GO) run ./internal/imagebuild/cmd/image -go '$(GO)' -version '$(VERSION)' -commit '$(COMMIT)' -image '$(IMAGE)' -arch '$(IMAGE_ARCH)' -o bin/weightd-image.tar $(if $(filter 1 true yes,$(PUSH)),-push) $(if $(filter 1 true yes,$(INSECURE)),-insecure)

## image-push: make image, then push it to the registry of IMAGE with the credentials of ~/.docker/config.json (plain HTTP to loopback and private addresses, to any with INSECURE=1)
image-push:
	$(MAKE) image PUSH=1

## demo: an embedded origin and three in-process agents share a generated 1 GiB model peer-to-peer, then fetch it again from the cache
demo: build
	./$(BIN) demo $(DEMO_FLAGS)

## kube-assets: build kube-apiserver, kube-scheduler, kube-controller-manager and kubelet v1.37.2 and etcd v3.7.3 for the real-cluster tests (internal/kubetest, internal/kubenode, test/e2e) from the Go module proxy into WEIGHTD_KUBE_ASSETS or ~/.cache/weightd/kube-1.37.2; about 15 minutes on a fresh machine (2 cores), nothing once built
kube-assets:
	$(GO) run ./internal/kubetest/cmd/kube-assets

## containerd2: build containerd and ctr v2.4.2 for the tests and bench/mirrorswarm from the Go module proxy into ~/.cache/weightd/containerd-2.4.2; about 3 minutes on a fresh machine, nothing once built
containerd2:
	$(GO) run ./internal/services/cmd/containerd2

## helm: build Helm v4.3.2 for the chart's tests (test/deploy) and `make manifests` from the Go module proxy into WEIGHTD_HELM_CACHE or ~/.cache/weightd/helm-4.3.2; about 5 minutes on a fresh machine, nothing once built
helm:
	$(GO) run ./internal/services/cmd/helm

## promtool: build promtool v0.316.0 (Prometheus 3.16.0) for the alert rules' unit tests (test/monitoring, TestPromtoolRules) from the Go module proxy into WEIGHTD_PROMTOOL_CACHE or ~/.cache/weightd/promtool-0.316.0; about 7 minutes on a fresh, idle machine (2 cores, 13 CPU-minutes; 17.5 minutes beside a CI run), nothing once built
promtool:
	$(GO) run ./internal/services/cmd/promtool

## test-deps: install what the tests need on a fresh Debian machine (a C toolchain for the race detector, iproute2 for the multi-host tests, containerd, docker-registry, runc and the CNI plugins for the image and kubelet tests, the arm64 cross compiler for the arm64 image; kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and etcd built by kube-assets, containerd 2.x by containerd2, Helm by helm, promtool by promtool: about 30 minutes the first time)
test-deps: kube-assets containerd2 helm promtool
	@if ! command -v gcc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing gcc for the race detector"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null; \
	  else \
	    echo "the race detector needs gcc: install it (apt-get install gcc libc6-dev)" >&2; exit 1; \
	  fi; \
	fi
	@if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing iproute2 for the multi-host tests (internal/testbed)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 >/dev/null; \
	  else \
	    echo "the multi-host tests need root and ip and tc (apt-get install iproute2); without them they skip, or fail under CI=true" >&2; \
	  fi; \
	fi
	@if [ ! -x /usr/bin/containerd ] || [ ! -x /usr/bin/ctr ] || [ ! -x /usr/bin/docker-registry ] || [ ! -x /usr/sbin/runc ] || [ ! -x /usr/lib/cni/bridge ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing containerd, docker-registry, runc and the CNI plugins for the image and kubelet tests (internal/services, pkg/containerd, internal/kubenode, test/e2e)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends containerd docker-registry runc containernetworking-plugins >/dev/null; \
	  else \
	    echo "the image and kubelet tests need root, containerd, docker-registry, runc and the CNI plugins (apt-get install containerd docker-registry runc containernetworking-plugins); without them they skip, or fail under CI=true" >&2; \
	  fi; \
	fi
	@if [ "$$(uname -m)" = x86_64 ] && ! command -v aarch64-linux-gnu-gcc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's arm64 cross compiler for the arm64 image (internal/imagebuild)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross >/dev/null; \
	  else \
	    echo "the arm64 image needs gcc-aarch64-linux-gnu and libc6-dev-arm64-cross; without them its test skips, or fails under CI=true" >&2; \
	  fi; \
	fi

## test: go vet and every test with the race detector
test: test-deps
	$(GO) version
	$(GO) vet ./...
	CGO_ENABLED=1 $(GO) test -race -count=1 -timeout 30m ./...

## lint: gofmt, go vet and golangci-lint (installed into .tools/ from the module proxy)
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	@if [ ! -x $(TOOLS)/golangci-lint-$(GOLANGCI_LINT_VERSION) ]; then \
	  echo "installing golangci-lint $(GOLANGCI_LINT_VERSION) into .tools/ (a few minutes, once)"; \
	  GOBIN=$(TOOLS)/tmp $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION); \
	  mv $(TOOLS)/tmp/golangci-lint $(TOOLS)/golangci-lint-$(GOLANGCI_LINT_VERSION); rmdir $(TOOLS)/tmp; \
	fi
	$(TOOLS)/golangci-lint-$(GOLANGCI_LINT_VERSION) run --config .ci/golangci.yml ./...

## bench: run every whole-system benchmark under bench/*/ (each prints JSON lines)
bench: test-deps
	@if ! command -v curl >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing curl (bench/ingest's baseline)" >&2; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends curl ca-certificates >/dev/null; \
	fi
	@found=0; \
	for d in bench/*/; do \
	  [ -f "$$d/main.go" ] || continue; found=1; \
	  echo "# $${d%/}" >&2; \
	  $(GO) run ./$${d%/}; \
	done; \
	if [ $$found = 0 ]; then echo "no benchmarks under bench/ yet" >&2; fi

## fuzz: run each Fuzz* target for $(FUZZTIME)
fuzz:
	@targets=$$(grep -r --include='*_test.go' -o '^func Fuzz[A-Za-z0-9_]*' cmd pkg internal 2>/dev/null | sed 's/:func /:/' || true); \
	if [ -z "$$targets" ]; then echo "no fuzz targets"; exit 0; fi; \
	for t in $$targets; do \
	  dir=$$(dirname "$${t%%:*}"); name=$${t##*:}; \
	  echo "# $$name in ./$$dir"; \
	  $(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) ./$$dir; \
	done

## manifests: render deploy/daemonset, deploy/csi, deploy/scheduler and deploy/monitoring from the Helm chart (charts/weightd); a test in test/deploy fails while they differ
manifests: helm
	$(GO) run ./test/deploy/cmd/manifests

## metrics-doc: regenerate docs/metrics.md, the catalogue of every weightd metric, from the Go source (a test fails while it is stale)
metrics-doc:
	$(GO) run ./internal/metricscatalog -w docs/metrics.md

## clean: remove build outputs
clean:
	rm -rf bin
