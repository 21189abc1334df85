package imagebuild_test

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/imagebuild"
	"github.com/weightd/weightd/internal/services"
)

const (
	testVersion = "v0.0.0-imagebuild-test"
	testCommit  = "abc1234"
)

var testCreated = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

// binDir holds the weightd binaries the tests build, once per test binary.
var binDir string

func TestMain(m *testing.M) {
	var err error
	if binDir, err = os.MkdirTemp("", "imagebuild-test-"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(binDir)
	os.Exit(code)
}

// compiled builds weightd for one architecture at most once.
var compiled sync.Map // arch → func() (imagebuild.Binary, error)

func compile(t *testing.T, arch string) imagebuild.Binary {
	t.Helper()
	f, _ := compiled.LoadOrStore(arch, sync.OnceValues(func() (imagebuild.Binary, error) {
		return imagebuild.Compile(t.Context(), imagebuild.CompileOptions{
			ModuleDir: "../..",
			Arch:      arch,
			Out:       filepath.Join(binDir, arch, "weightd"),
			Version:   testVersion,
			Commit:    testCommit,
		})
	}))
	b, err := f.(func() (imagebuild.Binary, error))()
	require.NoError(t, err)
	return b
}

func build(t *testing.T, bins ...imagebuild.Binary) v1.ImageIndex {
	t.Helper()
	idx, err := imagebuild.Build(t.Context(), imagebuild.Options{
		Binaries: bins,
		Version:  testVersion,
		Revision: testCommit,
		Created:  testCreated,
	})
	require.NoError(t, err)
	return idx
}

var host struct {
	once sync.Once
	idx  v1.ImageIndex
}

// hostIndex is the index of the host's architecture alone, built once:
// compressing the binary's layer is slow under the race detector, so the
// tests that only read the image share it.
func hostIndex(t *testing.T) v1.ImageIndex {
	t.Helper()
	bin := compile(t, runtime.GOARCH)
	host.once.Do(func() { host.idx = build(t, bin) })
	if host.idx == nil {
		t.Fatal("building the host's image failed in another test")
	}
	return host.idx
}

// platformImage returns the image of idx for linux/arch.
func platformImage(t *testing.T, idx v1.ImageIndex, arch string) v1.Image {
	t.Helper()
	im, err := idx.IndexManifest()
	require.NoError(t, err)
	for _, d := range im.Manifests {
		if d.Platform != nil && d.Platform.OS == "linux" && d.Platform.Architecture == arch {
			img, err := idx.Image(d.Digest)
			require.NoError(t, err)
			return img
		}
	}
	t.Fatalf("no linux/%s image in the index", arch)
	return nil
}

// unpack applies the image's layers to a new directory, as a snapshotter
// would, and returns it.
func unpack(t *testing.T, img v1.Image) string {
	t.Helper()
	root := t.TempDir()
	layers, err := img.Layers()
	require.NoError(t, err)
	for _, l := range layers {
		rc, err := l.Uncompressed()
		require.NoError(t, err)
		tr := tar.NewReader(rc)
		for {
			hdr, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			require.NoError(t, err)
			name := path.Clean(hdr.Name)
			require.False(t, path.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../"), "layer path %q", hdr.Name)
			p := filepath.Join(root, name)
			mode := hdr.FileInfo().Mode()
			switch hdr.Typeflag {
			case tar.TypeDir:
				require.NoError(t, os.MkdirAll(p, 0o755))
				require.NoError(t, os.Chmod(p, mode&(os.ModePerm|os.ModeSticky)))
			case tar.TypeReg:
				f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode.Perm())
				require.NoError(t, err)
				_, err = io.Copy(f, tr)
				require.NoError(t, err)
				require.NoError(t, f.Close())
			case tar.TypeSymlink:
				require.NoError(t, os.Symlink(hdr.Linkname, p))
			default:
				t.Fatalf("unexpected entry %q of type %c", hdr.Name, hdr.Typeflag)
			}
		}
		require.NoError(t, rc.Close())
	}
	return root
}

// inRoot resolves p inside the unpacked image root, following its links,
// which must stay inside it, and returns the file on this machine.
func inRoot(t *testing.T, root, p string) string {
	t.Helper()
	real, err := filepath.EvalSymlinks(filepath.Join(root, p))
	require.NoError(t, err, "%s in the image", p)
	realRoot, err := filepath.EvalSymlinks(root)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(real, realRoot+"/"), "%s leads out of the image to %s", p, real)
	return real
}

