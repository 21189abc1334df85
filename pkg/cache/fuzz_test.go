package cache

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/weightd/weightd/pkg/content"
)

func FuzzValidatePath(f *testing.F) {
	for _, s := range []string{"config.json", "a/b/c.safetensors", "../x", "/etc/passwd", "a/./b", "a\x00", "", "a//b", `a\b`, "..", "a/.."} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		if content.ValidatePath(p) != nil {
			return
		}
		// An accepted path stays inside any directory it is joined to.
		if !filepath.IsLocal(p) || filepath.Clean(p) != p || strings.ContainsRune(p, 0) {
			t.Fatalf("accepted unsafe path %q", p)
		}
		root := "/cache/models/x"
		if !strings.HasPrefix(filepath.Join(root, p), root+"/") {
			t.Fatalf("path %q escapes", p)
		}
	})
}

func FuzzParseDigest(f *testing.F) {
	for _, s := range []string{"sha256:" + strings.Repeat("a", 64), "sha256:", "", ":", "sha512:" + strings.Repeat("a", 128), "sha256:../" + strings.Repeat("a", 61), "sha256:" + strings.Repeat("A", 64)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		d, err := content.ParseDigest(s)
		if err != nil {
			return
		}
		if d.Algorithm() != digest.SHA256 || len(d.Encoded()) != 64 || strings.ContainsAny(d.Encoded(), "/.ABCDEF") {
			t.Fatalf("accepted %q", s)
		}
	})
}

func FuzzValidateModelName(f *testing.F) {
	for _, s := range []string{"org/name", "name", "a/b/c", "a/b/c/d", "a-/-b", "../x", "org--x/y", "org/x.", "Qwen/Qwen2.5-7B-Instruct"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		if content.ValidateModelName(name) != nil {
			return
		}
		dir := "models--" + strings.ReplaceAll(name, "/", "--")
		parts := strings.Split(dir, "--")
		if !filepath.IsLocal(dir) || strings.Contains(dir, "/") || len(parts) > 4 ||
			strings.Join(parts[1:], "/") != name { // distinct names are distinct directories
			t.Fatalf("accepted %q", name)
		}
	})
}

// FuzzPartialState feeds arbitrary bytes as a saved download state: a torn
// or tampered file must be rejected or accepted consistently, never panic.
func FuzzPartialState(f *testing.F) {
	f.Add([]byte(`{"version":2,"digest":"sha256:` + strings.Repeat("a", 64) + `","size":10,"chunkSize":65536,"have":"AQ==","chunks":"` + strings.Repeat("A", 43) + `=","hashed":10,"hashState":""}`))
	f.Add([]byte(`{"version":2,"chunkSize":0,"hashed":5}`))
	f.Add([]byte(`{`))
	root := f.TempDir()
	s, err := Open(root, WithChunkSize(64<<10))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { s.Close() })
	desc := content.Descriptor{Digest: digest.Digest("sha256:" + strings.Repeat("a", 64)), Size: 10}
	f.Fuzz(func(t *testing.T, b []byte) {
		if err := os.WriteFile(s.partialStatePath(desc.Digest), b, 0o600); err != nil {
			t.Fatal(err)
		}
		st := s.readState(desc)
		if st == nil {
			return
		}
		n := chunkCount(desc.Size, st.ChunkSize)
		if st.Hashed > desc.Size || len(st.Chunks) != n*32 || len(st.Have) != (n+7)/8 {
			t.Fatalf("accepted inconsistent state %+v", st)
		}
		for i := range int(st.Hashed / st.ChunkSize) {
			if !st.has(i) {
				t.Fatalf("hashed prefix covers missing chunk %d", i)
			}
		}
	})
}
