// Package imagebuild builds weightd's container image without a Docker
// daemon: from weightd binaries built with cgo (go-nvml dlopens the NVIDIA
// driver's libnvidia-ml.so.1, which needs glibc), it assembles an OCI image
// per architecture and an image index over them with go-containerregistry,
// writes it as an OCI image layout tarball that `ctr images import` takes,
// and pushes it to a registry. `make image` runs it through cmd/image; the
// Dockerfile at the repository root builds the same image with a container
// builder.
//
// Each image has two layers. The first is a minimal glibc root filesystem
// taken from this machine: the shared libraries the binary needs (its
// DT_NEEDED entries, resolved recursively, and the dynamic loader of its
// PT_INTERP) plus the rest of glibc's runtime libraries that a dlopened
// driver library needs (libm, libdl, libpthread, librt), laid out as
// Debian 12 lays them out (merged /usr, /usr/lib/<multiarch tuple>, where
// the NVIDIA container runtime mounts libnvidia-ml); /etc/passwd and
// /etc/group with root; /etc/nsswitch.conf; the CA certificates of
// /etc/ssl/certs/ca-certificates.crt (the agent calls Hugging Face and
// registries over TLS); /tmp with mode 1777 and /root. The second holds the
// binary at /usr/local/bin/weightd. There is no shell. The entrypoint is
// weightd, run as root, from /; nothing in the image needs to be written, so
// it runs with a read-only root filesystem.
//
// Builds are reproducible where that is cheap: every file's time and the
// image's creation time are Options.Created (make image takes
// SOURCE_DATE_EPOCH, else the commit's time), owners are 0, entries are
// sorted and gzip streams carry no time, so the same binaries and host
// libraries give the same digests.
//
// Architectures: the host's (the libraries from /lib/<tuple> and
// /usr/lib/<tuple>), and the other of amd64 and arm64 when Debian's cross
// toolchain is installed (gcc-aarch64-linux-gnu and libc6-dev-arm64-cross
// on an amd64 host, or gcc-x86-64-linux-gnu and libc6-dev-amd64-cross on an
// arm64 one): Compile builds the binary with <tuple>-gcc and the libraries
// come from /usr/<tuple>/lib, which holds the same glibc as Debian's
// libc6 for that architecture. Without the cross toolchain, cmd/image builds
// the host's architecture alone and says so. The image for the other
// architecture is checked for its files and ELF headers but cannot be run
// here (no emulator).
package imagebuild
