package hf

import (
	"errors"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
)

func FuzzTree(f *testing.F) {
	oid := strings.Repeat("0", 40)
	sha := strings.Repeat("a", 64)
	for _, s := range []string{
		`[]`, `null`, `[{}]`,
		`[{"type":"directory","oid":"` + oid + `","size":0,"path":"sub"}]`,
		`[{"type":"file","oid":"` + oid + `","size":7,"path":"config.json"}]`,
		`[{"type":"file","oid":"` + oid + `","size":7,"path":"m.safetensors","lfs":{"oid":"` + sha + `","size":7,"pointerSize":134}}]`,
		`[{"type":"file","oid":"` + oid + `","size":7,"path":"../x"}]`,
		`[{"type":"file","oid":"` + oid + `","size":-1,"path":"x"}]`,
		`[{"type":"file","oid":"` + oid + `","size":1e30,"path":"x"}]`,
		`[{"type":"file","PATH":"x","path":"y","oid":"` + oid + `","size":1}]`,
		`[{"type":"file","oid":"` + oid + `","size":1,"path":"a\u0000b"}]`,
		`[] x`, `{"a":1}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		entries, err := parseTree(data)
		if err != nil {
			if !errors.Is(err, content.ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		for _, e := range entries {
			if e.Type == "directory" {
				continue
			}
			if e.Type != "file" {
				t.Fatalf("type %q accepted", e.Type)
			}
			if err := content.ValidatePath(e.Path); err != nil {
				t.Fatalf("path %q accepted: %v", e.Path, err)
			}
			if e.Size < 0 {
				t.Fatalf("size %d accepted", e.Size)
			}
			if e.LFS != nil {
				if _, err := content.ParseDigest("sha256:" + e.LFS.OID); err != nil || e.LFS.Size != e.Size {
					t.Fatalf("LFS %+v accepted for size %d", e.LFS, e.Size)
				}
			} else if !isHex(e.OID, 40) {
				t.Fatalf("oid %q accepted", e.OID)
			}
		}
	})
}

func TestParseHFTreeLFS(t *testing.T) {
	t.Parallel()
	sha := strings.Repeat("a", 64)
	oid := strings.Repeat("0", 40)
	entries, err := parseTree([]byte(`[
		{"type":"file","oid":"` + oid + `","size":100,"path":"a.bin","lfs":{"oid":"` + sha + `","size":100,"pointerSize":134},"xetHash":"x","lastCommit":{}},
		{"type":"file","oid":"` + oid + `","size":134,"path":"b.bin","lfs":{"oid":"sha256:` + sha + `","size":100,"pointerSize":134}},
		{"type":"directory","oid":"` + oid + `","size":0,"path":"d"}
	]`))
	require.NoError(t, err)
	require.Len(t, entries, 3)
	for _, e := range entries[:2] {
		assert.Equal(t, int64(100), e.Size, e.Path)
		assert.Equal(t, sha, e.LFS.OID, e.Path)
	}
	_, err = parseTree([]byte(`[{"type":"file","oid":"` + oid + `","size":7,"path":"a","lfs":{"oid":"` + sha + `","size":100,"pointerSize":134}}]`))
	assert.ErrorIs(t, err, content.ErrInvalid)
}

func TestNextLink(t *testing.T) {
	t.Parallel()
	base, err := url.Parse("https://hub.example/api/models/o/m/tree/c?recursive=true")
	require.NoError(t, err)
	for header, want := range map[string]string{
		"": "",
		`<https://hub.example/api/models/o/m/tree/c?recursive=true&cursor=abc>; rel="next"`: "https://hub.example/api/models/o/m/tree/c?recursive=true&cursor=abc",
		`<?cursor=x>; rel=next`: "https://hub.example/api/models/o/m/tree/c?cursor=x",
		`<https://a/prev>; rel="prev", <https://a/next>; rel="next"`: "https://a/next",
		`<https://a/next>; title="a, b; c"; rel="prev next"`:         "https://a/next",
		`<https://a/x>; rel="prev"`:                                  "",
		`<https://a/x#frag>; REL="NEXT"`:                             "https://a/x",
	} {
		var values []string
		if header != "" {
			values = []string{header}
		}
		u, err := nextLink(values, base)
		require.NoError(t, err, header)
		if want == "" {
			assert.Nil(t, u, header)
		} else if assert.NotNil(t, u, header) {
			assert.Equal(t, want, u.String(), header)
		}
	}
	for _, bad := range []string{`https://a; rel=next`, `<https://a`, `<https://a> rel=next`, `<ftp://a>; rel=next`, `<https://a>; title="x`} {
		_, err := nextLink([]string{bad}, base)
		assert.ErrorIs(t, err, content.ErrInvalid, bad)
	}
}

func FuzzLink(f *testing.F) {
	for _, s := range []string{
		`<https://hub.example/x?cursor=1>; rel="next"`,
		`<a>; rel=prev, <b>; rel=next`,
		`<a>; title="x, y"; rel="next"`,
		`<`, `;`, `<a>;;;`, `<a>; rel`,
	} {
		f.Add(s)
	}
	base, _ := url.Parse("https://hub.example/api/models/o/m/tree/c")
	f.Fuzz(func(t *testing.T, header string) {
		u, err := nextLink([]string{header}, base)
		if err != nil {
			if !errors.Is(err, content.ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			return
		}
		if u != nil && u.Scheme != "http" && u.Scheme != "https" {
			t.Fatalf("scheme %q accepted", u.Scheme)
		}
	})
}