// checkELF checks that the image's binary is an ELF for machine m whose
// loader and DT_NEEDED libraries (recursively) the image holds, as ELFs for
// m, where the dynamic loader looks for them.
func checkELF(t *testing.T, root string, m elf.Machine, tuple string) {
	t.Helper()
	bin := inRoot(t, root, imagebuild.BinaryPath)
	fi, err := os.Stat(bin)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o755), fi.Mode().Perm())
	f, err := elf.Open(bin)
	require.NoError(t, err)
	defer f.Close()
	assert.Equal(t, m, f.Machine)
	var interp string
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			b, err := io.ReadAll(p.Open())
			require.NoError(t, err)
			interp = strings.TrimRight(string(b), "\x00")
		}
	}
	require.NotEmpty(t, interp, "a dynamically linked binary")
	ld, err := elf.Open(inRoot(t, root, interp))
	require.NoError(t, err, "the loader %s", interp)
	assert.Equal(t, m, ld.Machine)
	ld.Close()

	needed, err := f.ImportedLibraries()
	require.NoError(t, err)
	require.Contains(t, needed, "libc.so.6")
	// What the binary needs, and what libnvidia-ml.so.1 needs when
	// go-nvml dlopens it.
	queue := append(needed, "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")
	seen := map[string]bool{}
	for len(queue) > 0 {
		lib := queue[0]
		queue = queue[1:]
		if seen[lib] {
			continue
		}
		seen[lib] = true
		// A directory of the loader's default search path.
		lf, err := elf.Open(inRoot(t, root, "/lib/"+tuple+"/"+lib))
		require.NoError(t, err, "%s in /lib/%s", lib, tuple)
		assert.Equal(t, m, lf.Machine, lib)
		more, err := lf.ImportedLibraries()
		require.NoError(t, err)
		queue = append(queue, more...)
		lf.Close()
	}
}

