package imagebuild

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestWithParents(t *testing.T) {
	t.Parallel()
	got, err := withParents([]entry{
		file("usr/local/bin/weightd", 0o755, []byte("x")),
		dir("tmp", 0o1777),
		symlink("lib", "usr/lib"),
		dir("usr", 0o700),
	})
	require.NoError(t, err)
	var names []string
	for _, e := range got {
		names = append(names, e.name)
	}
	assert.Equal(t, []string{"lib", "tmp", "usr", "usr/local", "usr/local/bin", "usr/local/bin/weightd"}, names)
	assert.Equal(t, int64(0o700), got[2].mode, "a listed directory keeps its mode")
	assert.Equal(t, int64(0o755), got[3].mode)

	for _, bad := range [][]entry{
		{file("/etc/passwd", 0o644, nil)},
		{file("etc/../passwd", 0o644, nil)},
		{file("etc//passwd", 0o644, nil)},
		{file("etc", 0o644, nil), file("etc/passwd", 0o644, nil)},
		{file("etc/passwd", 0o644, nil), file("etc/passwd", 0o644, nil)},
	} {
		_, err := withParents(bad)
		assert.Error(t, err, bad[0].name)
	}
}

func TestWriteTar(t *testing.T) {
	t.Parallel()
	src := filepath.Join(t.TempDir(), "src")
	require.NoError(t, os.WriteFile(src, []byte("contents"), 0o600))
	e, err := copyOf("usr/local/bin/weightd", 0o755, src)
	require.NoError(t, err)
	entries, err := withParents([]entry{e, dir("tmp", 0o1777), symlink("lib", "usr/lib")})
	require.NoError(t, err)
	mtime := time.Unix(1700000000, 0)
	var buf bytes.Buffer
	require.NoError(t, writeTar(&buf, entries, mtime))

	tr := tar.NewReader(&buf)
	var hdrs []*tar.Header
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		hdrs = append(hdrs, h)
	}
	require.Len(t, hdrs, 6)
	for _, h := range hdrs {
		assert.True(t, h.ModTime.Equal(mtime), h.Name)
		assert.Zero(t, h.Uid+h.Gid, h.Name)
	}
	assert.Equal(t, "tmp/", hdrs[1].Name)
	assert.Equal(t, int64(0o1777), hdrs[1].Mode)
	assert.Equal(t, "usr/local/bin/weightd", hdrs[5].Name)
	assert.Equal(t, int64(8), hdrs[5].Size)

	// A source that changes size between the listing and the write.
	require.NoError(t, os.WriteFile(src, []byte("longer contents"), 0o600))
	assert.Error(t, writeTar(&bytes.Buffer{}, entries, mtime))
}

// TestLoaderLinks checks where each architecture's loader is reached from
// its PT_INTERP path, as in Debian 12.
func TestLoaderLinks(t *testing.T) {
	t.Parallel()
	ca := filepath.Join(t.TempDir(), "ca.crt")
	require.NoError(t, os.WriteFile(ca, []byte("PEM"), 0o644))
	for _, tc := range []struct {
		arch, interp string
		want         map[string]string // symbolic links
	}{
		{"amd64", "/lib64/ld-linux-x86-64.so.2", map[string]string{
			"lib":                            "usr/lib",
			"lib64":                          "usr/lib64",
			"usr/lib64/ld-linux-x86-64.so.2": "../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
		}},
		{"arm64", "/lib/ld-linux-aarch64.so.1", map[string]string{
			"lib":                           "usr/lib",
			"usr/lib/ld-linux-aarch64.so.1": "aarch64-linux-gnu/ld-linux-aarch64.so.1",
		}},
	} {
		t.Run(tc.arch, func(t *testing.T) {
			a, err := lookupArch(tc.arch)
			require.NoError(t, err)
			entries, err := baseFiles(a, tc.interp, nil, ca)
			require.NoError(t, err)
			links := map[string]string{}
			for _, e := range entries {
				if e.typ == tar.TypeSymlink {
					links[e.name] = e.link
				}
			}
			assert.Equal(t, tc.want, links)
		})
	}
	a, _ := lookupArch("amd64")
	_, err := baseFiles(a, "/opt/ld.so", nil, ca)
	assert.Error(t, err)
}

func TestResolveLibsStatic(t *testing.T) {
	t.Parallel()
	_, err := resolveLibs(elfInfo{machine: elf.EM_X86_64}, []string{"/lib"}, elf.EM_X86_64)
	assert.ErrorContains(t, err, "static")
}
