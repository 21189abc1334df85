package s3_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/opencontainers/go-digest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/weightd/weightd/internal/s3test"
	"github.com/weightd/weightd/internal/sourcetest"
	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/prefetch"
	"github.com/weightd/weightd/pkg/ref"
	"github.com/weightd/weightd/pkg/source"
	httpsource "github.com/weightd/weightd/pkg/source/http"
	"github.com/weightd/weightd/pkg/source/s3"
)

// s3Files is a small multi-file model, one file in a subdirectory and two
// with the same bytes.
func s3Files() map[string][]byte {
	shard, _ := sourcetest.BlobData(300 << 10)
	return map[string][]byte{
		"config.json":                       []byte(`{"model_type":"llama"}`),
		"tokenizer/tokenizer.json":          []byte(`{"vocab":{}}`),
		"model-00001-of-00002.safetensors":  shard,
		"model-00002-of-00002.safetensors":  append([]byte("second"), shard[:1000]...),
		"copy-of-config/config.json":        []byte(`{"model_type":"llama"}`),
		"generation_config.json":            []byte(`{}`),
		"model.safetensors.index.json":      []byte(`{"weight_map":{}}`),
		"README.md":                         []byte("# model\n"),
		"nested/deeper/still/file.txt":      []byte("deep"),
		"special_tokens_map.json":           []byte(`{"bos_token":"<s>"}`),
		"tokenizer/tokenizer_config.json":   []byte(`{"add_bos_token":true}`),
		"model-00002-of-00002.safetensors2": []byte("x"),
	}
}

// startS3 starts a server holding bucket.
func startS3(t *testing.T, bucket string, versioned bool, opts ...s3test.Option) *s3test.Server {
	t.Helper()
	srv, err := s3test.Start(opts...)
	require.NoError(t, err)
	t.Cleanup(func() { srv.Close() })
	require.NoError(t, srv.CreateBucket(t.Context(), bucket, versioned))
	return srv
}

// putModel stores files under prefix; with checksums, each announces its
// full-object SHA-256.
func putModel(t *testing.T, srv *s3test.Server, bucket, prefix string, files map[string][]byte, checksums bool) {
	t.Helper()
	for p, data := range files {
		_, err := srv.Put(t.Context(), bucket, prefix+p, data)
		require.NoError(t, err)
		if checksums {
			srv.SetChecksum(bucket, prefix+p, s3test.FullObject(data))
		}
	}
}

// manifestOf is the model.json of files.
func manifestOf(t *testing.T, revision string, files map[string][]byte) []byte {
	t.Helper()
	m := httpsource.Manifest{Name: "org/model", Revision: revision}
	for p, data := range files {
		m.Files = append(m.Files, httpsource.ManifestFile{Path: p, Size: int64(len(data)), SHA256: digest.FromBytes(data).Encoded()})
	}
	b, err := json.Marshal(m)
	require.NoError(t, err)
	return b
}

// newS3Source is a source for srv, path-style, with the agent's static
// credentials.
func newS3Source(t *testing.T, srv *s3test.Server, opts ...s3.Option) *s3.Source {
	t.Helper()
	opts = append([]s3.Option{
		s3.WithEndpoint(srv.URL), s3.WithPathStyle(true),
		s3.WithCredentials(credentials.NewStaticCredentialsProvider("agent", "secret", "")),
	}, opts...)
	src, err := s3.New(nil, opts...)
	require.NoError(t, err)
	return src
}

// fetchS3 fetches ref through a queue into a fresh store (real cache) and
// returns the job's final status.
func fetchS3(t *testing.T, src source.Source, ref string) (prefetch.JobStatus, error) {
	t.Helper()
	q := prefetch.NewQueue(sourcetest.OpenStore(t), src, prefetch.WithResolveRetries(1, 0))
	sourcetest.RunQueue(t, q)
	j, err := q.Submit(ref, prefetch.PriorityNormal)
	require.NoError(t, err)
	return sourcetest.Wait(t, j)
}

// assertFiles checks that dir holds exactly files.
func assertFiles(t *testing.T, dir string, files map[string][]byte) {
	t.Helper()
	n := 0
	require.NoError(t, filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		want, ok := files[filepath.ToSlash(rel)]
		if assert.True(t, ok, "unexpected file %s", rel) {
			got, err := os.ReadFile(p)
			require.NoError(t, err)
			assert.Equal(t, want, got, rel)
		}
		n++
		return nil
	}))
	assert.Equal(t, len(files), n)
}

