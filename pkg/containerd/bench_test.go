package containerd_test

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"

	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/services"
	ctrimport "github.com/weightd/weightd/pkg/containerd"
)

// BenchmarkImport imports an image of one uncompressed layer of each size
// into a fresh containerd: write the blob over gRPC, unpack, create the
// record. It reports MB/s of the layer.
func BenchmarkImport(b *testing.B) {
	for _, size := range []int64{16 << 20, 256 << 20} {
		b.Run(fmt.Sprintf("%dMiB", size>>20), func(b *testing.B) {
			store := openStore(b)
			fx := newFixture(b, store, "registry.example/bench:v1", fixtureOpts{bigLayer: size, seed: 99})
			b.SetBytes(size)
			for b.Loop() {
				b.StopTimer()
				ctd := services.NewContainerdT(b, services.ContainerdConfig{Dir: b.TempDir()})
				im, err := ctrimport.New(ctrimport.Config{Address: ctd.Address}, store)
				require.NoError(b, err)
				b.StartTimer()
				require.NoError(b, im.Import(b.Context(), fx.img))
				b.StopTimer()
				im.Close()
				require.NoError(b, ctd.Close())
				b.StartTimer()
			}
		})
	}
}

// BenchmarkContentWrite writes blobs of 256 MiB into a fresh containerd
// over the content API, as the importer does, with messages of each size
// and several writers at once. Besides MB/s it reports the CPU seconds
// spent per GiB by this process (reading, marshalling) and by containerd
// (unmarshalling, hashing, writing), and the seconds Commit takes (the
// fsync of the blob).
func BenchmarkContentWrite(b *testing.B) {
	const size = 256 << 20
	data := make([]byte, size)
	_, _ = rand.NewChaCha8([32]byte{7}).Read(data)
	path := filepath.Join(b.TempDir(), "blob")
	require.NoError(b, os.WriteFile(path, data, 0o644))
	for _, chunk := range []int{128 << 10, 512 << 10, 1 << 20, 4 << 20, 8 << 20, 15 << 20} {
		for _, writers := range []int{1, 4} {
			for _, client := range []string{"default", "importer"} {
				b.Run(fmt.Sprintf("chunk=%dKiB/writers=%d/client=%s", chunk>>10, writers, client), func(b *testing.B) {
					benchContentWrite(b, data, path, chunk, writers, client == "importer")
				})
			}
		}
	}
}

func benchContentWrite(b *testing.B, data []byte, path string, chunk, writers int, importerClient bool) {
	const size = 256 << 20
	ctd := services.NewContainerdT(b, services.ContainerdConfig{Dir: b.TempDir()})
	var opts []containerd.Opt
	if importerClient {
		opts = ctrimport.DialOpts()
	}
	client, err := containerd.New(ctd.Address, opts...)
	require.NoError(b, err)
	defer client.Close()
	ctx := namespaces.WithNamespace(b.Context(), "bench")
	cs := client.ContentStore()
	pid := daemonPID(b, ctd)
	b.SetBytes(int64(size * writers))
	var selfCPU, daemonCPU, commit time.Duration
	var commits int
	for i := 0; b.Loop(); i++ {
		// A distinct blob per writer and round: the data, its end
		// replaced by a salt.
		b.StopTimer()
		salts := make([][]byte, writers)
		digests := make([]digest.Digest, writers)
		for w := range writers {
			salts[w] = fmt.Appendf(nil, "%d-%d", i, w)
			dg := digest.SHA256.Digester()
			dg.Hash().Write(data[:size-len(salts[w])])
			dg.Hash().Write(salts[w])
			digests[w] = dg.Digest()
		}
		b.StartTimer()
		self0, daemon0 := cpuSelf(), cpuOf(b, pid)
		var g errgroup.Group
		var mu sync.Mutex
		for w := range writers {
			g.Go(func() error {
				f, err := os.Open(path)
				if err != nil {
					return err
				}
				defer f.Close()
				salt, d := salts[w], digests[w]
				ref := "bench-" + d.Encoded()
				cw, err := content.OpenWriter(ctx, cs, content.WithRef(ref), content.WithDescriptor(ocispec.Descriptor{Digest: d, Size: size}))
				if err != nil {
					return err
				}
				defer cw.Close()
				r := io.MultiReader(io.NewSectionReader(f, 0, int64(size-len(salt))), bytes.NewReader(salt))
				if _, err := io.CopyBuffer(struct{ io.Writer }{cw}, r, make([]byte, chunk)); err != nil {
					return err
				}
				start := time.Now()
				if err := cw.Commit(ctx, size, d); err != nil {
					return err
				}
				mu.Lock()
				commit += time.Since(start)
				commits++
				mu.Unlock()
				// containerd's GC may have taken it already: it is in no lease.
				if err := cs.Delete(ctx, d); err != nil && !errdefs.IsNotFound(err) {
					return err
				}
				return nil
			})
		}
		require.NoError(b, g.Wait())
		selfCPU += cpuSelf() - self0
		daemonCPU += cpuOf(b, pid) - daemon0
	}
	gib := float64(b.N) * float64(size*writers) / (1 << 30)
	b.ReportMetric(selfCPU.Seconds()/gib, "client-cpu-s/GiB")
	b.ReportMetric(daemonCPU.Seconds()/gib, "containerd-cpu-s/GiB")
	b.ReportMetric(commit.Seconds()/float64(commits), "commit-s/blob")
}

// daemonPID finds the containerd process started for ctd.
func daemonPID(tb testing.TB, ctd *services.Containerd) int {
	tb.Helper()
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", d.Name(), "cmdline"))
		if strings.HasPrefix(string(cmdline), services.ContainerdBinary) && strings.Contains(string(cmdline), ctd.Dir) {
			return pid
		}
	}
	tb.Fatal("containerd's process not found")
	return 0
}

// cpuOf is the user and system CPU time of process pid.
func cpuOf(tb testing.TB, pid int) time.Duration {
	tb.Helper()
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	require.NoError(tb, err)
	s := string(stat)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	utime, _ := strconv.ParseInt(fields[11], 10, 64)
	stime, _ := strconv.ParseInt(fields[12], 10, 64)
	return time.Duration(utime+stime) * time.Second / 100 // USER_HZ
}

// cpuSelf is this process's user and system CPU time.
func cpuSelf() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
