package imagebuild

import (
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
)

// ErrUnsupportedArch is returned for an architecture other than amd64 and
// arm64.
var ErrUnsupportedArch = errors.New("unsupported architecture")

// arch is what the build needs to know of one architecture.
type arch struct {
	// tuple is Debian's multiarch tuple: the library directory's name
	// (/usr/lib/<tuple>), the cross compiler's prefix (<tuple>-gcc) and
	// the cross sysroot (/usr/<tuple>).
	tuple   string
	machine elf.Machine
	// variant is the OCI platform's variant.
	variant string
	// pkgs are the Debian packages of the cross toolchain that builds for
	// this architecture on another.
	pkgs string
}

var arches = map[string]arch{
	"amd64": {tuple: "x86_64-linux-gnu", machine: elf.EM_X86_64, pkgs: "gcc-x86-64-linux-gnu libc6-dev-amd64-cross"},
	"arm64": {tuple: "aarch64-linux-gnu", machine: elf.EM_AARCH64, variant: "v8", pkgs: "gcc-aarch64-linux-gnu libc6-dev-arm64-cross"},
}

func lookupArch(goarch string) (arch, error) {
	a, ok := arches[goarch]
	if !ok {
		return arch{}, fmt.Errorf("%w %q (amd64 or arm64)", ErrUnsupportedArch, goarch)
	}
	return a, nil
}

// DefaultLibDirs returns the directories of this machine that hold glibc's
// shared libraries for goarch: the host's own library directories for the
// host's architecture, Debian's cross sysroot (/usr/<tuple>/lib) for the
// other.
func DefaultLibDirs(goarch string) ([]string, error) {
	a, err := lookupArch(goarch)
	if err != nil {
		return nil, err
	}
	if goarch != runtime.GOARCH {
		return []string{filepath.Join("/usr", a.tuple, "lib")}, nil
	}
	dirs := []string{"/lib/" + a.tuple, "/usr/lib/" + a.tuple}
	if goarch == "amd64" {
		// Where distributions without multiarch directories keep them.
		dirs = append(dirs, "/lib64", "/usr/lib64")
	}
	return append(dirs, "/lib", "/usr/lib"), nil
}

// dlopenLibs are the glibc libraries the image carries beyond the binary's
// own needs: libnvidia-ml.so.1, which go-nvml dlopens, names them as
// DT_NEEDED (since glibc 2.34 the last three are stubs, but the loader must
// still find them).
var dlopenLibs = []string{"libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1"}

// lib is a shared library to put in the image.
type lib struct {
	name string // its DT_NEEDED name (the soname), its file name in the image
	src  string // its file on this machine
}

// elfInfo is what the build reads from an ELF file.
type elfInfo struct {
	machine elf.Machine
	interp  string   // PT_INTERP, empty for a library or a static binary
	needed  []string // DT_NEEDED
}

func readELF(file string) (elfInfo, error) {
	f, err := elf.Open(file)
	if err != nil {
		return elfInfo{}, err
	}
	defer f.Close()
	info := elfInfo{machine: f.Machine}
	for _, p := range f.Progs {
		if p.Type != elf.PT_INTERP {
			continue
		}
		b := make([]byte, p.Filesz)
		if _, err := p.ReadAt(b, 0); err != nil {
			return elfInfo{}, fmt.Errorf("reading PT_INTERP of %s: %w", file, err)
		}
		info.interp = strings.TrimRight(string(b), "\x00")
	}
	if info.needed, err = f.ImportedLibraries(); err != nil {
		return elfInfo{}, fmt.Errorf("reading DT_NEEDED of %s: %w", file, err)
	}
	return info, nil
}

// resolveLibs returns the dynamic loader (interp's base name) and every
// library that the binary and dlopenLibs need, recursively, found by name in
// dirs; each must be an ELF file of machine m.
func resolveLibs(bin elfInfo, dirs []string, m elf.Machine) ([]lib, error) {
	if bin.interp == "" {
		return nil, errors.New("a static binary (no PT_INTERP): build it with CGO_ENABLED=1")
	}
	var libs []lib
	seen := map[string]bool{}
	queue := append([]string{path.Base(bin.interp)}, bin.needed...)
	queue = append(queue, dlopenLibs...)
	for len(queue) > 0 {
		name := queue[0]
		queue = queue[1:]
		if seen[name] {
			continue
		}
		seen[name] = true
		if strings.Contains(name, "/") {
			return nil, fmt.Errorf("DT_NEEDED %q is a path", name)
		}
		src, info, err := findLib(name, dirs, m)
		if err != nil {
			return nil, err
		}
		libs = append(libs, lib{name: name, src: src})
		queue = append(queue, info.needed...)
	}
	slices.SortFunc(libs, func(a, b lib) int { return strings.Compare(a.name, b.name) })
	return libs, nil
}

// findLib finds the library name in the first of dirs that holds one of
// machine m, as the dynamic loader would, and returns its file with
// symbolic links resolved.
func findLib(name string, dirs []string, m elf.Machine) (string, elfInfo, error) {
	for _, dir := range dirs {
		p, err := filepath.EvalSymlinks(filepath.Join(dir, name))
		if err != nil {
			continue
		}
		info, err := readELF(p)
		if err != nil || info.machine != m {
			continue
		}
		return p, info, nil
	}
	return "", elfInfo{}, fmt.Errorf("%s for %v: %w in %s", name, m, os.ErrNotExist, strings.Join(dirs, ", "))
}