func TestManifestModel(t *testing.T) {
	t.Parallel()
	srv := startS3(t, "models", false)
	files := s3Files()
	putModel(t, srv, "models", "llama/v1/", files, false)
	_, err := srv.Put(t.Context(), "models", "llama/v1/model.json", manifestOf(t, "main", files))
	require.NoError(t, err)
	srv.ResetRequests()

	st, err := fetchS3(t, newS3Source(t, srv), "s3://models/llama/v1")
	require.NoError(t, err)
	assert.Equal(t, prefetch.StateReady, st.State)
	parsed, _ := ref.Parse("s3://models/llama/v1")
	assert.Equal(t, source.ModelName(parsed), st.Model)
	assertFiles(t, st.Dir, files)
	for _, r := range srv.Requests() {
		assert.True(t, r.Signed, "%s %s carried no credentials", r.Method, r.Path)
		assert.True(t, strings.HasPrefix(r.Path, "/models/"), "path-style: %s", r.Path)
	}
}

func TestListingWithChecksums(t *testing.T) {
	t.Parallel()
	srv := startS3(t, "models", false)
	files := s3Files()
	putModel(t, srv, "models", "llama/", files, true)
	// Another model beside it, sharing the prefix's first letters, is no
	// part of it.
	_, err := srv.Put(t.Context(), "models", "llama-other/x.bin", []byte("no"))
	require.NoError(t, err)
	_, err = srv.Put(t.Context(), "models", "llama/", nil) // a folder marker
	require.NoError(t, err)

	src := newS3Source(t, srv)
	r, err := ref.Parse("s3://models/llama/")
	require.NoError(t, err)
	res, err := src.Resolve(t.Context(), r)
	require.NoError(t, err)
	require.Len(t, res.Model.Files, len(files))
	for _, f := range res.Model.Files {
		assert.Equal(t, digest.FromBytes(files[f.Path]), f.Digest, f.Path)
	}
	again, err := src.Resolve(t.Context(), r)
	require.NoError(t, err)
	assert.Equal(t, res.Model.Revision, again.Model.Revision, "the same files, the same revision")

	st, err := fetchS3(t, src, "s3://models/llama")
	require.NoError(t, err)
	assertFiles(t, st.Dir, files)
}

func TestRefusals(t *testing.T) {
	t.Parallel()
	srv := startS3(t, "models", false)
	data := []byte("weights")
	for key, c := range map[string]*s3test.Checksum{
		"none/a.bin":      nil,
		"composite/a.bin": {SHA256: s3test.FullObject(data).SHA256 + "-2", Type: "COMPOSITE"},
		"typed/a.bin":     {SHA256: s3test.FullObject(data).SHA256, Type: "COMPOSITE"},
		"untyped/a.bin":   {SHA256: s3test.FullObject(data).SHA256 + "-2"}, // a store that names no type
		"old/a.bin":       {SHA256: s3test.FullObject(data).SHA256},        // nor for a full-object one
		"wrong/a.bin":     &[]s3test.Checksum{s3test.FullObject([]byte("other"))}[0],
		"wrong-url/a.bin": nil,
	} {
		_, err := srv.Put(t.Context(), "models", key, data)
		require.NoError(t, err)
		if c != nil {
			srv.SetChecksum("models", key, *c)
		}
	}
	_, err := srv.Put(t.Context(), "models", "wrong-url/model.json",
		[]byte(`{"name":"a","revision":"main","files":[{"path":"a.bin","size":7,"sha256":"`+digest.FromBytes(data).Encoded()+`","url":"https://elsewhere.example/a.bin"}]}`))
	require.NoError(t, err)
	src := newS3Source(t, srv)

	for _, tc := range []struct{ ref, want string }{
		{"s3://models/none", "no full-object SHA-256 checksum"},
		{"s3://models/composite", "no full-object SHA-256 checksum"},
		{"s3://models/typed", "no full-object SHA-256 checksum"},
		{"s3://models/untyped", "no full-object SHA-256 checksum"},
		{"s3://models/old", ""},
		{"s3://models/empty", "no objects under s3://models/empty/"},
		{"s3://models/none@v1", "no such object version"},
		{"s3://models/wrong-url", "has a url"},
		{"s3://models/none/a.bin#" + digest.FromBytes([]byte("x")).String(), ""},
		{"s3://missing-bucket/x", "NoSuchBucket"},
	} {
		r, err := ref.Parse(tc.ref)
		require.NoError(t, err)
		res, err := src.Resolve(t.Context(), r)
		if tc.want == "" {
			require.NoError(t, err, tc.ref) // the digest is checked as the bytes arrive (below)
			continue
		}
		require.Error(t, err, tc.ref)
		assert.Nil(t, res)
		assert.Contains(t, err.Error(), tc.want, tc.ref)
		assert.ErrorIs(t, err, content.ErrPermanent, tc.ref)
		if strings.Contains(tc.want, "checksum") {
			assert.ErrorIs(t, err, s3.ErrUnverifiable, tc.ref)
		}
	}

	// A checksum the bytes do not match is refused when they arrive.
	st, err := fetchS3(t, src, "s3://models/wrong")
	require.Error(t, err)
	assert.Contains(t, st.Error, "digest")
	// So is a pinned digest.
	st, err = fetchS3(t, src, "s3://models/none/a.bin#"+digest.FromBytes([]byte("x")).String())
	require.Error(t, err)
	assert.Contains(t, st.Error, "digest")
	// A store checksum that disagrees with the pin is refused at once.
	r, _ := ref.Parse("s3://models/wrong/a.bin#" + digest.FromBytes(data).String())
	_, err = src.Resolve(t.Context(), r)
	assert.ErrorIs(t, err, content.ErrDigestMismatch)
}