func TestImage(t *testing.T) {
	t.Parallel()
	idx := hostIndex(t)

	mt, err := idx.MediaType()
	require.NoError(t, err)
	assert.Equal(t, types.OCIImageIndex, mt)
	im, err := idx.IndexManifest()
	require.NoError(t, err)
	require.Len(t, im.Manifests, 1)
	assert.Equal(t, &v1.Platform{OS: "linux", Architecture: runtime.GOARCH, Variant: map[string]string{"arm64": "v8"}[runtime.GOARCH]}, im.Manifests[0].Platform)
	assert.Equal(t, testVersion, im.Annotations["org.opencontainers.image.version"])

	img := platformImage(t, idx, runtime.GOARCH)
	cf, err := img.ConfigFile()
	require.NoError(t, err)
	assert.Equal(t, []string{"weightd"}, cf.Config.Entrypoint)
	assert.Empty(t, cf.Config.Cmd)
	assert.Equal(t, []string{"PATH=" + imagebuild.PathEnv}, cf.Config.Env)
	assert.Equal(t, "/", cf.Config.WorkingDir)
	assert.Empty(t, cf.Config.User, "root")
	assert.Equal(t, map[string]string{
		"org.opencontainers.image.title":    "weightd",
		"org.opencontainers.image.version":  testVersion,
		"org.opencontainers.image.revision": testCommit,
		"org.opencontainers.image.source":   imagebuild.DefaultSource,
		"org.opencontainers.image.created":  "2026-01-02T03:04:05Z",
	}, cf.Config.Labels)
	assert.True(t, cf.Created.Equal(testCreated))
	m, err := img.Manifest()
	require.NoError(t, err)
	assert.Equal(t, types.OCIManifestSchema1, m.MediaType)
	require.Len(t, m.Layers, 2)
	for _, l := range m.Layers {
		assert.Equal(t, types.OCILayer, l.MediaType)
	}

	root := unpack(t, img)
	checkELF(t, root, map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[runtime.GOARCH],
		map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}[runtime.GOARCH])

	// The entrypoint is found on the image's PATH.
	found := ""
	for _, d := range strings.Split(imagebuild.PathEnv, ":") {
		if fi, err := os.Stat(filepath.Join(root, d, "weightd")); err == nil && fi.Mode().IsRegular() {
			found = path.Join(d, "weightd")
			break
		}
	}
	assert.Equal(t, imagebuild.BinaryPath, found)

	fi, err := os.Stat(filepath.Join(root, "tmp"))
	require.NoError(t, err)
	assert.Equal(t, os.ModeDir|os.ModeSticky|0o777, fi.Mode(), "/tmp")
	passwd, err := os.ReadFile(filepath.Join(root, "etc/passwd"))
	require.NoError(t, err)
	assert.Contains(t, string(passwd), "root:x:0:0:")
	group, err := os.ReadFile(filepath.Join(root, "etc/group"))
	require.NoError(t, err)
	assert.Contains(t, string(group), "root:x:0:")
	certs, err := os.ReadFile(filepath.Join(root, "etc/ssl/certs/ca-certificates.crt"))
	require.NoError(t, err)
	host, err := os.ReadFile(imagebuild.DefaultCACerts)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(host, certs), "the build machine's CA bundle")
}

// TestReproducible builds twice from the same inputs: a small dynamically
// linked program of this machine stands in for weightd, whose layer takes a
// minute to compress under the race detector.
func TestReproducible(t *testing.T) {
	t.Parallel()
	bin := smallBinary(t)
	dir := t.TempDir()
	var digests []v1.Hash
	var sums [][32]byte
	for i := range 2 {
		idx := build(t, bin)
		d, err := idx.Digest()
		require.NoError(t, err)
		digests = append(digests, d)
		out := filepath.Join(dir, fmt.Sprintf("image%d.tar", i))
		require.NoError(t, imagebuild.WriteTarball(out, "example.com/weightd:test", idx))
		b, err := os.ReadFile(out)
		require.NoError(t, err)
		sums = append(sums, sha256.Sum256(b))
	}
	assert.Equal(t, digests[0], digests[1], "the same index from the same inputs")
	assert.Equal(t, sums[0], sums[1], "the same tarball from the same inputs")
}

// smallBinary is true(1), a dynamically linked program for the host's
// architecture, as a Binary.
func smallBinary(t *testing.T) imagebuild.Binary {
	t.Helper()
	p, err := exec.LookPath("true")
	require.NoError(t, err)
	p, err = filepath.EvalSymlinks(p)
	require.NoError(t, err)
	return imagebuild.Binary{Path: p, Arch: runtime.GOARCH}
}

// requireRoot skips the test when the process is not root, except under
// CI=true, where it fails it.
func requireRoot(t *testing.T, why string) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("CI=true but %s needs root", why)
	}
	t.Skipf("skipping: %s needs root", why)
}

