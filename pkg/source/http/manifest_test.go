package httpsource_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/pkg/content"
	httpsource "github.com/weightd/weightd/pkg/source/http"
)

const (
	hexA = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	hexB = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
)

// manifestJSON builds a manifest document with the given files objects.
func manifestJSON(files ...string) string {
	return `{"name":"org/model","revision":"main","files":[` + strings.Join(files, ",") + `]}`
}

func fileJSON(path string, size int64, sum string) string {
	return fmt.Sprintf(`{"path":%q,"size":%d,"sha256":%q}`, path, size, sum)
}

func TestParseManifest(t *testing.T) {
	t.Parallel()
	doc := `
	{
	  "revision": "0123456789abcdef0123456789abcdef01234567",
	  "files": [
	    {"sha256": "` + hexA + `", "path": "config.json", "size": 123},
	    {"path": "sub/dir/model.safetensors", "size": 0, "sha256": "` + hexB + `", "url": "https://other.example/x?sig=1"},
	    {"path": "copy.json", "size": 123, "sha256": "` + hexA + `", "url": "../elsewhere/config.json"}
	  ],
	  "name": "org/model"
	}
	`
	m, err := httpsource.ParseManifest([]byte(doc))
	require.NoError(t, err)
	assert.Equal(t, &httpsource.Manifest{
		Name:     "org/model",
		Revision: "0123456789abcdef0123456789abcdef01234567",
		Files: []httpsource.ManifestFile{
			{Path: "config.json", Size: 123, SHA256: hexA},
			{Path: "sub/dir/model.safetensors", Size: 0, SHA256: hexB, URL: "https://other.example/x?sig=1"},
			{Path: "copy.json", Size: 123, SHA256: hexA, URL: "../elsewhere/config.json"},
		},
	}, m)

	model := m.Model()
	require.NoError(t, model.Validate())
	assert.Equal(t, "org/model", model.Name)
	assert.Equal(t, content.File{Path: "config.json", Descriptor: content.Descriptor{Digest: "sha256:" + hexA, Size: 123}}, model.Files[0])

	// The manifest marshals back to a document that parses to the same.
	data, err := json.Marshal(m)
	require.NoError(t, err)
	again, err := httpsource.ParseManifest(data)
	require.NoError(t, err)
	assert.Equal(t, m, again)
}