func TestPinnedObjectAndVersion(t *testing.T) {
	t.Parallel()
	srv := startS3(t, "models", true)
	v1 := map[string][]byte{"a.bin": []byte("one")}
	v2 := map[string][]byte{"a.bin": []byte("two, longer")}
	putModel(t, srv, "models", "m/", v1, false)
	ver1, err := srv.Put(t.Context(), "models", "m/model.json", manifestOf(t, "v1", v1))
	require.NoError(t, err)
	require.NotEmpty(t, ver1, "gofakes3 keeps versions")
	src := newS3Source(t, srv)

	// The manifest's version pins the old files; the bytes are read from
	// the current objects, so once they change the pin is refused, never
	// served wrong.
	st, err := fetchS3(t, src, "s3://models/m@"+ver1)
	require.NoError(t, err)
	assertFiles(t, st.Dir, v1)

	putModel(t, srv, "models", "m/", v2, false)
	_, err = srv.Put(t.Context(), "models", "m/model.json", manifestOf(t, "v2", v2))
	require.NoError(t, err)
	st, err = fetchS3(t, src, "s3://models/m")
	require.NoError(t, err)
	assertFiles(t, st.Dir, v2)
	_, err = fetchS3(t, src, "s3://models/m@"+ver1)
	require.Error(t, err)

	// One object pinned by digest, no checksum or manifest needed.
	st, err = fetchS3(t, src, "s3://models/m/a.bin#"+digest.FromBytes(v2["a.bin"]).String())
	require.NoError(t, err)
	assertFiles(t, st.Dir, v2)
}

func TestRangedResume(t *testing.T) {
	t.Parallel()
	// The first full GET of the shard breaks off after 200 KiB; the cache
	// resumes from its last verified chunk with a ranged GET.
	var cut atomic.Bool
	srv := startS3(t, "models", false, s3test.WithMiddleware(func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, ".safetensors") && cut.CompareAndSwap(false, true) {
				next.ServeHTTP(&cutWriter{ResponseWriter: w, left: 200 << 10}, r)
				panic(http.ErrAbortHandler)
			}
			next.ServeHTTP(w, r)
		})
	}))
	shard, _ := sourcetest.BlobData(1 << 20)
	files := map[string][]byte{"model.safetensors": shard, "config.json": []byte("{}")}
	putModel(t, srv, "models", "r/", files, true)
	src := newS3Source(t, srv)

	st, err := fetchS3(t, src, "s3://models/r")
	require.NoError(t, err)
	assertFiles(t, st.Dir, files)
	require.True(t, cut.Load())
	var ranges []string
	for _, r := range srv.Requests() {
		if r.Method == http.MethodGet && strings.HasSuffix(r.Path, ".safetensors") {
			ranges = append(ranges, r.Range)
		}
	}
	require.Len(t, ranges, 2, "one cut GET, one resumed")
	assert.Equal(t, "bytes=0-1048575", ranges[0])
	assert.NotEqual(t, "bytes=0-1048575", ranges[1], "resumed past the first byte")
	assert.True(t, strings.HasSuffix(ranges[1], "-1048575"))

	// OpenBoundedRange reads exactly a chunk, as the swarm asks the origin.
	parsed, _ := ref.Parse("s3://models/r")
	res, err := src.Resolve(t.Context(), parsed)
	require.NoError(t, err)
	rc, err := res.Blobs[digest.FromBytes(shard)].(interface {
		OpenBoundedRange(context.Context, int64, int64) (io.ReadCloser, error)
	}).OpenBoundedRange(t.Context(), 1000, 5000)
	require.NoError(t, err)
	got, err := io.ReadAll(rc)
	rc.Close()
	require.NoError(t, err)
	assert.Equal(t, shard[1000:6000], got)
}