// TestRunsInImageRoot runs the binary from the image's own files: the
// image's loader and glibc, nothing of this machine's.
func TestRunsInImageRoot(t *testing.T) {
	t.Parallel()
	requireRoot(t, "chroot")
	root := unpack(t, platformImage(t, hostIndex(t), runtime.GOARCH))

	run := func(args ...string) (string, error) {
		cmd := &exec.Cmd{
			Path:        imagebuild.BinaryPath,
			Args:        append([]string{"weightd"}, args...),
			Env:         []string{"PATH=" + imagebuild.PathEnv},
			Dir:         "/",
			SysProcAttr: &syscall.SysProcAttr{Chroot: root},
		}
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := run("version")
	require.NoError(t, err, "%s", out)
	assert.Contains(t, out, "weightd "+testVersion+" (commit "+testCommit+",")
	assert.Contains(t, out, "linux/"+runtime.GOARCH)

	// go-nvml dlopens libnvidia-ml.so.1 through the image's loader: with
	// no driver it reports that cleanly, as on a node without GPUs.
	out, err = run("gpus")
	require.Error(t, err)
	assert.Contains(t, out, "no GPUs to show")
	assert.Contains(t, out, "ERROR_LIBRARY_NOT_FOUND")
}

// TestContainerd imports the tarball into a real containerd, which lists it
// under its name, and runs it there (runc, read-only root filesystem) as
// the DaemonSet's probes run it: `weightd ...` found on PATH.
func TestContainerd(t *testing.T) {
	t.Parallel()
	ctd := services.NewContainerdT(t, services.ContainerdConfig{})
	idx := hostIndex(t)
	tarball := filepath.Join(t.TempDir(), "weightd-image.tar")
	const ref = "127.0.0.1:5000/weightd:imagebuild-test"
	require.NoError(t, imagebuild.WriteTarball(tarball, ref, idx))

	ctx := t.Context()
	out, err := ctd.Ctr(ctx, "images", "import", tarball)
	require.NoError(t, err)
	t.Logf("%s", out)
	out, err = ctd.Ctr(ctx, "images", "ls", "-q")
	require.NoError(t, err)
	assert.Contains(t, strings.Fields(string(out)), ref)
	out, err = ctd.Ctr(ctx, "images", "check")
	require.NoError(t, err)
	assert.Regexp(t, regexp.QuoteMeta(ref)+`\s.*complete`, string(out))
	digest, err := idx.Digest()
	require.NoError(t, err)
	out, err = ctd.Ctr(ctx, "images", "ls")
	require.NoError(t, err)
	assert.Contains(t, string(out), digest.String(), "the image is the index")

	out, err = ctd.Ctr(ctx, "run", "--rm", "--read-only", "--net-host", ref, "imagebuild-test", "weightd", "version")
	require.NoError(t, err, "%s", out)
	assert.Contains(t, string(out), "weightd "+testVersion+" (commit "+testCommit+",")
}

// TestPush pushes to a real registry over plain HTTP on loopback and reads
// the index back.
func TestPush(t *testing.T) {
	t.Parallel()
	reg := services.NewRegistryT(t, services.RegistryConfig{})
	idx := hostIndex(t)
	ref := reg.Addr + "/weightd/weightd:imagebuild-test"
	require.NoError(t, imagebuild.Push(t.Context(), ref, idx, false))

	r, err := name.ParseReference(ref)
	require.NoError(t, err)
	got, err := remote.Index(r, remote.WithContext(t.Context()))
	require.NoError(t, err)
	want, err := idx.Digest()
	require.NoError(t, err)
	d, err := got.Digest()
	require.NoError(t, err)
	assert.Equal(t, want, d)
	img := platformImage(t, got, runtime.GOARCH)
	cf, err := img.ConfigFile()
	require.NoError(t, err)
	assert.Equal(t, testVersion, cf.Config.Labels["org.opencontainers.image.version"])
}

// TestContainerd2CRI pulls the image from a registry through the CRI of a
// containerd 2.x, as a kubelet pulls the DaemonSet's image, and runs it.
func TestContainerd2CRI(t *testing.T) {
	t.Parallel()
	bins := services.RequireContainerd2(t)
	reg := services.NewRegistryT(t, services.RegistryConfig{})
	ctd := services.NewContainerdT(t, services.ContainerdConfig{Binaries: bins})
	ctx := t.Context()
	ref := reg.Addr + "/weightd/weightd:imagebuild-test"
	require.NoError(t, imagebuild.Push(ctx, ref, hostIndex(t), false))
	hosts := filepath.Join(ctd.HostsDir, reg.Addr, "hosts.toml")
	require.NoError(t, os.MkdirAll(filepath.Dir(hosts), 0o755))
	require.NoError(t, os.WriteFile(hosts, []byte(`server = "http://`+reg.Addr+`"`+"\n"), 0o644))

	_, err := ctd.PullImageCRI(ctx, ref)
	require.NoError(t, err)
	out, err := ctd.Ctr(ctx, "run", "--rm", "--read-only", "--net-host", ref, "imagebuild-cri-test", "weightd", "version")
	require.NoError(t, err, "%s", out)
	assert.Contains(t, string(out), "weightd "+testVersion+" (commit "+testCommit+",")
}

// TestOtherArch builds the index of amd64 and arm64 with Debian's cross
// toolchain (make test-deps installs it on amd64 hosts); the other
// architecture's image is checked but not run. Without the toolchain it
// skips, except under CI=true, where it fails.
func TestOtherArch(t *testing.T) {
	t.Parallel()
	other := map[string]string{"amd64": "arm64", "arm64": "amd64"}[runtime.GOARCH]
	if other == "" {
		t.Skipf("skipping: host architecture %s", runtime.GOARCH)
	}
	if _, _, err := imagebuild.CrossCompiler(other); errors.Is(err, imagebuild.ErrNoCrossCompiler) {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true but %v", err)
		}
		t.Skipf("skipping: %v", err)
	}
	// The host's platform holds a small program: the race detector makes
	// compressing weightd's layer slow, and TestImage checks that one.
	idx := build(t, smallBinary(t), compile(t, other))
	im, err := idx.IndexManifest()
	require.NoError(t, err)
	var platforms []string
	for _, d := range im.Manifests {
		platforms = append(platforms, d.Platform.String())
	}
	slices.Sort(platforms)
	assert.Equal(t, []string{"linux/amd64", "linux/arm64/v8"}, platforms)

	root := unpack(t, platformImage(t, idx, other))
	checkELF(t, root, map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[other],
		map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}[other])
	cf, err := platformImage(t, idx, other).ConfigFile()
	require.NoError(t, err)
	assert.Equal(t, other, cf.Architecture)
	assert.Equal(t, []string{"weightd"}, cf.Config.Entrypoint)
}