func TestParseManifestInvalid(t *testing.T) {
	t.Parallel()
	ok := fileJSON("config.json", 1, hexA)
	tests := []struct {
		name, doc, why string
	}{
		{"empty", ``, "unexpected EOF"},
		{"not an object", `[]`, `want "{"`},
		{"truncated", manifestJSON(ok)[:30], "unexpected EOF"},
		{"syntax", `{"name":"org/model",}`, "invalid character"},
		{"trailing data", manifestJSON(ok) + `{}`, "trailing data"},
		{"trailing garbage", manifestJSON(ok) + ` x`, "trailing data"},
		{"unknown key", `{"name":"org/model","revision":"main","extra":1,"files":[` + ok + `]}`, `unknown key "extra"`},
		{"unknown file key", manifestJSON(`{"path":"a","size":1,"sha256":"` + hexA + `","mode":420}`), `unknown key "mode"`},
		{"key of another case", `{"Name":"org/model","revision":"main","files":[` + ok + `]}`, `unknown key "Name"`},
		{"duplicate key", `{"name":"org/model","name":"org/other","revision":"main","files":[` + ok + `]}`, `duplicate key "name"`},
		{"missing key", `{"name":"org/model","files":[` + ok + `]}`, `missing key "revision"`},
		{"missing file key", manifestJSON(`{"path":"a","size":1}`), `missing key "sha256"`},
		{"null name", `{"name":null,"revision":"main","files":[` + ok + `]}`, "want a string, got null"},
		{"null files", `{"name":"org/model","revision":"main","files":null}`, `want "["`},
		{"null size", manifestJSON(`{"path":"a","size":null,"sha256":"` + hexA + `"}`), "want an integer, got null"},
		{"no files", manifestJSON(), "no files"},
		{"bad name", `{"name":"org/a--b","revision":"main","files":[` + ok + `]}`, "model name"},
		{"bad revision", `{"name":"org/model","revision":"../x","files":[` + ok + `]}`, "revision"},
		{"dot-dot path", manifestJSON(fileJSON("../etc/passwd", 1, hexA)), "not clean"},
		{"dot-dot inside", manifestJSON(fileJSON("a/../../b", 1, hexA)), "not clean"},
		{"absolute path", manifestJSON(fileJSON("/etc/passwd", 1, hexA)), "absolute"},
		{"NUL in path", manifestJSON(`{"path":"a\u0000b","size":1,"sha256":"` + hexA + `"}`), "NUL"},
		{"backslash in path", manifestJSON(fileJSON(`a\b`, 1, hexA)), "NUL or backslash"},
		{"empty path", manifestJSON(fileJSON("", 1, hexA)), "path length"},
		{"duplicate path", manifestJSON(ok, fileJSON("config.json", 2, hexB)), "duplicate file"},
		{"file and directory", manifestJSON(fileJSON("a", 1, hexA), fileJSON("a/b", 2, hexB)), "both a file and a directory"},
		{"negative size", manifestJSON(fileJSON("a", -1, hexA)), "negative size"},
		{"fractional size", manifestJSON(`{"path":"a","size":1.5,"sha256":"` + hexA + `"}`), "want an integer, got 1.5"},
		{"exponent size", manifestJSON(`{"path":"a","size":1e3,"sha256":"` + hexA + `"}`), "want an integer, got 1e3"},
		{"string size", manifestJSON(`{"path":"a","size":"1","sha256":"` + hexA + `"}`), "want an integer, got a string"},
		{"huge size", manifestJSON(`{"path":"a","size":9223372036854775808,"sha256":"` + hexA + `"}`), "want an integer, got 9223372036854775808"},
		{"total overflows", manifestJSON(fileJSON("a", 1<<62, hexA), fileJSON("b", 1<<62, hexB), fileJSON("c", 1<<62, strings.Repeat("c", 64))), "overflows"},
		{"uppercase digest", manifestJSON(fileJSON("a", 1, strings.ToUpper(hexA))), "64 lowercase hex"},
		{"short digest", manifestJSON(fileJSON("a", 1, hexA[:63])), "64 lowercase hex"},
		{"prefixed digest", manifestJSON(fileJSON("a", 1, "sha256:"+hexA)), "64 lowercase hex"},
		{"empty digest", manifestJSON(fileJSON("a", 1, "")), "64 lowercase hex"},
		{"one digest two sizes", manifestJSON(fileJSON("a", 1, hexA), fileJSON("b", 2, hexA)), "listed with sizes 1 and 2"},
		{"url scheme", manifestJSON(`{"path":"a","size":1,"sha256":"` + hexA + `","url":"file:///etc/passwd"}`), "not http or https"},
		{"url userinfo", manifestJSON(`{"path":"a","size":1,"sha256":"` + hexA + `","url":"https://u:p@h.example/a"}`), "user information"},
		{"url fragment", manifestJSON(`{"path":"a","size":1,"sha256":"` + hexA + `","url":"a#b"}`), "fragment"},
		{"url space", manifestJSON(`{"path":"a","size":1,"sha256":"` + hexA + `","url":"a b"}`), "printable ASCII"},
		{"url no host", manifestJSON(`{"path":"a","size":1,"sha256":"` + hexA + `","url":"https:///a"}`), "host is missing"},
		{"url bad escape", manifestJSON(`{"path":"a","size":1,"sha256":"` + hexA + `","url":"%zz"}`), "not a URL"},
		{"oversize", manifestJSON(fileJSON("a", 1, hexA)) + strings.Repeat(" ", httpsource.MaxManifestSize), "larger than"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := httpsource.ParseManifest([]byte(tt.doc))
			require.Error(t, err)
			assert.ErrorIs(t, err, content.ErrInvalid)
			assert.ErrorContains(t, err, tt.why)
			assert.True(t, strings.HasPrefix(err.Error(), "parsing manifest: "), err.Error())
		})
	}
}