// cutWriter passes on the first left bytes of a body, then drops the rest.
type cutWriter struct {
	http.ResponseWriter
	left int
}

func (w *cutWriter) Write(p []byte) (int, error) {
	if w.left <= 0 {
		return 0, errors.New("cut")
	}
	n := min(len(p), w.left)
	w.left -= n
	if _, err := w.ResponseWriter.Write(p[:n]); err != nil {
		return 0, err
	}
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
	if n < len(p) {
		return n, errors.New("cut")
	}
	return n, nil
}

func TestAgentCredentials(t *testing.T) {
	t.Parallel()
	srv := startS3(t, "public", false)
	require.NoError(t, srv.CreateBucket(t.Context(), "team-a", false))
	files := map[string][]byte{"a.bin": []byte("a")}
	putModel(t, srv, "public", "m/", files, true)
	putModel(t, srv, "team-a", "m/", files, true)
	rules, err := source.ParseAgentCredentials([]string{"s3://team-a=team-a"})
	require.NoError(t, err)
	src := newS3Source(t, srv, s3.WithAgentCredentials(rules))

	for _, tc := range []struct {
		ns, ref string
		signed  bool
	}{
		{"", "s3://public/m", true},        // the operator
		{"team-b", "s3://public/m", false}, // no rule for the bucket
		{"team-b", "s3://team-a/m", false}, // the rule names another namespace
		{"team-a", "s3://team-a/m", true},  // the rule
		{"team-a", "s3://public/m", false}, // but for its bucket only
		{source.UnknownNamespace, "s3://team-a/m", false},
	} {
		srv.ResetRequests()
		parsed, err := ref.Parse(tc.ref)
		require.NoError(t, err)
		res, err := src.Resolve(source.WithRequester(t.Context(), tc.ns), parsed)
		require.NoError(t, err, "gofakes3 does not check signatures: every request succeeds")
		for _, open := range res.Blobs {
			rc, err := open.OpenRange(t.Context(), 0)
			require.NoError(t, err)
			rc.Close()
		}
		reqs := srv.Requests()
		require.NotEmpty(t, reqs)
		for _, r := range reqs {
			assert.Equal(t, tc.signed, r.Signed, "%q %s: %s %s", tc.ns, tc.ref, r.Method, r.Path)
		}
	}
}

func TestVirtualHostedStyle(t *testing.T) {
	t.Parallel()
	srv := startS3(t, "models", false)
	files := map[string][]byte{"a.bin": []byte("a"), "b/c.bin": []byte("bc")}
	putModel(t, srv, "models", "vh/", files, true)
	client := &http.Client{Transport: &http.Transport{DialContext: s3test.DialLoopback(srv.Addr)}}
	src, err := s3.New(client, s3.WithEndpoint("http://"+srv.VirtualHostBase), s3.WithRegion("eu-west-3"))
	require.NoError(t, err)
	srv.ResetRequests()

	st, err := fetchS3(t, src, "s3://models/vh")
	require.NoError(t, err)
	assertFiles(t, st.Dir, files)
	reqs := srv.Requests()
	require.NotEmpty(t, reqs)
	for _, r := range reqs {
		assert.Equal(t, "models."+srv.VirtualHostBase, r.Host)
		assert.False(t, strings.HasPrefix(r.Path, "/models"), r.Path)
		assert.False(t, r.Signed, "no credentials given: anonymous")
	}
}

func TestOptions(t *testing.T) {
	t.Parallel()
	for _, e := range []string{"ftp://x", "http://", "https://u:p@host", "https://host?x=1", "https://host:99999", "::"} {
		_, err := s3.New(nil, s3.WithEndpoint(e))
		assert.ErrorIs(t, err, content.ErrInvalid, e)
	}
	for _, spec := range []string{"s3://Bad_Bucket=ns", "s3://ab=ns", "s3://a..b=ns"} {
		_, err := source.ParseAgentCredentials([]string{spec})
		assert.ErrorIs(t, err, content.ErrInvalid, spec)
	}
	a, err := source.ParseAgentCredentials([]string{"s3://models=*"})
	require.NoError(t, err)
	assert.True(t, a.Allow("s3://models", "any"))
	assert.False(t, a.Allow("models", "any"), "a bucket rule is no host rule")
}