func TestBuildRejects(t *testing.T) {
	t.Parallel()
	bin := compile(t, runtime.GOARCH)
	for _, tc := range []struct {
		name string
		opts imagebuild.Options
	}{
		{"no binaries", imagebuild.Options{}},
		{"wrong architecture", imagebuild.Options{Binaries: []imagebuild.Binary{{Path: bin.Path, Arch: map[string]string{"amd64": "arm64", "arm64": "amd64"}[runtime.GOARCH]}}}},
		{"unknown architecture", imagebuild.Options{Binaries: []imagebuild.Binary{{Path: bin.Path, Arch: "riscv64"}}}},
		{"twice the same architecture", imagebuild.Options{Binaries: []imagebuild.Binary{bin, bin}}},
		{"not an ELF", imagebuild.Options{Binaries: []imagebuild.Binary{{Path: imagebuild.DefaultCACerts, Arch: runtime.GOARCH}}}},
		{"no CA bundle", imagebuild.Options{Binaries: []imagebuild.Binary{bin}, CACerts: filepath.Join(t.TempDir(), "none.crt")}},
		{"libraries not found", imagebuild.Options{Binaries: []imagebuild.Binary{{Path: bin.Path, Arch: bin.Arch, LibDirs: []string{t.TempDir()}}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := imagebuild.Build(t.Context(), tc.opts)
			assert.Error(t, err)
		})
	}
	idx := hostIndex(t)
	for _, ref := range []string{"weightd@sha256:" + strings.Repeat("0", 64), "weightd/UPPER:x", "weightd:bad tag"} {
		assert.Error(t, imagebuild.WriteTarball(filepath.Join(t.TempDir(), "x.tar"), ref, idx), ref)
	}
}