func TestParseManifestFileLimit(t *testing.T) {
	t.Parallel()
	build := func(n int) []byte {
		var b bytes.Buffer
		b.WriteString(`{"name":"org/model","revision":"main","files":[`)
		for i := range n {
			if i > 0 {
				b.WriteByte(',')
			}
			fmt.Fprintf(&b, `{"path":"f%d","size":1,"sha256":"%064x"}`, i, i)
		}
		b.WriteString(`]}`)
		return b.Bytes()
	}
	m, err := httpsource.ParseManifest(build(httpsource.MaxManifestFiles))
	require.NoError(t, err)
	assert.Len(t, m.Files, httpsource.MaxManifestFiles)

	_, err = httpsource.ParseManifest(build(httpsource.MaxManifestFiles + 1))
	assert.ErrorIs(t, err, content.ErrInvalid)
	assert.ErrorContains(t, err, "more than 100000 files")
}

func TestReadManifest(t *testing.T) {
	t.Parallel()
	doc := manifestJSON(fileJSON("a", 1, hexA))
	m, err := httpsource.ReadManifest(iotest.OneByteReader(strings.NewReader(doc)))
	require.NoError(t, err)
	assert.Equal(t, "a", m.Files[0].Path)

	// An endless document is cut off at the limit, not read whole.
	endless := iotest.OneByteReader(&repeatReader{b: ' '})
	_, err = httpsource.ReadManifest(endless)
	assert.ErrorIs(t, err, content.ErrInvalid)
	assert.ErrorContains(t, err, "larger than")

	// A read error is not a parse error.
	_, err = httpsource.ReadManifest(iotest.ErrReader(errors.New("boom")))
	assert.ErrorContains(t, err, "reading manifest: boom")
	assert.NotErrorIs(t, err, content.ErrInvalid)
}

type repeatReader struct{ b byte }

func (r *repeatReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = r.b
	}
	return len(p), nil
}

func FuzzParseManifest(f *testing.F) {
	for _, s := range []string{
		manifestJSON(fileJSON("config.json", 123, hexA)),
		manifestJSON(fileJSON("config.json", 123, hexA), fileJSON("sub/model.safetensors", 1<<40, hexB)),
		manifestJSON(`{"path":"a","size":1,"sha256":"` + hexA + `","url":"https://other.example/x?sig=1"}`),
		manifestJSON(`{"path":"a","size":1,"sha256":"` + hexA + `","url":"../x/a"}`),
		manifestJSON(fileJSON("../etc/passwd", 1, hexA)),
		manifestJSON(fileJSON("a", 1, hexA), fileJSON("a", 1, hexA)),
		manifestJSON(fileJSON("a", 1, hexA), fileJSON("a/b", 1, hexB)),
		manifestJSON(fileJSON("a", -1, hexA)),
		manifestJSON(fileJSON("a", 1, strings.ToUpper(hexA))),
		`{"name":"org/model","revision":"main","files":[],"x":1}`,
		`{"name":"org/model","name":"x","revision":"main","files":[]}`,
		`{"name":null,"revision":"main","files":[]}`,
		manifestJSON(fileJSON("a", 1, hexA)) + "{}",
		`{"files":[{"path":"a","size":1e2,"sha256":"` + hexA + `"}]}`,
		`[`,
		``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		m, err := httpsource.ParseManifest(data)
		if err != nil {
			if !errors.Is(err, content.ErrInvalid) {
				t.Fatalf("error %v does not wrap content.ErrInvalid", err)
			}
			return
		}
		if err := m.Model().Validate(); err != nil {
			t.Fatalf("accepted a manifest whose model is invalid: %v", err)
		}
		if len(m.Files) == 0 || len(m.Files) > httpsource.MaxManifestFiles {
			t.Fatalf("accepted %d files", len(m.Files))
		}
		out, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		again, err := httpsource.ParseManifest(out)
		if err != nil {
			t.Fatalf("re-encoded manifest %s does not parse: %v", out, err)
		}
		if !assert.ObjectsAreEqual(m, again) {
			t.Fatalf("manifest changed on a round trip: %+v != %+v", m, again)
		}
	})
}
